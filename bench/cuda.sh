#!/usr/bin/env bash
# The CUDA path on a GPU machine (README, "The CUDA path"): the GPU tests, then the step-time table of
# Llama-3.1-8B's shape in bfloat16, eager against CUDA graphs, with a profile of where each step goes.
# Usage (repository root, on the GPU machine): [OUT=DIR] bench/cuda.sh [tests] [bench]
# Uses the machine's own torch; our small pure-Python dependencies come as wheels in .whl/ when present.
set -uo pipefail
out=${OUT:-build/cuda}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/worker:$PWD/profiler:$PWD/operator:$PWD"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests bench)
rc=0
for what in "${parts[@]}"; do
  case "$what" in
    tests)
      timeout 300 python3 -m pytest -p no:cacheprovider -m gpu tests/worker/engine/test_gpu.py -v -rs 2>&1 \
        | tee "$out/gpu-tests.log"
      rc=$(( rc || PIPESTATUS[0] )) ;;
    bench)
      timeout 420 python3 -m rollout_operator.cli.main bench engine --device cuda --preset llama-3.1-8b \
        --dtype bfloat16 --ranks 1 --batch 1,8,32,64,128,256 --context 512,4096 --steps 20 --runs 3 \
        --cuda-graphs both --breakdown --json "$out/bench-engine-llama-3.1-8b-h100.json" 2>&1 \
        | tee "$out/bench-engine.log"
      rc=$(( rc || PIPESTATUS[0] )) ;;
    *) echo "unknown part $what (tests | bench)"; exit 2 ;;
  esac
done
exit $rc
