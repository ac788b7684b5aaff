"""A decode step's attention read in place from the paged KV pool (Triton), where the default kernels
gather every running request's keys and values out of the pages into a dense buffer first, in every layer.

:func:`decode`: one query per row over the keys at the token slots ``table[row, :length]`` of one layer's
cache ``[slots, KVh, hd]`` (the pool's token table, :mod:`~rollout_worker.engine.model.kv_cache`). Two
kernels, as SGLang's Triton decode attention (``decode_attention.py``):

- **split**: one program per (row, KV head, split of ``SPLIT`` positions) reads its keys and values once
  for the KV head's whole group of query heads, in tiles of ``BLOCK`` positions with an online softmax,
  and writes the split's partial output and log-sum-exp;
- **merge**: one program per (row, query head) adds the row's splits in order, rescaled by their
  log-sum-exps.

The splits of a row are fixed tiles of its own positions, and the merge walks them one by one, so a row's
result depends on its own length only: bitwise the same alone and inside any batch (batch-invariant), on
every device and under the interpreter. Products accumulate in float32 (float32 inputs at full precision,
not TF32). On CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1`` before this module is
imported), which is how the tests run them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SPLIT = 256  # positions of a split (a multiple of BLOCK): the unit of a long row's parallelism
BLOCK = 64  # positions a split reads at a time


@triton.jit
def _split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    lens_ptr,
    part_ptr,
    lse_ptr,
    scale,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_tb,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HD: tl.constexpr,
    HD_P: tl.constexpr,
    SPLIT_N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(lens_ptr + row)
    start = split * SPLIT_N
    end = tl.minimum(start + SPLIT_N, length)
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, HD_P)
    gmask = g < GROUP
    dmask = d < HD
    heads = kvh * GROUP + g
    q = tl.load(
        q_ptr + row * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=gmask[:, None] & dmask[None, :],
        other=0.0,
    ).to(tl.float32)
    m = tl.full([GROUP_P], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HD_P], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pmask = pos < end
        slot = tl.load(table_ptr + row * stride_tb + pos, mask=pmask, other=0)
        kv_mask = pmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        s = tl.where(pmask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        total = total * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        v = v.to(tl.float32)
        pv = tl.dot(p, v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m = m_new
    seen = total > 0  # a split past the row's length reads nothing (the merge skips it)
    out = acc / tl.where(seen, total, 1.0)[:, None]
    tl.store(
        part_ptr + row * stride_pb + heads[:, None] * stride_ph + split * stride_ps + d[None, :],
        out,
        mask=gmask[:, None] & dmask[None, :],
    )
    lse = tl.where(seen, m + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    tl.store(lse_ptr + row * stride_lb + heads * stride_lh + split, lse, mask=gmask)


@triton.jit
def _merge_kernel(
    part_ptr,
    lse_ptr,
    lens_ptr,
    out_ptr,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HD: tl.constexpr,
    HD_P: tl.constexpr,
    SPLIT_N: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    length = tl.load(lens_ptr + row)
    splits = tl.cdiv(length, SPLIT_N)
    d = tl.arange(0, HD_P)
    dmask = d < HD
    m = tl.full([1], float("-inf"), tl.float32)
    total = tl.zeros([1], tl.float32)
    acc = tl.zeros([HD_P], tl.float32)
    for s in range(0, splits):  # in order: the row's own splits, whatever the batch
        lse = tl.load(lse_ptr + row * stride_lb + head * stride_lh + s + tl.zeros([1], tl.int32))
        part = tl.load(
            part_ptr + row * stride_pb + head * stride_ph + s * stride_ps + d, mask=dmask, other=0.0
        )
        m_new = tl.maximum(m, lse)
        alpha = tl.exp(m - m_new)
        w = tl.exp(lse - m_new)
        total = total * alpha + w
        acc = acc * alpha + w * part
        m = m_new
    out = acc / total
    tl.store(out_ptr + row * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=dmask)


def decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one query per row, q [B, H, hd], over the first ``lengths[b]`` (>= 1) positions of row
    b, whose K/V are at token slots ``table[b, :lengths[b]]`` of ``k_cache``/``v_cache`` [slots, KVh, hd]
    (query head h reads KV head ``h // (H // KVh)``): [B, H, hd] in q's dtype (float32, bfloat16 or
    float16: :func:`~rollout_worker.engine.kernels.choice.paged_decode_runs`). ``table`` holds at least the
    longest row's positions; no host synchronisation (CUDA graphs capture it)."""
    bsz, heads, hd = q.shape
    kvh = k_cache.shape[1]
    if heads % kvh:
        raise ValueError(f"{heads} query heads do not share {kvh} KV heads evenly")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q in {q.dtype}, keys in {k_cache.dtype}, values in {v_cache.dtype}")
    group = heads // kvh
    q = q.contiguous()
    splits = max(triton.cdiv(int(table.shape[1]), SPLIT), 1)
    part = torch.empty((bsz, heads, splits, hd), dtype=torch.float32, device=q.device)
    lse = torch.empty((bsz, heads, splits), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    hd_p = triton.next_power_of_2(hd)
    _split_kernel[(bsz, kvh, splits)](
        q,
        k_cache,
        v_cache,
        table,
        lengths,
        part,
        lse,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        table.stride(0),
        part.stride(0),
        part.stride(1),
        part.stride(2),
        lse.stride(0),
        lse.stride(1),
        GROUP=group,
        GROUP_P=max(16, triton.next_power_of_2(group)),  # tl.dot's least rows
        HD=hd,
        HD_P=hd_p,
        SPLIT_N=SPLIT,
        BLOCK_N=BLOCK,
        # float32 at full precision; the 16-bit types' values are exact in TF32, the tensor cores' float32
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    _merge_kernel[(bsz, heads)](
        part,
        lse,
        lengths,
        out,
        part.stride(0),
        part.stride(1),
        part.stride(2),
        lse.stride(0),
        lse.stride(1),
        out.stride(0),
        out.stride(1),
        HD=hd,
        HD_P=hd_p,
        SPLIT_N=SPLIT,
    )
    return out
