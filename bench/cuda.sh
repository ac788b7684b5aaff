#!/usr/bin/env bash
# The CUDA path on a GPU machine (README, "The CUDA path"), in parts, each under its own time limit:
#   tests          the GPU tests (bfloat16, ranks sharing the GPU, CUDA graphs, paged attention against the
#                  CPU path, the deterministic kernels' batch invariance)
#   kernel         the paged decode kernel's tests, compiled for the GPU (against SDPA, batch invariance)
#   invariance     which kernels round a row by its batch on this GPU (bench/cuda_invariance.py)
#   bench          Llama-3.1-8B's shape in bfloat16, eager against CUDA graphs (BREAKDOWN=1: with a profile
#                  of each step, several minutes more)
#   deterministic  the same shape, the deterministic kernels against the default ones, eager
#   det-graphs     the same, both with CUDA graphs
#   paged          keys gathered against the pages read in place (the paged decode kernel), batch 1 to 256,
#                  with CUDA graphs
#   paged-eager    the same, eager (the dense slab the paged pool replaced is not run: its figures are recorded
#                  in bench/results/h200-2026-11-26b/call3/bench-engine-slab-h200.json)
# Usage (repository root, on the GPU machine): [OUT=DIR] bench/cuda.sh [PART ...]   (default: all)
# Uses the machine's own torch; our small pure-Python dependencies come as wheels in .whl/ when present.
set -uo pipefail
out=${OUT:-build/cuda}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
root="$PWD"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$root/worker:$root/profiler:$root/operator:$root/bench:$root"
export PYTHONUNBUFFERED=1
py=$(python3 -c 'import sys; print(sys.executable)')
cli="$(dirname "$py")/rolloutctl"  # the servers the tests start run the console script next to python
if [ ! -x "$cli" ]; then
  printf '#!/bin/sh\nexec "%s" -m rollout_operator.cli.main "$@"\n' "$py" >"$cli"
  chmod +x "$cli"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")
bench_engine() {  # bench engine of Llama-3.1-8B's shape, bfloat16, one rank: SECONDS NAME ARGS...
  local limit=$1 name=$2
  shift 2
  timeout "$limit" python3 -m rollout_operator.cli.main bench engine --device cuda --preset llama-3.1-8b --dtype bfloat16 \
    --ranks 1 "$@" --json "$out/bench-engine-$name-$gpu.json" 2>&1 | tee "$out/bench-engine-$name.log"
}
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(kernel paged tests paged-eager invariance deterministic det-graphs bench)
rc=0
for what in "${parts[@]}"; do
  echo "=== $what ($(date +%T))"
  case "$what" in
    tests)
      timeout 240 python3 -m pytest -p no:cacheprovider -m gpu tests/worker/engine/test_gpu.py -v -rs -s \
        --timeout 120 2>&1 | tee "$out/gpu-tests.log"
      rc=$((rc || PIPESTATUS[0])) ;;
    kernel)
      timeout 120 python3 -m pytest -p no:cacheprovider tests/worker/engine/kernels/test_paged_decode.py -v -rs \
        --timeout 100 2>&1 | tee "$out/kernel-tests.log"
      rc=$((rc || PIPESTATUS[0])) ;;
    invariance)
      timeout 120 python3 bench/cuda_invariance.py "$out/cuda-invariance-$gpu.json" 2>&1 | tee "$out/invariance.log"
      rc=$((rc || PIPESTATUS[0])) ;;
    bench)
      bench_engine 300 graphs --batch 1,16,64,256 --context 512,4096 --steps 20 --runs 2 \
        --cuda-graphs both ${BREAKDOWN:+--breakdown}
      rc=$((rc || PIPESTATUS[0])) ;;
    deterministic)
      bench_engine 200 deterministic --batch 1,16,64 --context 512,4096 --steps 20 --runs 2 \
        --deterministic both
      rc=$((rc || PIPESTATUS[0])) ;;
    det-graphs)
      bench_engine 200 det-graphs --batch 1,16,64 --context 512,4096 --steps 20 --runs 2 \
        --deterministic both --cuda-graphs on
      rc=$((rc || PIPESTATUS[0])) ;;
    paged)
      bench_engine 200 paged --batch 1,16,64,256 --context 512,4096 --steps 20 --runs 2 --cuda-graphs on \
        --paged-attention both
      rc=$((rc || PIPESTATUS[0])) ;;
    paged-eager)
      bench_engine 200 paged-eager --batch 1,16,64,256 --context 512,4096 --steps 20 --runs 2 --cuda-graphs off \
        --paged-attention both
      rc=$((rc || PIPESTATUS[0])) ;;
    *) echo "unknown part $what (kernel | tests | invariance | bench | deterministic | det-graphs | paged | paged-eager)"
       exit 2 ;;
  esac
done
exit $rc
