"""The paged KV pool: pages from the allocator, storage that grows and keeps its contents, the running
batch's token table, and whole-page extract/insert (migration)."""

from __future__ import annotations

import pytest
import torch
from rollout_worker.engine.model.kv_cache import KVPool, gather_slots

CPU = torch.device("cpu")


def _pool(pages: int = 16, page_size: int = 4, rows: int = 8, row_tokens: int = 64) -> KVPool:
    return KVPool(2, 2, 3, page_size, pages, rows, row_tokens, torch.float64, CPU)


def test_reserve_grows_storage_and_keeps_contents() -> None:
    pool = _pool()
    assert pool.nbytes == 0 and pool.tokens == 64
    a: list[int] = []
    assert pool.reserve(a, 5)  # 2 pages of 4
    assert a == [1, 2] and pool.held == 3  # the null page and two pages
    pool.k[1][pool.slot(a, 6)] = 7.0
    b: list[int] = []
    assert pool.reserve(b, 16)  # 4 more pages: storage grows (doubling), contents copied
    assert b == [3, 4, 5, 6] and pool.held >= 7
    assert float(pool.k[1][pool.slot(a, 6), 0, 0]) == 7.0
    assert pool.reserve(a, 8) and a == [1, 2]  # already held: nothing taken
    assert pool.used_tokens == 24


def test_exhausted_pool_refuses_and_freed_pages_are_reused() -> None:
    pool = _pool(pages=4)
    a: list[int] = []
    b: list[int] = []
    assert pool.reserve(a, 12)
    assert not pool.reserve(b, 8) and b == []  # 1 free page, 2 needed: nothing taken
    pool.free(a)
    assert a == [] and pool.free_pages == 4
    assert pool.reserve(b, 16) and b == [1, 2, 3, 4]
    with pytest.raises(RuntimeError, match="in use"):
        pool.release()
    pool.free(b)
    pool.release()
    assert pool.nbytes == 0 and pool.held == 0


def test_token_table_rows_address_pages_and_null_elsewhere() -> None:
    pool = _pool(page_size=2)
    pages: list[int] = []
    other: list[int] = []
    pool.reserve(other, 2)
    pool.reserve(pages, 5)  # pages [2, 3, 4]: slots 4..9
    pool.bind(1, pages)
    assert pool.table[1, :8].tolist() == [4, 5, 6, 7, 8, 9, 0, 0]
    assert pool.table[0].abs().sum() == 0 and pool.table.shape[1] >= 6
    pool.move_row(1, 0)
    assert pool.table[0, :6].tolist() == [4, 5, 6, 7, 8, 9] and pool.table[1].abs().sum() == 0
    with pytest.raises(ValueError, match="token table"):
        pool.ensure_table(9, 10)  # more rows than max_batch


def test_extract_insert_moves_whole_pages_between_pools() -> None:
    src, dst = _pool(page_size=4), _pool(page_size=4)
    a: list[int] = []
    src.reserve(a, 6)
    for c in (*src.k, *src.v):
        c.copy_(torch.randn(c.shape, dtype=c.dtype))
    b: list[int] = []
    dst.reserve(b, 16)
    dst.free(b)
    dst.reserve(b, 6)  # other page ids than the source's
    dst.insert(b, (1, 2), src.extract(a, (1, 2)))
    for s, d in zip((*src.k, *src.v), (*dst.k, *dst.v), strict=True):
        assert torch.equal(s[src.slots(a), 1:2], d[dst.slots(b), 1:2])
        assert d[dst.slots(b), 0:1].abs().sum() == 0  # only the heads asked for
    with pytest.raises(ValueError, match="expected"):
        dst.insert(b, (0, 2), src.extract(a, (1, 2)))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [8, 3])  # 3: no whole 8-byte units (moved element by element)
def test_gather_slots_is_the_cache_at_those_slots_bit_for_bit(dtype: torch.dtype, head_dim: int) -> None:
    cache = torch.randn(50, 3, head_dim, dtype=torch.float64).to(dtype)
    cache[7, 1, 0] = float("nan")  # bits, not values: a NaN comes through as it is
    read = torch.randint(0, 50, (4, 9))
    read[2, 3] = 7
    rows = gather_slots(cache, read)
    assert rows.shape == (4, 9, 3, head_dim) and rows.dtype == dtype
    assert torch.equal(rows.view(-1).view(torch.uint8), cache[read].reshape(-1).view(torch.uint8))
    heads = gather_slots(cache, read, kv_major=True)
    assert heads.shape == (3, 4, 9, head_dim) and heads.is_contiguous()
    assert torch.equal(heads.view(torch.uint8), cache.transpose(0, 1)[:, read].contiguous().view(torch.uint8))
    one = gather_slots(cache, read[:, 3])  # one slot per row, as a kept decode gather copies
    assert torch.equal(one.view(torch.uint8), cache[read[:, 3]].view(torch.uint8))
