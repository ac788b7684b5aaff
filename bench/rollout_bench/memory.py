"""``rolloutctl bench memory``: the paged KV pool against the dense slab it replaced, on the same long-tailed
requests and the same KV budget, side by side in one run.

* the dense slab: the engine of an older commit (default 5904b9b, the last with the slab), extracted with
  ``git archive`` under the work folder (or any checkout given as ``--slab-tree``). Its KV cache is one
  slab ``[slots, heads, capacity, dim]`` per layer, whose capacity follows the longest running request,
  and it admits a request only while the ``prompt + max_new_tokens`` of those running fit the budget;
* the paged engine: this tree (pages of ``page_size`` tokens, optimistic admission, retraction), twice:
  with the same budget setting, and with a pool of the bytes the slab actually allocated at most (its
  slots x capacity can exceed the budget, which bounds only its reservations): the same KV bytes;
* requests: ``n`` prompts of ``prompt_len`` random tokens, new-token counts lognormal (the quantiles of a
  lognormal with the given median whose longest is ``longest``, in a seeded shuffled order), EOS ignored,
  one replica of one rank, the tiny random-weight model in float32;
* each run measures the three (in turn, the order reversed every other run) with the same measuring code
  (:mod:`rollout_bench.memory_probe`, run in a fresh process against either tree).

Measured per engine and run, from every step's report: KV utilisation in the bulk phase (the decode steps
while a request waits for memory): tokens held / tokens allocated (paged: the pages in use x page size;
slab: slots x capacity), the median over those steps, and the budget's use (tokens held / budget); the
largest running batch; the most tokens allocated at once; generation tokens/s on the whole set (first
submit to last finish); retractions. Ratios (paged / slab) are taken within each run, then the median.
The slab's peak is taken from its first run (its schedule does not depend on timing).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from statistics import NormalDist
from typing import Any

from rollout_worker.config.model_config import ModelConfig

from rollout_bench import sharing as bench_sharing

Echo = Callable[[str], Any]
SLAB_COMMIT = "5904b9b"  # the last commit with the dense slab
ENGINES = ("slab", "paged", "paged_at_slab")  # the last: a pool of the bytes the slab allocated at most
PAGED = ENGINES[1:]
LABELS = {
    "slab": "dense slab",
    "paged": "paged, same budget",
    "paged_at_slab": "paged, the slab's peak bytes",
}
PROBE = Path(__file__).with_name("bench_memory_probe.py")


def tail_lengths(n: int, median: float, longest: int, seed: int = 0) -> list[int]:
    """``n`` new-token counts: the ``(i + 0.5) / n`` quantiles of the lognormal of this median whose
    highest quantile is ``longest``, shuffled with ``seed`` (each at least 1)."""
    if n < 2 or not 1 <= median < longest:
        raise ValueError(f"need n >= 2 and 1 <= median < longest, got {n}, {median}, {longest}")
    z = [NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)]
    sigma = math.log(longest / median) / z[-1]
    lens = [max(1, round(median * math.exp(sigma * zi))) for zi in z]
    lens[-1] = longest
    random.Random(seed).shuffle(lens)
    return lens


def requests(lengths: Sequence[int], prompt_len: int, vocab: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {"id": f"m{i}", "input_ids": [rng.randrange(vocab) for _ in range(prompt_len)], "max_new_tokens": k}
        for i, k in enumerate(lengths)
    ]


def summarise(result: dict[str, Any], budget: int) -> dict[str, Any]:
    """One engine's run: bulk-phase utilisation, largest batch, peak allocation, tokens/s, retractions."""
    steps = result["steps"]
    decode = [s for s in steps if s["kind"] == "decode"]
    bulk = [s for s in decode if s["waiting"] > 0]
    if not bulk:  # nothing ever waited: the decode steps before the first request finished
        first = next((i for i, s in enumerate(steps) if s["finished"]), len(steps))
        bulk = [s for s in steps[:first] if s["kind"] == "decode"]
    tokens = sum(result["tokens"].values())
    return {
        "gen_s": result["gen_s"],
        "tokens": tokens,
        "tokens_per_s": tokens / result["gen_s"] if result["gen_s"] > 0 else 0.0,
        "max_running": max((s["running"] for s in steps), default=0),
        "peak_allocated_tokens": max((allocated(s) for s in steps), default=0),
        "bulk_steps": len(bulk),
        "decode_steps": len(decode),
        "bulk_utilisation": _median([s["kv_tokens"] / allocated(s) for s in bulk if allocated(s)]),
        "bulk_budget_use": _median([s["kv_tokens"] / budget for s in bulk]),
        "retractions": sum(s["retractions"] for s in steps),
    }


def allocated(step: dict[str, Any]) -> int:
    """KV tokens allocated at a step: the pages in use (paged) or the whole slab, slots x capacity."""
    return step["kv_paged"] if step["kv_paged"] is not None else step["kv_capacity"]


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


METRICS = (
    ("bulk_utilisation", "KV utilisation, bulk phase (held / allocated)", "{:.3f}"),
    ("bulk_budget_use", "budget in use, bulk phase (held / budget)", "{:.3f}"),
    ("max_running", "largest running batch", "{:.0f}"),
    ("peak_allocated_tokens", "most KV tokens allocated at once", "{:.0f}"),
    ("tokens_per_s", "tokens/s, whole set", "{:.1f}"),
    ("gen_s", "generation s, whole set", "{:.2f}"),
    ("decode_steps", "decode steps, whole set (load-independent)", "{:.0f}"),
    ("retractions", "retractions", "{:.0f}"),
)
RATIOS = ("bulk_utilisation", "max_running", "tokens_per_s")


def combine(runs: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Medians over runs of each engine's figures, and for each paged engine the median of the per-run
    ratios to the slab (taken side by side within a run, so a run slowed by the machine's load cancels)."""
    med = {e: {k: statistics.median(r[e][k] for r in runs) for k, _, _ in METRICS} for e in ENGINES}
    ratios = {
        e: {k: statistics.median(_ratio(r[e][k], r["slab"][k]) for r in runs) for k in RATIOS} for e in PAGED
    }
    return {"median": med, "ratios": ratios}


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("inf")


def table(report: dict[str, Any]) -> list[str]:
    """A Markdown table of the medians and the side-by-side ratios."""
    w = report["workload"]
    med, ratios = report["median"], report["ratios"]
    lines = [
        f"{w['requests']} requests, prompts of {w['prompt_len']} tokens, new tokens lognormal (median "
        f"{w['median_new']:g}, longest {w['longest_new']}; {w['demand_tokens']} tokens in all), EOS "
        f"ignored, one replica; KV budget {report['budget_tokens']} tokens "
        f"({report['budget_bytes'] / 1e6:.2f} MB); the slab's peak: {report['slab_peak_tokens']} tokens "
        f"({report['slab_peak_bytes'] / 1e6:.2f} MB); page size {report['page_size']}; median of "
        f"{report['runs']} runs",
        "",
        "| | "
        + " | ".join(LABELS[e] for e in ENGINES)
        + " | "
        + " | ".join(f"{LABELS[e]} / slab" for e in PAGED)
        + " |",
        "|---" * (len(ENGINES) + len(PAGED) + 1) + "|",
    ]
    for key, label, fmt in METRICS:
        cells = [fmt.format(med[e][key]) for e in ENGINES]
        cells += [f"{ratios[e][key]:.2f}x" if key in ratios[e] else "" for e in PAGED]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def slab_tree(commit: str, work: Path) -> Path:
    """The ``worker`` folder of ``commit``, extracted once under ``work`` (``git archive``)."""
    dest = work / f"slab-{commit}"
    if (dest / "worker" / "rollout_worker").is_dir():
        return dest / "worker"
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if top.returncode != 0:
        raise RuntimeError(
            "the dense slab is extracted from this repository's history: run inside a checkout"
        )
    tmp = Path(tempfile.mkdtemp(dir=work))
    archive = subprocess.run(
        ["git", "-C", top.stdout.strip(), "archive", "--format=tar", commit, "worker"], capture_output=True
    )
    if archive.returncode != 0:
        raise RuntimeError(f"git archive {commit}: {archive.stderr.decode(errors='replace').strip()}")
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive.stdout, check=True)
    tmp.rename(dest)
    return dest / "worker"


def run_probe(tree: Path, spec: dict[str, Any], scratch: Path) -> dict[str, Any]:
    """One engine run in a fresh process whose ``rollout_worker`` is ``tree``'s (checked)."""
    tree = tree.resolve()
    shutil.copy(PROBE, scratch / "bench_memory_probe.py")
    (scratch / "spec.json").write_text(json.dumps(spec))
    out = scratch / "out.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(scratch), str(tree)])}
    cmd = [sys.executable, "-m", "bench_memory_probe", str(scratch / "spec.json"), str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=scratch, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"the {tree} engine failed ({r.returncode}):\n{r.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    if not Path(result["engine"]).resolve().is_relative_to(tree):
        raise RuntimeError(f"the probe imported {result['engine']}, not the engine under {tree}")
    return result


def _line(engine: str, fig: dict[str, Any]) -> str:
    return (
        f"{engine} {fig['tokens_per_s']:.1f} tok/s, batch {fig['max_running']}, "
        f"{fig['retractions']} retractions"
    )


def run_memory_bench(
    model: Path,
    slab: Path,
    n: int,
    prompt_len: int,
    median_new: float,
    longest_new: int,
    budget: int,
    page_size: int,
    runs: int,
    json_out: Path | None,
    echo: Echo,
    samples: int = 8,
    sharing_prompt_len: int = 128,
) -> dict[str, Any]:
    """The three engines (module docstring), then with ``samples`` > 1 prefix sharing on this tree
    (:mod:`rollout_bench.sharing`) on prompts of ``sharing_prompt_len`` tokens."""
    cfg = ModelConfig.load(model)
    lens = tail_lengths(n, median_new, longest_new)
    reqs = requests(lens, prompt_len, cfg.vocab_size)
    base: dict[str, Any] = {"model": str(model.resolve()), "dtype": "float32", "requests": reqs}
    settings: dict[str, Any] = {"max_batch": n}
    paged_tree = Path(__file__).resolve().parents[2]
    trees = {"slab": slab, "paged": paged_tree, "paged_at_slab": paged_tree}
    budgets = {"slab": budget, "paged": budget, "paged_at_slab": 0}  # the last: the slab's peak, once seen
    per_run: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(runs):
            order = ENGINES if i % 2 == 0 else ENGINES[::-1]  # run 1 measures the slab first
            got = {}
            for e in order:
                extra = {"page_size": page_size} if e != "slab" else {}
                spec = {**base, "settings": {**settings, **extra, "kv_budget_tokens": budgets[e]}}
                scratch = Path(tmp) / f"{e}-{i}"
                scratch.mkdir()
                got[e] = summarise(run_probe(trees[e], spec, scratch), budgets[e])
                if got[e]["tokens"] != sum(lens):
                    raise RuntimeError(f"{e}: {got[e]['tokens']} tokens generated, {sum(lens)} asked")
                if e == "slab" and not budgets["paged_at_slab"]:
                    budgets["paged_at_slab"] = got[e]["peak_allocated_tokens"]
            per_run.append(got)
            echo(f"run {i + 1}/{runs}: " + "; ".join(_line(e, got[e]) for e in ENGINES))
        sharing = None
        if samples > 1:
            grouped = bench_sharing.grouped_requests(lens, sharing_prompt_len, samples, cfg.vocab_size)

            def probe(spec: dict[str, Any], label: str) -> dict[str, Any]:
                scratch = Path(tmp) / label
                scratch.mkdir()
                return run_probe(paged_tree, spec, scratch)

            share_base = {
                **base,
                "settings": {**settings, "page_size": page_size, "kv_budget_tokens": budget},
            }
            sharing = bench_sharing.run_sharing(grouped, share_base, runs, probe, echo)
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # float32 K and V
    report: dict[str, Any] = {
        "benchmark": "memory",
        "model": str(model),
        "slab_tree": str(slab),
        "workload": {
            "requests": n,
            "prompt_len": prompt_len,
            "median_new": median_new,
            "longest_new": longest_new,
            "new_tokens": lens,
            "demand_tokens": sum(prompt_len + k for k in lens),
        },
        "budget_tokens": budget,
        "budget_bytes": budget * per_token,
        "slab_peak_tokens": budgets["paged_at_slab"],
        "slab_peak_bytes": budgets["paged_at_slab"] * per_token,
        "page_size": page_size,
        "runs": runs,
        "per_run": per_run,
        **combine(per_run),
        "sharing": sharing,
    }
    echo("")
    for line in table(report):
        echo(line)
    if sharing is not None:
        echo("")
        for line in bench_sharing.table(sharing, len(lens) // samples, samples, sharing_prompt_len):
            echo(line)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report, indent=1) + "\n")
        echo(f"wrote {json_out}")
    return report
