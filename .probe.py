import sys, time
sys.path.insert(0, "/work/main")
from pathlib import Path
from tests.profiler.sim.test_paged_agreement import _lengths, _engine_retractions, _sim_retractions
from rollout_worker.engine.checkpoint import make_model
import torch
torch.set_num_threads(1)
m = Path("/tmp/tiny64probe")
if not m.exists():
    make_model("tiny", 0, m, "float64")
for seed, n, prompt in [(1, 32, 8), (2, 48, 5), (3, 40, 12)]:
    L = _lengths(seed, n)
    base = -(-(prompt + max(L)) // 4) + 1
    for pages in (base, base + 40, base + 100):
        t = time.time()
        e = _engine_retractions(m, L, prompt, pages, 16)
        s = _sim_retractions(L, prompt, pages, 16)
        print(seed, n, prompt, pages, "engine", e, "sim", s, f"{time.time()-t:.1f}s", max(L), sum(L), flush=True)
