"""Engine benchmark; same as `rolloutctl bench engine`. Example:

python bench/engine.py --preset medium --ranks 2 --batch 1,8 --context 128 --json out/bench-medium.json
"""

import sys

from rollout_operator.cli.main import main

if __name__ == "__main__":
    sys.argv = [sys.argv[0], "bench", "engine", *sys.argv[1:]]
    main()
