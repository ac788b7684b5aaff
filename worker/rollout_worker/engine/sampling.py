"""Per-request sampling that depends only on the request: greedy, or temperature / top-k / top-p driven by
a counter-based uniform draw u = H(seed, token index). The same request therefore yields the same tokens
on any replica, TP size or batch, and across reconfigurations (no generator state to migrate).
"""

from __future__ import annotations

import hashlib

import torch

from rollout_worker.api.sampling import SamplingParams


def uniform(seed: int, index: int) -> float:
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


def sample(logits: torch.Tensor, params: list[SamplingParams], indices: list[int]) -> list[int]:
    """One token per row of ``logits`` [B, V]; ``indices[b]`` is the index of the token being drawn."""
    out = torch.argmax(logits, dim=-1).tolist()
    for b, p in enumerate(params):
        if not p.greedy:
            out[b] = _draw(logits[b], p, uniform(p.seed, indices[b]))
    return out


def _draw(row: torch.Tensor, p: SamplingParams, u: float) -> int:
    scaled = row.to(torch.float64) / p.temperature
    probs, order = torch.sort(torch.softmax(scaled, dim=-1), descending=True, stable=True)
    if p.top_k > 0:
        probs = probs[: p.top_k]
    if p.top_p < 1.0:
        cum = torch.cumsum(probs, dim=0)
        keep = int(torch.searchsorted(cum, torch.tensor([p.top_p], dtype=cum.dtype)).item()) + 1
        probs = probs[:keep]
    cum = torch.cumsum(probs, dim=0)
    pick = int(
        torch.searchsorted(cum, torch.tensor([u * float(cum[-1])], dtype=cum.dtype), right=True).item()
    )
    return int(order[min(pick, probs.numel() - 1)].item())
