"""A per-replica KV cache: one dense slab per layer, ``[slots, kv_heads_local, capacity, head_dim]``.

Running requests occupy slots 0..B-1 in batch order (the scheduler keeps them compact), so the decode
step attends over a view ``slab[:B, :, :max_len]`` with no copy.
"""

from __future__ import annotations

import torch


class KVSlab:
    def __init__(
        self,
        layers: int,
        slots: int,
        kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (slots, kv_heads, capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.slots, self.kv_heads, self.capacity = slots, kv_heads, capacity

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy a request's cache from slot ``src`` to ``dst`` (compaction after a request finishes)."""
        for cache in (*self.k, *self.v):
            cache[dst, :, :length] = cache[src, :, :length]

    def extract(self, slot: int, heads: tuple[int, int], length: int) -> torch.Tensor:
        """K and V of local heads [lo, hi) for ``length`` tokens, flattened (for migration)."""
        lo, hi = heads
        parts = [
            c[slot, lo:hi, :length].reshape(-1) for pair in zip(self.k, self.v, strict=True) for c in pair
        ]
        return torch.cat(parts)

    def insert(self, slot: int, heads: tuple[int, int], length: int, flat: torch.Tensor) -> None:
        lo, hi = heads
        n = (hi - lo) * length * self.k[0].shape[-1]
        if flat.numel() != 2 * len(self.k) * n:
            raise ValueError(f"KV buffer of {flat.numel()} elements, expected {2 * len(self.k) * n}")
        off = 0
        for pair in zip(self.k, self.v, strict=True):
            for c in pair:
                c[slot, lo:hi, :length] = flat[off : off + n].view(hi - lo, length, -1)
                off += n


def kv_elements(layers: int, heads: int, length: int, head_dim: int) -> int:
    """Elements of one request's K and V for ``heads`` heads (the unit the migration plan moves)."""
    return 2 * layers * heads * length * head_dim
