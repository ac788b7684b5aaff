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
