"""Rollout workloads: response lengths (and prompt lengths, caps) of one generation stage.

Named synthetic workloads (seeded, modelled on the DeepScaleR figures in ``shared/notes/field.md``):

* ``deepscaler-8k``: 128 prompts x n=8, cap 8,192. Per prompt: a difficulty (share of right answers
  ~ Beta(6, 2)) and a length factor exp(N(0, 0.15)); per response: log-normal(8.28, 0.35), twice as long
  when wrong, cut at the cap. Mean ~4.9-5.0k tokens, 13-15% at the cap.
* ``deepscaler-16k``: 128 prompts x n=16, cap 16,384: log-normal(8.25, 0.5) x1.6, the same mixture;
  mean ~8.2k, ~9% at the cap.
* ``deepscaler-8k-late``: a late phase of the 8k stage (the policy has learnt to answer shorter):
  log-normal(7.9, 0.4), the same mixture; mean ~3.6k tokens, ~4% at the cap.
* ``sparse-tail``: 128 x 8, cap 8,192: log-normal(ln 600, 0.55) without the right/wrong mixture (median
  ~600 tokens), plus exactly 0.9% of the responses running away to the cap (9 of 1,024).
* ``cap-mass-0``, ``cap-mass-5``, ``cap-mass-10``, ``cap-mass-15``: the sweep of the mass at the cap:
  128 x 8, cap 8,192, log-normal(ln 2,000, 0.45) (about 0.1% reach the cap by themselves) plus exactly
  0 / 5 / 10 / 15% of the responses running away to the cap.

Field notes say wrong answers are ~3x longer and 5% of responses carry 30-50% of tokens. Neither fits
together with a mean of ~5k and a 10-15% cap mass under an 8k cap: a 3x factor pushes >20% onto the cap,
and the top 5% can carry at most 5% x 8192 / 5000 = 8% of tokens. The generator keeps the mean and the
cap mass, uses a 2x factor, and reports the rest (``Workload.summary``: top 5% carry ~8%).

Prompt lengths: log-normal around 250 tokens, clipped to [64, 1024], shared by a prompt's n responses.

JSONL files: one object per line, ``{"length": int, "cap": int?, "prompt_len": int?}``; ``cap`` defaults
to the largest length (or ``--cap``), ``prompt_len`` to 256. Errors name the file and line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rollout_worker.data.jsonl import iter_jsonl
from rollout_worker.errors import UserError

DEFAULT_PROMPT_LEN = 256


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    lengths: np.ndarray  # response tokens to generate, 1 <= length <= cap
    prompt_lens: np.ndarray
    caps: np.ndarray  # max_new_tokens per request

    def __post_init__(self) -> None:
        n = len(self.lengths)
        if n == 0:
            raise UserError(f"workload {self.name!r}: no requests")
        if len(self.prompt_lens) != n or len(self.caps) != n:
            raise UserError(f"workload {self.name!r}: lengths, prompt_lens and caps differ in size")
        if (self.lengths < 1).any() or (self.lengths > self.caps).any():
            raise UserError(f"workload {self.name!r}: every length must be in [1, cap]")

    @property
    def size(self) -> int:
        return len(self.lengths)

    def summary(self) -> dict[str, Any]:
        srt = np.sort(self.lengths)[::-1]
        top = max(1, len(srt) // 20)
        return {
            "name": self.name,
            "requests": self.size,
            "mean": float(self.lengths.mean()),
            "median": float(np.median(self.lengths)),
            "at_cap": float((self.lengths >= self.caps).mean()),
            "top5pct_token_share": float(srt[:top].sum() / srt.sum()),
            "max": int(srt[0]),
        }


@dataclass(frozen=True, slots=True)
class _Recipe:
    prompts: int
    n: int
    cap: int
    mu: float
    sigma: float
    scale: float = 1.0
    wrong_factor: float = 2.0
    right_beta: tuple[float, float] = (6.0, 2.0)
    prompt_sigma: float = 0.15
    runaway: float = 0.0  # share of responses (exact count, random ones) that run to the cap


RECIPES = {
    "deepscaler-8k": _Recipe(prompts=128, n=8, cap=8192, mu=8.28, sigma=0.35),
    "deepscaler-16k": _Recipe(prompts=128, n=16, cap=16384, mu=8.25, sigma=0.5, scale=1.6),
    "deepscaler-8k-late": _Recipe(prompts=128, n=8, cap=8192, mu=7.9, sigma=0.4),
    "sparse-tail": _Recipe(prompts=128, n=8, cap=8192, mu=6.397, sigma=0.55, wrong_factor=1.0, runaway=0.009),
    **{
        f"cap-mass-{pct}": _Recipe(
            prompts=128, n=8, cap=8192, mu=7.601, sigma=0.45, wrong_factor=1.0, runaway=pct / 100
        )
        for pct in (0, 5, 10, 15)
    },
}


def synthetic(name: str, seed: int = 0, prompts: int | None = None) -> Workload:
    """A named synthetic workload; ``prompts`` overrides the number of prompts (smaller tests)."""
    if name not in RECIPES:
        raise UserError(f"unknown workload {name!r}; known: {', '.join(RECIPES)} or a .jsonl path")
    r = RECIPES[name]
    n_p = r.prompts if prompts is None else prompts
    if n_p < 1:
        raise UserError(f"workload {name!r}: prompts must be >= 1, got {n_p}")
    rng = np.random.default_rng(seed)
    right = rng.random((n_p, r.n)) < rng.beta(*r.right_beta, size=n_p)[:, None]
    prompt_eff = rng.normal(0.0, r.prompt_sigma, size=n_p)[:, None]
    logl = np.log(r.scale) + r.mu + prompt_eff + r.sigma * rng.standard_normal((n_p, r.n))
    logl += np.where(right, 0.0, np.log(r.wrong_factor))
    lengths = np.clip(np.rint(np.exp(logl)), 1, r.cap).astype(np.int64).ravel()
    runaways = round(r.runaway * lengths.size)
    if runaways:
        below = np.nonzero(lengths < r.cap)[0]
        lengths[rng.choice(below, min(runaways, below.size), replace=False)] = r.cap
    plen = np.clip(np.rint(250 * np.exp(0.4 * rng.standard_normal(n_p))), 64, 1024).astype(np.int64)
    prompt_lens = np.repeat(plen, r.n)
    return Workload(f"{name}/seed{seed}", lengths, prompt_lens, np.full(lengths.shape, r.cap, dtype=np.int64))


def _int_field(obj: dict[str, Any], key: str, where: str) -> int | None:
    if key not in obj:
        return None
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise UserError(f"{where}: {key!r} must be a positive integer, got {v!r}")
    return v


def load_jsonl(path: str | Path, cap: int | None = None) -> Workload:
    p = Path(path)
    lengths: list[int] = []
    caps: list[int | None] = []
    prompts: list[int] = []
    for where, _, obj in iter_jsonl(p, "workload"):
        if not isinstance(obj, dict):
            raise UserError(f'{where}: expected an object like {{"length": 1234}}')
        length = _int_field(obj, "length", where)
        if length is None:
            raise UserError(f"{where}: missing 'length'")
        c = _int_field(obj, "cap", where)
        if c is None:
            c = cap
        if c is not None and length > c:
            raise UserError(f"{where}: length {length} exceeds cap {c}")
        lengths.append(length)
        caps.append(c)
        prompts.append(_int_field(obj, "prompt_len", where) or DEFAULT_PROMPT_LEN)
    if not lengths:
        raise UserError(f"{p}: no requests (empty file)")
    default_cap = max(lengths)
    return Workload(
        p.name,
        np.asarray(lengths, dtype=np.int64),
        np.asarray(prompts, dtype=np.int64),
        np.asarray([default_cap if c is None else c for c in caps], dtype=np.int64),
    )


def load(spec: str, seed: int = 0) -> Workload:
    """A workload by name (``deepscaler-8k``) or JSONL path."""
    if spec in RECIPES:
        return synthetic(spec, seed)
    if spec.endswith(".jsonl") or Path(spec).exists():
        return load_jsonl(spec)
    raise UserError(f"{spec!r} is neither a known workload ({', '.join(RECIPES)}) nor a file", "workload")
