"""The default kernels' CUDA decode attention (:func:`attend_kv_major`), computed on CPU against SDPA: the
same math over keys gathered KV-head-major (the GPU tests run it inside the engine)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from rollout_worker.engine.kernels.torch_attention import attend_kv_major


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3), (32, 8)])
def test_kv_major_decode_attention_is_sdpa_over_each_rows_keys(heads: int, kv_heads: int) -> None:
    torch.manual_seed(0)
    bsz, length, hd = 5, 23, 16
    q = torch.randn(bsz, 1, heads, hd, dtype=torch.float64)
    keys = torch.randn(bsz, kv_heads, length, hd, dtype=torch.float64)  # the layout SDPA reads
    vals = torch.randn(bsz, kv_heads, length, hd, dtype=torch.float64)
    positions = torch.tensor([0, 22, 7, 15, 3])  # each row sees keys 0..position
    mask = (torch.arange(length)[None, None, :] <= positions[:, None, None])[:, None]  # [B, 1, 1, L]
    scale = 1 / math.sqrt(hd)
    got = attend_kv_major(
        q, keys.transpose(0, 1).contiguous(), vals.transpose(0, 1).contiguous(), mask, scale
    )
    want = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys, vals, attn_mask=mask, scale=scale, enable_gqa=True
    ).transpose(1, 2)  # [B, 1, H, hd]
    assert got.shape == (bsz, 1, heads * hd)
    torch.testing.assert_close(got, want.reshape(bsz, 1, heads * hd), rtol=0, atol=1e-12)
    # row 0 sees only its first key: its output is that key's values, per KV head of each query head
    expect0 = vals[0, torch.arange(heads) // (heads // kv_heads), 0]
    torch.testing.assert_close(got[0, 0].view(heads, hd), expect0, rtol=0, atol=1e-12)
