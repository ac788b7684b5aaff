"""Per-request sampling that depends only on the request: greedy, or temperature / top-k / top-p / min-p
driven by a counter-based uniform draw u = H(seed, position), where position is the token's absolute position
in the sequence (prompt length + output index). The same request therefore yields the same tokens on any
replica, TP size or batch, and across reconfigurations and retractions (no generator state to migrate); and a
continuation (prompt + the tokens generated so far, sent again with the same seed: partial rollout) draws
exactly the tokens the uninterrupted request would have drawn.

Logprobs (what RL trainers use for importance weights) are the log-probability of the sampled token under
the distribution it was drawn from: softmax(logits / temperature) cut by top-k, top-p and min-p and
renormalised; for greedy requests the plain log-softmax. Computed in float64. A prefill also gives the
prompt's own tokens their logprobs, for the requests that ask (:func:`prompts_logprobs`).

A row that cannot be sampled (non-finite logits, a distribution that does not sum to a positive number, any
error while drawing it) gives a :class:`Failure` for that request alone: every rank of a replica holds the
same logits (all-gathered) and runs the same code, so every rank fails the same request at the same step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rollout_worker.api.sampling import Sampling
from rollout_worker.engine.messages import PromptLogprobs, TopLogprobs
from rollout_worker.engine.rank.sequence import Sequence


@dataclass(frozen=True, slots=True)
class Draw:
    token: int
    logprob: float | None = None
    top: TopLogprobs | None = None


@dataclass(frozen=True, slots=True)
class Failure:
    """Why one request's row could not be processed (the request is aborted with this message)."""

    message: str

    @classmethod
    def of(cls, exc: Exception) -> Failure:
        return cls(f"{type(exc).__name__}: {exc}")


def uniform(seed: int, position: int) -> float:
    """The uniform draw in [0, 1) of the token at absolute ``position`` of a request seeded ``seed``."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_ids: tuple[int, ...]) -> list[Draw | Failure]:
    """One token per row of ``logits`` [B, V] for ``seqs`` (row b draws output token ``len(seqs[b].output)``,
    at position :func:`position` in its sequence), or the row's :class:`Failure`."""
    peak, fast = torch.max(logits, dim=-1)  # NaN propagates: a NaN row peaks at NaN
    finite, fast_ids = torch.isfinite(peak).tolist(), fast.tolist()
    out: list[Draw | Failure] = []
    for b, seq in enumerate(seqs):
        if not finite[b]:
            out.append(Failure(f"the logits of output token {len(seq.output)} are not finite"))
            continue
        try:
            out.append(_sample_row(logits[b], seq, int(fast_ids[b]), eos_ids))
        except Exception as exc:  # this request's edge case, not the engine's
            out.append(Failure.of(exc))
    return out


def verify(
    logits: torch.Tensor, seq: Sequence, drafts: list[int], eos_ids: tuple[int, ...]
) -> list[Draw] | Failure:
    """The tokens a verify pass emits for ``seq``: ``logits`` [k+1, V] are the rows of its next token and
    of each of the k tokens ``drafts`` proposes after it. Row i draws the token plain decoding would draw
    with drafts[:i] generated (its absolute position's uniform, its ``min_new_tokens`` rule), so drafts are
    accepted while they equal those draws, and the first draw that differs (or the one after every draft)
    is emitted too: 1 to k+1 draws, each what decoding without speculation would have drawn. The caller
    ends the request where a drawn token finishes it (the draws after it are not its tokens)."""
    if logits.shape[0] != len(drafts) + 1:
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(drafts)} drafted tokens")
    peak, fast = torch.max(logits, dim=-1)
    finite, fast_ids = torch.isfinite(peak).tolist(), fast.tolist()
    out: list[Draw] = []
    for i in range(len(drafts) + 1):
        at = seq if i == 0 else Sequence(seq.spec, [*seq.output, *drafts[:i]])
        if not finite[i]:
            return Failure(f"the logits of output token {len(at.output)} are not finite")
        try:
            draw = _sample_row(logits[i], at, int(fast_ids[i]), eos_ids)
        except Exception as exc:  # this request's edge case, not the engine's
            return Failure.of(exc)
        out.append(draw)
        if i == len(drafts) or draw.token != drafts[i]:
            break
    return out


def _sample_row(logits: torch.Tensor, seq: Sequence, fast: int, eos_ids: tuple[int, ...]) -> Draw:
    spec, p = seq.spec, seq.spec.sampling
    banned = _banned(seq, eos_ids)
    if p.greedy and not banned and not spec.return_logprob:
        return Draw(fast)
    row = logits.to(torch.float64)
    if banned:
        row = row.clone()
        row[list(banned)] = float("-inf")
    if p.greedy:
        return _greedy(row, spec.return_logprob, spec.top_logprobs_num)
    return _draw(row, p, uniform(p.seed, position(seq)), spec.return_logprob, spec.top_logprobs_num)


def position(seq: Sequence) -> int:
    """Absolute position of the token ``seq`` draws next: prompt length + output index (not the output index,
    so that prompt + partial output, sent again, draws what the uninterrupted request would have)."""
    return len(seq.spec.prompt_ids) + len(seq.output)


def _banned(seq: Sequence, eos_ids: tuple[int, ...]) -> tuple[int, ...]:
    """Tokens masked before ``min_new_tokens`` (EOS and stop tokens), as SGLang's min-new-tokens penalizer."""
    if len(seq.output) >= seq.spec.min_new_tokens:
        return ()
    return tuple(sorted({*eos_ids, *seq.spec.stop_token_ids}))


def _greedy(row: torch.Tensor, want_logprob: bool, top_n: int) -> Draw:
    tok = int(torch.argmax(row).item())
    if not want_logprob:
        return Draw(tok)
    logp = torch.log_softmax(row, dim=-1)
    return Draw(tok, float(logp[tok].item()), _top(logp, top_n))


def _draw(row: torch.Tensor, p: Sampling, u: float, want_logprob: bool, top_n: int) -> Draw:
    probs, order = torch.sort(torch.softmax(row / p.temperature, dim=-1), descending=True, stable=True)
    if p.top_k > 0:
        probs = probs[: p.top_k]
    if p.top_p < 1.0:
        cum = torch.cumsum(probs, dim=0)
        keep = (
            int(torch.searchsorted(cum, torch.tensor([p.top_p], dtype=cum.dtype, device=cum.device)).item())
            + 1
        )
        probs = probs[:keep]
    if p.min_p > 0.0:
        probs = probs[probs >= p.min_p * probs[0]]
    cum = torch.cumsum(probs, dim=0)
    total = float(cum[-1])
    if not 0.0 < total < float("inf"):
        raise ValueError(f"the sampling distribution sums to {total} (temperature {p.temperature})")
    pick = min(
        int(
            torch.searchsorted(
                cum, torch.tensor([u * total], dtype=cum.dtype, device=cum.device), right=True
            ).item()
        ),
        probs.numel() - 1,
    )
    tok = int(order[pick].item())
    if not want_logprob:
        return Draw(tok)
    logp = torch.log(probs / total)
    top = tuple((float(logp[i]), int(order[i])) for i in range(min(top_n, probs.numel()))) if top_n else None
    return Draw(tok, float(logp[pick].item()), top)


def _top(logp: torch.Tensor, n: int) -> TopLogprobs | None:
    if n <= 0:
        return None
    vals, idx = torch.topk(logp, min(n, logp.numel()))
    return tuple((float(v), int(i)) for v, i in zip(vals.tolist(), idx.tolist(), strict=True))


def prompt_logprobs(
    logits: torch.Tensor, targets: list[int], top_n: int
) -> tuple[list[float], list[TopLogprobs | None] | None]:
    """Plain log-softmax logprob of ``targets[i]`` under ``logits[i]`` (the prompt's own tokens)."""
    logp = torch.log_softmax(logits.to(torch.float64), dim=-1)
    idx = torch.tensor(targets, dtype=torch.long, device=logp.device)
    picked = logp[torch.arange(len(targets), device=logp.device), idx]
    if bool(torch.isnan(picked).any()):
        raise ValueError("the prompt's logits are not finite")
    tops = [_top(logp[i], top_n) for i in range(len(targets))] if top_n > 0 else None
    return picked.tolist(), tops


def prompts_logprobs(
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    seqs: list[Sequence],
    fresh: list[Sequence],
) -> tuple[dict[str, PromptLogprobs], list[tuple[Sequence, Failure]]]:
    """Logprob of each prompt token from ``logprob_start_len`` on, for requests that asked for it. Token
    0 has none (None, as SGLang): a one-token prompt from 0 gets ``(None,)`` and needs no logits. ``x``: a
    prefill pass's hidden states of ``seqs`` (``logits_of`` turns the rows needed into logits); a request
    whose logprobs could not be computed comes back as a failure (its own, not the engine's)."""
    want = [(b, s) for b, s in enumerate(seqs) if s in fresh and s.spec.wants_input_logprobs]
    if not want:
        return {}, []
    rows: list[int] = []
    pos: list[int] = []
    targets: list[int] = []
    spans: list[tuple[Sequence, int, int]] = []  # (request, offset, count) into rows
    for b, s in want:
        ids, start = s.spec.prompt_ids, s.spec.logprob_start_len
        js = range(max(start, 1), len(ids))
        spans.append((s, len(rows), len(js)))
        rows += [b] * len(js)
        pos += [j - 1 for j in js]
        targets += [ids[j] for j in js]
    logits = None
    if rows:  # (the same on every rank: the logits are a collective)
        dev = x.device
        at = (
            torch.tensor(rows, dtype=torch.long, device=dev),
            torch.tensor(pos, dtype=torch.long, device=dev),
        )
        logits = logits_of(x[at])
    got: dict[str, PromptLogprobs] = {}
    failed: list[tuple[Sequence, Failure]] = []
    for s, off, n in spans:
        k, start = s.spec.top_logprobs_num, s.spec.logprob_start_len
        try:
            vals, tops = (
                prompt_logprobs(logits[off : off + n], targets[off : off + n], k)
                if logits is not None and n
                else ([], [] if k > 0 else None)
            )
        except Exception as exc:  # this request's, not the engine's
            failed.append((s, Failure.of(exc)))
            continue
        head: list[None] = [None] if start == 0 else []
        top = None if tops is None else (*head, *tops)
        got[s.spec.id] = PromptLogprobs(start, (*head, *vals), top)
    return got, failed
