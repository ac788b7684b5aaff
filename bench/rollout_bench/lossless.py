"""``rolloutctl bench lossless``: does a layout or a switch change any token of a real model?

Every layout of 2 and 4 ranks is run statically, and two chains of switches run mid-decode (each covers a
grow and a shrink with each KV method, migrate and recompute); each run's tokens are compared with the static
TP = 1 run's (``2x1``) in the same dtype: how many samples differ, and the position of each sample's first
differing token. The float64 runs must equal the reference everywhere and every switch must have carried
requests mid-decode (and moved or recomputed their KV cache); any difference there is a failure. In float32
(or bfloat16) a different reduction order can flip a near-tied token: those differences are measured.

The requests are chat prompts (a prompts file rendered with the model's chat template), even ones greedy and
odd ones sampled (seeded), caps spread so that they finish one after another, EOS honoured.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_worker.api.plan import ReconfigEvent, Trigger
from rollout_worker.api.requests import RequestSpec, check_ids
from rollout_worker.api.sampling import Sampling
from rollout_worker.config.model_config import ModelConfig
from rollout_worker.data.prompts import ChatTemplate, load_prompts
from rollout_worker.engine.config import EngineConfig
from rollout_worker.engine.driver.fixed_batch import BatchResult, run_batch
from rollout_worker.engine.model.tokenizer import TextCodec
from rollout_worker.errors import UserError
from rollout_worker.scheduling.layout import Layout

from rollout_bench.record import write_json

Echo = Callable[[str], Any]
EXACT = "float64"
DETERMINISTIC = " deterministic"  # the label's suffix of runs with the deterministic kernels: exact too


@dataclass(frozen=True, slots=True)
class Case:
    """A run: starting in ``start``, then switching to each ``(layout, method)`` in turn, mid-decode."""

    start: str
    switches: tuple[tuple[str, str], ...] = ()

    @property
    def world(self) -> int:
        return Layout.parse(self.start).world

    @property
    def name(self) -> str:
        return self.start + "".join(f" -{m[0]}-> {lay}" for lay, m in self.switches)

    def triggers(self, n: int) -> list[Trigger]:
        """One trigger per switch, at unfinished-request thresholds spread over the ``n`` requests."""
        return [
            Trigger.model_validate({"unfinished_at_most": t, "layout": Layout.parse(lay), "method": m})
            for t, (lay, m) in zip(thresholds(n, len(self.switches)), self.switches, strict=True)
        ]


REFERENCE = Case("2x1")  # static TP = 1
STATIC = (Case("1x2"), Case("4x1"), Case("2x2"), Case("1x4"))
# each chain: grow and shrink, each with migrate and recompute; 1x4 -> 2x2 gathers a whole KV group
CHAINS = (
    Case("2x1", (("1x2", "migrate"), ("2x1", "migrate"), ("1x2", "recompute"), ("2x1", "recompute"))),
    Case("4x1", (("2x2", "migrate"), ("1x4", "recompute"), ("2x2", "migrate"), ("4x1", "recompute"))),
)
CASES = (REFERENCE, *STATIC, *CHAINS)
MIN_REQUESTS = 8  # four switches two finished requests apart


def thresholds(n: int, k: int) -> list[int]:
    """``k`` decreasing thresholds of unfinished requests, evenly spaced from n - 1 down to 1 (n = 8, k = 4:
    7, 5, 3, 1; n = 16: 13, 9, 5, 1). The ranks' updates reach the engine in batches and a plan fires once
    for the lowest threshold reached (:meth:`~rollout_worker.api.plan.Plan.fire`): with thresholds at least
    two apart, a switch is skipped only when three requests finish in one batch."""
    if k == 0:
        return []
    gap = (n - 2) // (k - 1) if k > 1 else n - 2
    if gap < 2:
        raise ValueError(f"{n} requests are too few for {k} switches two requests apart")
    return [1 + gap * (k - 1 - j) for j in range(k)]


def chat_prompts(model: Path, prompts: Path, n: int) -> list[tuple[str, tuple[int, ...]]]:
    """The first ``n`` prompts of a prompts file (chat messages rendered with the model's template) as
    (id, token ids); errors name the flags (--prompts, --requests, --preset)."""
    codec = TextCodec.load(model)
    if codec is None:
        raise UserError(f"no tokenizer.json in {model}", "--preset")
    vocab = ModelConfig.load(model).vocab_size
    try:
        rows = load_prompts(prompts, n, ChatTemplate.of_model(model))
    except UserError as exc:
        raise exc.renamed({"spec.prompts.path": "--prompts"}) from None
    if len(rows) < n:
        raise UserError(f"{prompts} has {len(rows)} prompts, fewer than {n}", "--requests")
    out = []
    for p in rows:
        ids = p.input_ids if p.input_ids is not None else codec.encode(p.text or "")
        check_ids(ids, vocab, f"{prompts} prompt {p.id}")
        out.append((p.id, tuple(ids)))
    return out


def chat_requests(model: Path, prompts: Path, n: int, max_new_tokens: int) -> list[RequestSpec]:
    """:func:`chat_prompts`, even ones greedy and odd ones sampled (temperature 0.8, top-p 0.95, seeded);
    caps spread from an eighth of ``max_new_tokens`` up to it, so that requests finish one after another;
    EOS honoured."""
    lo = max(1, max_new_tokens // 8)
    specs = []
    for i, (pid, ids) in enumerate(chat_prompts(model, prompts, n)):
        sampling = Sampling() if i % 2 == 0 else Sampling(temperature=0.8, top_p=0.95, seed=1000 + i)
        cap = lo + (max_new_tokens - lo) * i // max(1, n - 1)
        specs.append(RequestSpec(f"p{pid}", ids, cap, sampling))
    return specs


def run_case(model: Path, case: Case, specs: list[RequestSpec], dtype: str, **settings: Any) -> BatchResult:
    cfg = EngineConfig.load(str(model), case.world, Layout.parse(case.start), dtype=dtype, **settings)
    return run_batch(cfg, specs, case.triggers(len(specs)))


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two outputs differ (a length is a difference too), or None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def event_row(ev: ReconfigEvent) -> dict[str, Any]:
    return {
        "src": str(ev.src),
        "dst": str(ev.dst),
        "method": ev.method,
        "outcome": ev.outcome,
        "requests_mid_decode": ev.requests_mid_decode,
        "kv_bytes_moved": ev.kv_bytes_moved,
        "kv_tokens_recomputed": ev.kv_tokens_recomputed,
    }


def compare(case: Case, res: BatchResult, reference: dict[str, list[int]]) -> dict[str, Any]:
    """:func:`record` of a run: its tokens, its switches, and how many requests ran on every layout."""
    spanning = sum(len(o["placements"]) == len(case.switches) + 1 for o in res.outputs)
    return record(case, reference, res.tokens(), [event_row(e) for e in res.reconfigs], spanning)


def record(
    case: Case,
    reference: dict[str, list[int]],
    got: dict[str, list[int]],
    events: list[dict[str, Any]],
    spanning: int,
) -> dict[str, Any]:
    """One run against the reference: the samples that differ with their first differing position, the
    switches as they happened, and what contradicts the plan (``problems``)."""
    first = {rid: first_difference(ref, got.get(rid, [])) for rid, ref in reference.items()}
    differ = {rid: pos for rid, pos in first.items() if pos is not None}
    return {
        "run": case.name,
        "ranks": case.world,
        "samples": len(reference),
        "tokens": sum(map(len, reference.values())),
        "differ": len(differ),
        "first_difference": differ,
        "events": events,
        "spanning": spanning,
        "problems": problems(case, events, spanning),
    }


def problems(case: Case, events: list[dict[str, Any]], spanning: int) -> list[str]:
    """Where the switches did not happen as planned: each committed, in order, mid-decode, its KV cache moved
    (migrate) or recomputed (recompute), and some request running on every layout of the chain."""
    out = []
    planned = list(zip([case.start, *(lay for lay, _ in case.switches)], case.switches, strict=False))
    if len(events) != len(planned):
        out.append(f"{len(planned)} switch(es) planned, {len(events)} happened")
    for j, (ev, (src, (dst, method))) in enumerate(zip(events, planned, strict=False)):
        want = f"{src} -> {dst} ({method})"
        got = f"{ev['src']} -> {ev['dst']} ({ev['method']})"
        if got != want:
            out.append(f"switch {j + 1}: {got}, planned {want}")
        if ev["outcome"] != "committed":
            out.append(f"switch {j + 1}: {ev['outcome']}")
        if ev["requests_mid_decode"] < 1:
            out.append(f"switch {j + 1}: no request mid-decode")
        moved = ev["kv_bytes_moved"] if method == "migrate" else ev["kv_tokens_recomputed"]
        if moved < 1:
            out.append(f"switch {j + 1}: no KV cache {'moved' if method == 'migrate' else 'recomputed'}")
    if case.switches and spanning < 1:
        out.append("no request ran on every layout of the chain")
    return out


def measure(model: Path, specs: list[RequestSpec], label: str, echo: Echo) -> list[dict[str, Any]]:
    """Every case in the dtype ``label`` names (with the deterministic kernels when it ends with
    ``DETERMINISTIC``), each against the static TP = 1 run's tokens."""
    dtype = label.removesuffix(DETERMINISTIC)
    out: list[dict[str, Any]] = []
    reference: dict[str, list[int]] = {}
    for case in CASES:
        t0 = time.perf_counter()
        res = run_case(model, case, specs, dtype, deterministic=label.endswith(DETERMINISTIC))
        if case == REFERENCE:
            reference = res.tokens()
        rec = compare(case, res, reference)
        out.append(rec)
        echo(f"{row(label, rec)} {time.perf_counter() - t0:.1f} s")
    return out


def failures(report: dict[str, Any]) -> list[str]:
    """What makes the benchmark fail: any difference in float64 or with the deterministic kernels, and any
    switch not as planned (any dtype)."""
    out = []
    for dtype, recs in report["runs"].items():
        for r in recs:
            if (dtype == EXACT or dtype.endswith(DETERMINISTIC)) and r["differ"]:
                out.append(f"{dtype} {r['run']}: {r['differ']} of {r['samples']} samples differ")
            out += [f"{dtype} {r['run']}: {p}" for p in r["problems"]]
    return out


def table(report: dict[str, Any]) -> list[str]:
    """A Markdown table: per dtype and run, the samples that differ and where each first differs."""
    lines = [
        f"{report['preset']}: {report['requests']} chat prompts (even greedy, odd sampled), up to "
        f"{report['max_new_tokens']} new tokens, against the static TP=1 run (2x1) in the same dtype; "
        "-m-> migrate, -r-> recompute",
        "",
        "| dtype | run | samples that differ | first differing token (sample@position) "
        "| switches: requests mid-decode |",
        "|---|---|---|---|---|",
    ]
    return lines + [row(dtype, r) for dtype, recs in report["runs"].items() for r in recs]


def row(dtype: str, r: dict[str, Any]) -> str:
    """One run's line of :func:`table`."""
    where = ", ".join(f"{rid}@{pos}" for rid, pos in sorted(r["first_difference"].items(), key=_pos))
    mid = ", ".join(str(e["requests_mid_decode"]) for e in r["events"])
    return f"| {dtype} | {r['run']} | {r['differ']}/{r['samples']} | {where or '-'} | {mid or '-'} |"


def _pos(item: tuple[str, int]) -> tuple[int, str]:
    return item[1], item[0]


def run_lossless_bench(
    model: Path,
    preset: str,
    prompts: Path,
    requests: int,
    max_new_tokens: int,
    dtype: str,
    json_out: Path | None,
    echo: Echo,
    deterministic: bool = True,
) -> dict[str, Any]:
    """``dtype`` measured with the default kernels and (``deterministic``) with the deterministic ones,
    float64 checked (once when ``dtype`` is float64); the report with its ``failures``."""
    labels = [dtype, *([dtype + DETERMINISTIC] if deterministic and dtype != EXACT else []), EXACT]
    specs = chat_requests(model, prompts, requests, max_new_tokens)
    report: dict[str, Any] = {
        "benchmark": "lossless",
        "preset": preset,
        "prompts": str(prompts),
        "requests": requests,
        "max_new_tokens": max_new_tokens,
        "runs": {d: measure(model, specs, d, echo) for d in dict.fromkeys(labels)},
    }
    report["failures"] = failures(report)
    echo("")
    for line in table(report):
        echo(line)
    for f in report["failures"]:
        echo(f"FAILED: {f}")
    if json_out is not None:
        write_json(json_out, report)
        echo(f"wrote {json_out}")
    return report
