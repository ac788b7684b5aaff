"""The dense slab's side of ``rolloutctl bench memory``, recorded: the figures of the engine the paged KV
pool replaced (its last commit with the slab), measured once and kept as JSON under
``bench/results/<machine>-<date>/``, so the benchmark runs only this tree's engine and needs no repository
history.

A recorded file holds what was run (``recorded``: machine, CPU, date, Python and torch versions, the command
and the commits), the model (preset, seed, dtype, KV bytes per token), the workload (requests, prompt
length, the lognormal's median and longest, every request's new tokens), the KV budget, and the slab's
figures per run with their medians (:func:`rollout_bench.memory.summarise`). A run compares against it only
on the same workload, budget and model: :func:`check_workload` refuses anything else, naming the flag.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_worker.errors import UserError

RECORDED = Path(__file__).resolve().parents[1] / "results" / "epyc-2026-11-28" / "bench-memory-slab.json"
FIELDS = (
    "recorded",
    "model",
    "workload",
    "budget_tokens",
    "runs",
    "per_run",
    "median",
    "peak_allocated_tokens",
)
FIGURES = (  # the slab's figures a recording has, per run and as medians (rollout_bench.memory.METRICS)
    "bulk_utilisation",
    "bulk_budget_use",
    "max_running",
    "peak_allocated_tokens",
    "tokens_per_s",
    "gen_s",
    "decode_steps",
    "retractions",
)
WORKLOAD_FLAGS = (
    ("requests", "--requests"),
    ("prompt_len", "--prompt-len"),
    ("median_new", "--median-new"),
    ("longest_new", "--longest-new"),
)


@dataclass(frozen=True)
class Baseline:
    """A recorded slab side: where it was read, what was run, and its figures."""

    path: Path
    recorded: dict[str, Any]
    model: dict[str, Any]
    workload: dict[str, Any]
    budget_tokens: int
    runs: int
    per_run: list[dict[str, Any]]
    median: dict[str, Any]
    peak_allocated_tokens: int

    @property
    def where(self) -> str:
        """Which machine, on which day: the recording's ``machine, date``."""
        return f"{self.recorded.get('machine', '?')}, {self.recorded.get('date', '?')}"


def load(path: Path) -> Baseline:
    """A recorded slab side; a file missing, not JSON or not such a recording is refused (``--baseline``)."""
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}", "--baseline") from None
    except ValueError as exc:
        raise UserError(f"{path} is not JSON: {exc}", "--baseline") from None
    if not isinstance(data, dict) or data.get("benchmark") != "memory" or data.get("side") != "slab":
        raise UserError(f"{path} is not a recorded slab side of bench memory", "--baseline")
    missing = [k for k in FIELDS if k not in data]
    if missing:
        raise UserError(f"{path} has no {', '.join(missing)}", "--baseline")
    median = data["median"]
    lacking = [k for k in FIGURES if not isinstance(median, dict) or k not in median]
    if lacking:
        raise UserError(f"{path}: its median has no {', '.join(lacking)}", "--baseline")
    for key in ("workload", "recorded", "model"):
        if not isinstance(data[key], dict):
            raise UserError(f"{path}: its {key} is not an object", "--baseline")
    absent = [k for k, _ in WORKLOAD_FLAGS if k not in data["workload"]]
    if absent:
        raise UserError(f"{path}: its workload has no {', '.join(absent)}", "--baseline")
    return Baseline(path, **{k: data[k] for k in FIELDS})


def check_workload(
    baseline: Baseline,
    requests: int,
    prompt_len: int,
    median_new: float,
    longest_new: int,
    kv_tokens: int,
) -> None:
    """Refuse a workload the baseline was not recorded on, naming the flag that differs."""
    recorded = [baseline.workload[k] for k, _ in WORKLOAD_FLAGS] + [baseline.budget_tokens]
    asked = (requests, prompt_len, median_new, longest_new, kv_tokens)
    flags = [flag for _, flag in WORKLOAD_FLAGS] + ["--kv-tokens"]
    for flag, was, got in zip(flags, recorded, asked, strict=True):
        if got != was:
            raise UserError(
                f"the baseline {baseline.path} was recorded with {flag} {was:g}, got {got:g}: "
                f"give {flag} {was:g}, or a --baseline recorded with this workload",
                flag,
            )


def check_model(baseline: Baseline, lengths: list[int], kv_bytes_per_token: int) -> None:
    """Refuse a baseline whose requests or model differ from what this tree makes of the same flags."""
    if baseline.workload.get("new_tokens") != lengths:
        raise UserError(f"{baseline.path}: its requests' new tokens are not this tree's", "--baseline")
    if baseline.model.get("kv_bytes_per_token") != kv_bytes_per_token:
        raise UserError(
            f"{baseline.path}: recorded with {baseline.model.get('kv_bytes_per_token')} KV bytes per token, "
            f"this tree's model has {kv_bytes_per_token}",
            "--baseline",
        )
