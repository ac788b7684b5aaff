"""Planner benchmark (thin wrapper around rollout_profiler.sim.bench).

python bench/planner.py                  # 3 seeds per workload, prints the table
python bench/planner.py --runs 5 --json bench-planner.json
"""

from __future__ import annotations

import argparse
import json
import sys

from rollout_profiler.sim import bench as bench_planner


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", metavar="OUT", help="write the results as JSON to OUT")
    ap.add_argument("--runs", type=int, default=3, help="seeds per workload (default 3)")
    ap.add_argument("--profile", help="profile JSON (default: the shipped Llama-3.1-8B modelled profile)")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be >= 1")
    result = bench_planner.run(runs=args.runs, profile=args.profile)
    print(bench_planner.report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
