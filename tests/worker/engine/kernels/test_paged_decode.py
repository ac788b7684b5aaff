"""The paged decode kernel (:mod:`~rollout_worker.engine.kernels.paged_decode`, Triton) under Triton's
interpreter on CPU: against SDPA over the keys gathered from scattered pages, bitwise the same for a row
alone and inside a batch, and inside the engine: a decode reading the pages in place generates the tokens
of the engine's gather path. On a CUDA machine the same tests run the compiled kernel on the GPU."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from rollout_worker.api.requests import RequestSpec
from rollout_worker.api.sampling import Sampling
from rollout_worker.engine.config import EngineConfig
from rollout_worker.engine.driver.fixed_batch import run_batch
from rollout_worker.engine.kernels.choice import Kernels

CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module", autouse=True)
def kernel() -> Iterator[ModuleType]:
    """The kernel module; on CPU with Triton's interpreter on while this module's tests run (Triton reads the
    variable where the kernels are defined and where they launch; the engine's other tests must not pick
    the kernel up in their rank processes)."""
    with pytest.MonkeyPatch.context() as mp:
        if not CUDA:
            mp.setenv("TRITON_INTERPRET", "1")
        from rollout_worker.engine.kernels import paged_decode

        yield paged_decode


DEVICE = torch.device("cuda" if CUDA else "cpu")
HD = 32


def _pool(
    lengths: list[int], kv_heads: int, page_size: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K and V caches [slots, KVh, hd] with each row's pages scattered over them (a shuffled free list, as
    a pool some requests came and went from), and the token table [B, L] of their slots (0 past a row's
    length: the null page)."""
    gen = torch.Generator().manual_seed(seed)
    pages = [math.ceil(n / page_size) for n in lengths]
    order = torch.randperm(sum(pages) + 3, generator=gen) + 1  # page 0 is the null page
    slots = (int(order.max()) + 1) * page_size
    k = torch.randn(slots, kv_heads, HD, generator=gen).to(dtype)
    v = torch.randn(slots, kv_heads, HD, generator=gen).to(dtype)
    width = max(lengths) + 5  # the table is wider than the longest row
    table = torch.zeros(len(lengths), width, dtype=torch.long)
    at = 0
    for b, n in enumerate(lengths):
        mine = order[at : at + pages[b]]
        at += pages[b]
        row = (mine[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:n]
        table[b, :n] = row
    return k.to(DEVICE), v.to(DEVICE), table.to(DEVICE)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, lengths: list[int]
) -> torch.Tensor:
    """The reference: SDPA in float32 over each row's keys gathered from its pages."""
    out = []
    for b, n in enumerate(lengths):
        keys = k[table[b, :n]].float().transpose(0, 1)[None]  # [1, KVh, n, hd]
        vals = v[table[b, :n]].float().transpose(0, 1)[None]
        qb = q[b].float()[None, :, None]  # [1, H, 1, hd]
        out.append(F.scaled_dot_product_attention(qb, keys, vals, scale=HD**-0.5, enable_gqa=True)[0, :, 0])
    return torch.stack(out)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 2e-6), (torch.bfloat16, 1.6e-2)])
def test_the_kernel_is_sdpa_over_the_gathered_pages(
    kernel: ModuleType, page_size: int, group: int, dtype: torch.dtype, atol: float
) -> None:
    lengths = [1, 17, 64, 257, 300, 130]  # within one tile, a tile's edge, several splits
    kv_heads = 2
    k, v, table = _pool(lengths, kv_heads, page_size, dtype, seed=group)
    q = torch.randn(len(lengths), kv_heads * group, HD, generator=torch.Generator().manual_seed(7))
    q = q.to(dtype).to(DEVICE)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    got = kernel.decode(q, k, v, table, lens, HD**-0.5)
    assert got.dtype == dtype and got.shape == q.shape
    want = _sdpa(q, k, v, table, lengths)
    torch.testing.assert_close(got.float(), want, rtol=0, atol=atol)
    # row 0 sees only its first key: its output is that key's values, per KV head of each query head
    first = v[table[0, 0], torch.arange(kv_heads * group, device=DEVICE) // group]
    torch.testing.assert_close(got[0].float(), first.float(), rtol=0, atol=atol / 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_bitwise_the_same_alone_and_in_any_batch(kernel: ModuleType, dtype: torch.dtype) -> None:
    """The splits are the row's own tiles and the merge walks them in order: neither the batch's size, its
    longest row nor the row's place in it changes a bit (the deterministic setting's need)."""
    lengths = [300, 5, 300, 611, 1]
    k, v, table = _pool(lengths, 2, 16, dtype)
    q = torch.randn(len(lengths), 8, HD, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    batch = kernel.decode(q, k, v, table, lens, HD**-0.5)
    for b, n in enumerate(lengths):
        alone = kernel.decode(q[b : b + 1], k, v, table[b : b + 1, :n], lens[b : b + 1], HD**-0.5)
        assert torch.equal(alone[0], batch[b]), b
    rows = [3, 0, 2]  # another batch, another order, a narrower table
    other = kernel.decode(q[rows], k, v, table[rows], lens[rows], HD**-0.5)
    assert all(torch.equal(other[i], batch[r]) for i, r in enumerate(rows))
    # rows 0 and 2 share a length, not their keys: equal lengths do not mix rows up
    assert not torch.equal(batch[0], batch[2])


@pytest.mark.skipif(CUDA, reason="the engine's CPU path under the interpreter (the GPU tests cover CUDA)")
def test_the_engine_reading_pages_in_place_generates_the_gather_paths_tokens(tiny32: Path) -> None:
    """Two ranks at 2x1, float32, greedy and sampled requests of different lengths (one decodes across a
    split's edge, 256 keys): the tokens of the engine whose decode reads the pages in place are the gather
    path's."""
    model = EngineConfig.load(str(tiny32), 1).model
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET")
        assert not Kernels.of(model, torch.float32, DEVICE, paged=True).paged_decode  # CPU: the gather
    assert Kernels.of(model, torch.float32, DEVICE, paged=True).paged_decode
    assert not Kernels.of(model, torch.float64, DEVICE, paged=True).paged_decode  # float64: the gather
    prompts = [(5, 6, 7), tuple(range(1, 40)), tuple(range(1, 246)), (9, 8)]
    specs = [
        RequestSpec(f"r{i}", p, n, Sampling(temperature=0.0 if i % 2 else 0.9, seed=i))
        for i, (p, n) in enumerate(zip(prompts, [3, 30, 20, 12], strict=True))
    ]
    runs = {
        paged: run_batch(EngineConfig.load(str(tiny32), 2, paged_attention=paged, page_size=16), specs)
        for paged in (False, True)
    }
    assert runs[True].tokens() == runs[False].tokens()
    assert len(runs[True].tokens()["r2"]) == 20
