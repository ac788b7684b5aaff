"""A per-replica KV cache: one dense slab per layer, ``[slots, kv_heads_local, capacity, head_dim]``.

Running requests occupy slots 0..B-1 in batch order (the scheduler keeps them compact), so the decode
step attends over a view ``slab[:B, :, :max_len]`` with no copy. The slab grows when a request needs more
slots or tokens than it has (a copy into a larger slab, amortised by growing in steps); the scheduler's
admission limits (max batch, KV budget, context length) bound it.
"""

from __future__ import annotations

import torch

_TOKEN_STEP = 256  # capacity grows in multiples of this
_SLOT_STEP = 8


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


class KVSlab:
    def __init__(
        self,
        layers: int,
        max_slots: int,
        kv_heads: int,
        max_capacity: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.max_slots, self.max_capacity = max_slots, max_capacity
        self.dtype, self.device = dtype, device
        self.slots = self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def ensure(self, slots: int, capacity: int) -> None:
        """Room for ``slots`` requests of ``capacity`` tokens each; existing contents are kept."""
        if slots <= self.slots and capacity <= self.capacity:
            return
        # Each dimension grows only when it is short, then geometrically (amortised copies): a batch that
        # outgrows the slots must not double the tokens too (that multiplied the slab's memory per growth).
        new_slots, new_cap = self.slots, self.capacity
        if slots > self.slots:
            new_slots = min(max(_round_up(slots, _SLOT_STEP), 2 * self.slots), self.max_slots)
        if capacity > self.capacity:
            new_cap = min(max(_round_up(capacity, _TOKEN_STEP), 2 * self.capacity), self.max_capacity)
        if new_slots < slots or new_cap < capacity:
            raise ValueError(
                f"KV slab cannot hold {slots} slots x {capacity} tokens (limits {self.max_slots} x "
                f"{self.max_capacity})"
            )
        shape = (new_slots, self.kv_heads, new_cap, self.head_dim)
        old_k, old_v, s, c = self.k, self.v, self.slots, self.capacity
        self.k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        if s and c:
            for new, old in zip((*self.k, *self.v), (*old_k, *old_v), strict=True):
                new[:s, :, :c] = old
        self.slots, self.capacity = new_slots, new_cap

    def release(self) -> None:
        """Free the memory (``/release_memory_occupation``); the next ``ensure`` allocates again."""
        self.k, self.v = [], []
        self.slots = self.capacity = 0

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
        n = (hi - lo) * length * self.head_dim
        if flat.numel() != 2 * self.layers * n:
            raise ValueError(f"KV buffer of {flat.numel()} elements, expected {2 * self.layers * n}")
        self.ensure(slot + 1, length)
        off = 0
        for pair in zip(self.k, self.v, strict=True):
            for c in pair:
                c[slot, lo:hi, :length] = flat[off : off + n].view(hi - lo, length, -1)
                off += n


def kv_elements(layers: int, heads: int, length: int, head_dim: int) -> int:
    """Elements of one request's K and V for ``heads`` heads (the unit the migration plan moves)."""
    return 2 * layers * heads * length * head_dim
