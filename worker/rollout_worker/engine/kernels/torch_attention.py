"""The default kernels' attention: torch's own, in whatever order the backend chooses (not batch-invariant).

One entry, :func:`attend`: SDPA over each row's keys, and on CUDA a decode step (one query per row) as two
batched products per KV head over keys gathered KV-head-major (:func:`attend_kv_major`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def kv_major(seq: int, cuda: bool) -> bool:
    """Whether :func:`attend` takes a forward's keys gathered KV-head-major: a decode step on CUDA."""
    return cuda and seq == 1


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    vals: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    seen: int | None = None,
) -> torch.Tensor:
    """Attention of q [B, S, H, hd] over keys/vals [B, KVh, L, hd] under mask [B, 1, S, L]: [B, S, H * hd].

    Each head is computed on its own, so TP (which splits heads) changes nothing. Where :func:`kv_major`
    says so, keys and vals are views of tensors gathered [KVh, B, L, hd] (``.transpose(0, 1)``), which
    :func:`attend_kv_major` reads in place (the decoder gathers a CUDA decode step's keys so; the K/V a
    decode step keeps between steps are kept on CPU only). ``seen`` is not used (SDPA reads every key the
    mask lets through)."""
    if kv_major(q.shape[1], q.is_cuda):
        return attend_kv_major(q, keys.transpose(0, 1), vals.transpose(0, 1), mask, scale)
    bsz, seq, heads = q.shape[0], q.shape[1], q.shape[2]
    attn = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys, vals, attn_mask=mask, scale=scale, enable_gqa=True
    )  # [B, H, S, hd]
    return attn.transpose(1, 2).reshape(bsz, seq, heads * q.shape[-1])


def attend_kv_major(
    q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """One decode step's attention (the default kernels on CUDA): q [B, 1, H, hd] over keys/vals
    [KVh, B, L, hd] (gathered KV-head-major) under mask [B, 1, 1, L]: [B, 1, H * hd].

    The query heads of each KV head form one matrix (head ``h`` uses KV head ``h // (H // KVh)``), so the
    scores and the weighted values are two batched products that read the gathered keys in place. SDPA with
    a mask falls back to its math kernel here, which first copies K and V once per query head
    (``enable_gqa``); and keys gathered ``[B, L, KVh, hd]`` would be copied once more into a product's layout.
    """
    kvh, bsz, length, hd = keys.shape
    heads = q.shape[2]
    qg = q.view(bsz, kvh, heads // kvh, hd).transpose(0, 1)  # [KVh, B, G, hd]
    scores = torch.matmul(qg * scale, keys.transpose(-1, -2))  # [KVh, B, G, L]
    scores = scores.masked_fill(~mask.view(1, bsz, 1, length), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(vals.dtype, torch.float32)).to(vals.dtype)
    return torch.matmul(probs, vals).transpose(0, 1).reshape(bsz, 1, heads * hd)  # [B, KVh, G, hd] flat
