"""The KV slab grows as requests need it and keeps what it held."""

from __future__ import annotations

import pytest
import torch
from rollout_worker.engine.kvcache import KVSlab


def test_slab_grows_and_keeps_contents() -> None:
    slab = KVSlab(2, 64, 2, 4096, 8, torch.float64, torch.device("cpu"))
    assert slab.nbytes == 0
    slab.ensure(3, 100)
    assert (slab.slots, slab.capacity) == (8, 256)
    slab.k[1][2, 1, 99, 0] = 7.0
    slab.ensure(9, 300)  # more slots and tokens: reallocated, contents copied
    assert (slab.slots, slab.capacity) == (16, 512) and float(slab.k[1][2, 1, 99, 0]) == 7.0
    slab.ensure(4, 10)  # fits: nothing changes
    assert slab.capacity == 512
    with pytest.raises(ValueError, match="cannot hold"):
        slab.ensure(65, 10)
    slab.release()
    assert slab.nbytes == 0 and slab.slots == 0


def test_more_slots_do_not_grow_the_tokens() -> None:
    """A batch sweep at one context (the profiler's grid, a serving batch that fills up) grows the slots
    geometrically and leaves the tokens alone: the slab ends at the size the largest batch needs."""
    slab = KVSlab(1, 64, 1, 4096, 1, torch.float32, torch.device("cpu"))
    for batch in (1, 2, 4, 8, 16, 32, 64):
        slab.ensure(batch, 320)
    assert (slab.slots, slab.capacity) == (64, 512)
    slab.ensure(64, 600)  # more tokens only: the slots stay
    assert (slab.slots, slab.capacity) == (64, 1024)
    slab.ensure(3, 2000)
    assert (slab.slots, slab.capacity) == (64, 2048)


def test_slot_growth_is_geometric() -> None:
    slab = KVSlab(1, 1000, 1, 256, 1, torch.float32, torch.device("cpu"))
    sizes = []
    for batch in range(1, 201):
        slab.ensure(batch, 10)
        sizes.append(slab.slots)
    assert len(set(sizes)) <= 6  # 8, 16, 32, 64, 128, 256: few copies for 200 arrivals
    assert slab.slots == 256
