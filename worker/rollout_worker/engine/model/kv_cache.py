"""A per-replica paged KV pool: per layer, K and V of every token slot, ``[slots, kv_heads_local, head_dim]``,
in fixed-size pages of ``page_size`` slots (page p holds slots ``p*page_size .. (p+1)*page_size - 1``).

A request holds a page table (``Sequence.pages``), the pages of its positions in order, taken from the
pool's :class:`~rollout_worker.scheduling.prefix_cache.SharedPages` and given back when it finishes, is
aborted or is
retracted. Requests with equal page-aligned prefixes share those pages (the prefix cache), and a cached
page no request holds stays until the pool needs it.

The pool also keeps the *token table* of the running batch, ``table[row, position]`` = the
token slot of that position for the request in ``row`` (0, the null page's first slot, where the row holds
no page): a forward pass writes K/V at ``table[rows, positions]`` and attention gathers
``storage[table[rows, :keys]]`` into the step's batch (positions past a request's length are masked). Rows
of requests not running are all null, so a padded batch row reads and writes only the null page.

Storage is allocated lazily and grows (a copy, amortised by doubling) up to the highest page handed out:
the allocator hands out the lowest free page, so the pool's memory follows the most pages held at once.
"""

from __future__ import annotations

import torch

from rollout_worker.engine.kernels.choice import Kernels
from rollout_worker.scheduling.pages import PageAllocator, pages_for, round_up
from rollout_worker.scheduling.prefix_cache import SharedPages

_ROW_STEP = 8  # the token table grows in multiples of these
_TOKEN_STEP = 256


class KVPool:
    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        page_size: int,
        pages: int,
        max_rows: int,
        row_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
        prefix_cache: bool = True,
    ) -> None:
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.page_size = page_size
        self.shared = SharedPages(PageAllocator(pages), page_size, prefix_cache)
        self.max_rows, self.row_tokens = max_rows, round_up(row_tokens, page_size)
        self.dtype, self.device = dtype, device
        self.held = 0  # pages of storage, the null page included
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.table = torch.zeros((0, 0), dtype=torch.long, device=device)
        self.version = 0  # bumped by every write a GatheredKV does not mirror (see there)
        self.released_held = 0  # pages of storage held before the last release (see reacquire)

    @property
    def tokens(self) -> int:
        """Tokens the pool holds when full (SGLang's ``max_total_num_tokens``)."""
        return self.shared.pages * self.page_size

    @property
    def used_tokens(self) -> int:
        """Tokens of the pages requests hold (cached pages no request holds are free to take)."""
        return self.shared.held * self.page_size

    @property
    def free_pages(self) -> int:
        return self.shared.available

    @property
    def capacity(self) -> int:
        """Positions a row of the token table addresses now."""
        return int(self.table.shape[1])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    # -- pages -----------------------------------------------------------------------------------------
    def reserve(self, pages: list[int], tokens: int) -> bool:
        """Extend the page table ``pages`` (in place) to hold ``tokens`` tokens; False, and nothing
        taken, when the pool has too few free pages."""
        need = pages_for(tokens, self.page_size) - len(pages)
        if need <= 0:
            return True
        got = self.shared.alloc(need)
        if got is None:
            return False
        pages.extend(got)
        self.grow_storage(max(got) + 1)
        return True

    def share(self, pages: list[int], tokens: list[int], limit: int) -> int:
        """Start the empty page table ``pages`` with the cached pages of the longest page-aligned prefix of
        ``tokens`` of at most ``limit`` tokens, shared; returns the tokens they hold."""
        got = self.shared.match(tokens, limit)
        self.shared.acquire(got)
        pages.extend(got)
        return len(got) * self.page_size

    def cache_prefix(self, tokens: list[int], pages: list[int]) -> None:
        """Cache the full pages of ``tokens`` (whose K/V ``pages`` hold, or will once the forward pass that
        writes them has run) for later requests with the same prefix."""
        self.shared.insert(tokens, pages)

    def flush_cache(self) -> None:
        self.shared.flush()

    def free(self, pages: list[int]) -> None:
        """Give a request's pages back, last first (its page table is emptied)."""
        self.shared.release(reversed(pages))
        pages.clear()

    def grow_storage(self, held: int) -> None:
        if held <= self.held:
            return
        new = min(max(held, 2 * self.held), self.shared.pages + 1)
        shape = (new * self.page_size, self.kv_heads, self.head_dim)
        old = (*self.k, *self.v)
        self.k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        if old:
            n = self.held * self.page_size
            for dst, src in zip((*self.k, *self.v), old, strict=True):
                dst[:n] = src
        self.held = new
        self.version += 1

    def slots(self, pages: list[int]) -> torch.Tensor:
        """Token slots of every position ``pages`` hold, in order (on the pool's device)."""
        ps = self.page_size
        base = torch.tensor(pages, dtype=torch.long, device=self.device)[:, None] * ps
        return (base + torch.arange(ps, device=self.device)).reshape(-1)

    def slot(self, pages: list[int], position: int) -> int:
        return pages[position // self.page_size] * self.page_size + position % self.page_size

    # -- the running batch's token table ---------------------------------------------------------------
    def ensure_table(self, rows: int, tokens: int) -> None:
        """Room in the token table for ``rows`` rows of ``tokens`` positions; contents are kept."""
        r, c = self.table.shape
        if rows <= r and tokens <= c:
            return
        new_r = min(max(round_up(rows, _ROW_STEP), 2 * r), self.max_rows) if rows > r else r
        new_c = min(max(round_up(tokens, _TOKEN_STEP), 2 * c), self.row_tokens) if tokens > c else c
        if new_r < rows or new_c < tokens:
            raise ValueError(
                f"KV token table cannot hold {rows} rows x {tokens} tokens (limits {self.max_rows} x "
                f"{self.row_tokens})"
            )
        table = torch.zeros((new_r, new_c), dtype=torch.long, device=self.device)
        table[:r, :c] = self.table
        self.table = table

    def bind(self, row: int, pages: list[int]) -> None:
        """Row ``row`` of the token table addresses ``pages`` (the rest of the row: the null page)."""
        n = len(pages) * self.page_size
        self.ensure_table(row + 1, n)
        self.table[row] = 0
        if pages:
            self.table[row, :n] = self.slots(pages)

    def move_row(self, src: int, dst: int) -> None:
        self.table[dst] = self.table[src]
        self.table[src] = 0

    def clear_row(self, row: int) -> None:
        if row < self.table.shape[0]:
            self.table[row] = 0

    def release(self) -> None:
        """Free the memory (``/release_memory_occupation``; no request holds a page); it grows again."""
        self.shared.flush()
        if self.shared.held:
            raise RuntimeError(f"cannot release a KV pool with {self.shared.held} page(s) in use")
        self.released_held = max(self.released_held, self.held)
        self.k, self.v, self.held = [], [], 0
        self.table = torch.zeros((0, 0), dtype=torch.long, device=self.device)
        self.version += 1

    def reacquire(self) -> None:
        """Allocate again the storage the pool held before its last release (``/resume_memory_occupation``),
        so the memory is the pool's when the resume returns; it grows on from there as before."""
        self.grow_storage(self.released_held)
        self.released_held = 0

    # -- migration -------------------------------------------------------------------------------------
    def extract(self, pages: list[int], heads: tuple[int, int]) -> torch.Tensor:
        """K and V of local heads [lo, hi) of whole ``pages``, flattened (what migration sends)."""
        lo, hi = heads
        idx = self.slots(pages)
        return torch.cat(
            [c[idx, lo:hi].reshape(-1) for pair in zip(self.k, self.v, strict=True) for c in pair]
        )

    def insert(self, pages: list[int], heads: tuple[int, int], flat: torch.Tensor) -> None:
        lo, hi = heads
        idx = self.slots(pages)
        n = len(idx) * (hi - lo) * self.head_dim
        if flat.numel() != 2 * self.layers * n:
            raise ValueError(f"KV buffer of {flat.numel()} elements, expected {2 * self.layers * n}")
        off = 0
        for pair in zip(self.k, self.v, strict=True):
            for c in pair:
                c[idx, lo:hi] = flat[off : off + n].view(len(idx), hi - lo, self.head_dim)
                off += n
        self.version += 1


class GatheredKV:
    """The running batch's K/V as a decode step reads them, ``storage[read]`` per layer with ``read`` the
    token table's ``[B, L]`` slots, kept from one decode step to the next (eager decode on CPU).

    Between two decode steps of the same batch the table's rows read the same slots plus the new position,
    and the pool's slots change only by the step's own K/V writes, which this mirrors; so the last gather
    and those writes are this step's gather, and a step writes its own K/V (one position per row) instead
    of gathering ``B x L`` tokens per layer. It is valid while the pool's ``version`` (bumped by every other
    write: prefill, migration, reallocation, release) is the one it was built at and every row reads slots
    some row read before (:meth:`begin`); otherwise it starts over with one full gather. Every position
    attention sees is bitwise the gather's (masked ones may hold zeros instead of the null slot's values).
    It costs a second copy of the running batch's K/V."""

    _STEP = 64  # positions are allocated in multiples of these

    def __init__(self) -> None:
        # per layer [B, KVh, capacity, hd], as attention reads them; with transposed keys (the kernels'
        # keys layout) the keys are a view of [B, KVh, hd, capacity] (each KV head's keys row-major [hd,
        # capacity], as the deterministic attention's products read them)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.keys_t = False
        self.read = torch.zeros((0, 0), dtype=torch.long)  # the slots gathered so far [B, length]
        self.version = -1
        self.start = 0  # this step gathers positions [start, L) of every row
        self.kept = self.gathers = 0  # steps that kept the last gather / gathered everything
        self.writes = (torch.zeros(0, dtype=torch.long),) * 2  # a kept step's K/V elements (_offsets)

    def clear(self) -> None:
        self.k, self.v, self.version = [], [], -1
        self.writes = (torch.zeros(0, dtype=torch.long),) * 2
        self.read = torch.zeros((0, 0), dtype=torch.long)

    def begin(self, pool: KVPool, read: torch.Tensor, positions: torch.Tensor, kernels: Kernels) -> None:
        """Before a decode step over ``read`` [B, L] writing row b's K/V at ``positions[b]``: keep what is
        still the gather, else start over. A row is still gathered when some row of the last step read the
        same slots (but at its new position, which then read the null slot): the same row, or the one a
        finished request's row took over (the replica moves its last row into the hole), which is copied.
        The keys are kept in the layout ``kernels`` reads them in (:attr:`Kernels.keys`; another layout than
        the last step's starts over)."""
        keys_t = kernels.keys == "transposed"
        if keys_t != self.keys_t:
            self.clear()
            self.keys_t = keys_t
        rows, length = read.shape
        done = min(self.read.shape[1], length)  # a batch whose longest request finished reads fewer
        src = self._sources(pool, read, positions, done)
        self.start = done if src is not None else 0
        if src is None:
            self.gathers += 1
        else:
            self.kept += 1
        have_rows, cap = (self.k[0].shape[0], self.k[0].shape[2]) if self.k else (0, 0)
        if rows > have_rows or length > cap:
            size = round_up(max(length, 2 * cap if src is not None else 0), self._STEP)
            shape = (max(rows, have_rows), pool.kv_heads, size, pool.head_dim)
            old = (*self.k, *self.v) if src is not None else ()
            self.k = [self._buffer(pool, shape, self.keys_t) for _ in range(pool.layers)]
            self.v = [self._buffer(pool, shape, False) for _ in range(pool.layers)]
            for dst, was in zip((*self.k, *self.v), old, strict=False):
                dst[: was.shape[0], :, :done] = was[:, :, :done]
        if src is not None:
            moved = (src != torch.arange(rows)).nonzero()[:, 0]
            if len(moved):
                for buf in (*self.k, *self.v):
                    buf[moved] = buf[src[moved]]  # the right side is copied first
            self.writes = (_offsets(self.k[0], positions), _offsets(self.v[0], positions))

    def _sources(
        self, pool: KVPool, read: torch.Tensor, positions: torch.Tensor, done: int
    ) -> torch.Tensor | None:
        """For each row of ``read``, the row of the last step that read its first ``done`` slots, or None when
        some row has none (or the pool was written behind this object's back)."""
        if self.version != pool.version or not self.k:
            return None
        was = read[:, :done].clone()
        last = self.read[:, :done]
        grown = (positions < done).nonzero()[:, 0]  # rows whose new position was read before
        was[grown, positions[grown]] = 0  # what the last step read there: the null slot
        rows = was.shape[0]
        n = min(rows, self.read.shape[0])
        src = torch.full((rows,), -1, dtype=torch.long)
        same = (was[:n] == last[:n]).all(1)
        src[:n][same] = torch.arange(n)[same]
        for b in (src < 0).nonzero()[:, 0].tolist():
            hit = (last == was[b]).all(1).nonzero()[:, 0]
            if not len(hit):
                return None
            src[b] = hit[0]
        return src

    def layer(
        self, i: int, pool: KVPool, read: torch.Tensor, new: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s keys and values [B, KVh, L, hd] once the step has written its K/V ``new`` ([B, 1,
        KVh, hd] each) to the pool: each row's new position (:meth:`begin`'s ``positions``) is the step's
        own K/V, the positions not kept yet are gathered (all of them when the step starts over) or, past
        the last step's length, zeros: a decode step grows its rows by one position each, so the only
        position there a row sees is its new one, and attention's mask drops the rest (which must be
        finite, as the null slot's are)."""
        lo, (b, length) = self.start, read.shape
        out = []
        for buf, src, kv, at in zip(
            (self.k[i], self.v[i]), (pool.k[i], pool.v[i]), new, self.writes, strict=True
        ):
            if not lo:
                buf[:b, :, :length] = gather_slots(src, read).transpose(1, 2)
            else:
                if lo < length:
                    buf[:b, :, lo:length] = 0
                _storage(buf).index_put_((at,), kv.reshape(-1))  # row r's KVh x hd values at its position
            out.append(buf[:b, :, :length])
        return out[0], out[1]

    @staticmethod
    def _buffer(pool: KVPool, shape: tuple[int, int, int, int], transposed: bool) -> torch.Tensor:
        """An empty kept buffer of ``shape`` [B, KVh, capacity, hd]; ``transposed``: a view of [B, KVh, hd,
        capacity] storage."""
        b, kvh, cap, hd = shape
        if transposed:
            return torch.empty((b, kvh, hd, cap), dtype=pool.dtype, device=pool.device).transpose(2, 3)
        return torch.empty(shape, dtype=pool.dtype, device=pool.device)

    def end(self, pool: KVPool, read: torch.Tensor) -> None:
        """After the step: what is gathered now (the pool's version is unchanged by a mirrored step)."""
        self.read = read.clone()
        self.version = pool.version


def _offsets(buf: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The elements of a kept buffer's storage (:func:`_storage`) that rows 0..B-1 of a decode step write
    at their ``positions`` [B]: [B * KVh * hd], in the order of a step's K/V [B, KVh, hd]. One scatter into
    the flat storage instead of ``buf[rows, :, positions] = kv``, whose index kernel is slow on transposed
    keys; the same positions for every layer of a step."""
    s0, s1, s2, s3 = buf.stride()
    kvh, hd = buf.shape[1], buf.shape[3]
    dev = positions.device
    at = (torch.arange(len(positions), device=dev) * s0 + positions * s2)[:, None, None]
    heads, dims = torch.arange(kvh, device=dev)[None, :, None] * s1, torch.arange(hd, device=dev) * s3
    return (at + heads + dims).view(-1)


def _storage(buf: torch.Tensor) -> torch.Tensor:
    """A kept buffer (contiguous, or a transposed view of contiguous storage, from its start) as its flat
    storage."""
    assert buf.storage_offset() == 0
    return buf.as_strided((buf.numel(),), (1,), 0)


def gather_slots(cache: torch.Tensor, read: torch.Tensor, kv_major: bool = False) -> torch.Tensor:
    """The K or V at token slots ``read`` [*R] of one layer's ``cache`` [slots, KVh, hd]: [*R, KVh, hd], or
    [KVh, *R, hd] with ``kv_major`` (each KV head's keys together, as a decode step's products read them).

    Bitwise the cache's values, moved in 8-byte units where a head's vector is made of them: torch's index
    kernels move one element per step, so 4 bfloat16 (2 float32) values at a time is 4x (2x) fewer; a
    token's whole row is one slice of ``index_select`` (on CPU a row copy)."""
    wide = cache.view(torch.int64) if cache.shape[-1] * cache.element_size() % 8 == 0 else cache
    if kv_major:
        out = wide.transpose(0, 1)[:, read]  # [KVh, *R, hd']
    else:
        out = torch.index_select(wide.view(wide.shape[0], -1), 0, read.reshape(-1))
        out = out.view(*read.shape, *wide.shape[1:])
    return out.view(cache.dtype)


def single_row(pool: KVPool, tokens: int) -> torch.Tensor:
    """Pages for one request of ``tokens`` tokens in row 0: its token table ``[1, tokens]`` (for callers
    that run the decoder outside a replica: probes and tests)."""
    pages: list[int] = []
    if not pool.reserve(pages, tokens):
        raise ValueError(f"a KV pool of {pool.tokens} tokens cannot hold {tokens}")
    pool.bind(0, pages)
    return pool.table[:1, :tokens]


def kv_elements(layers: int, heads: int, length: int, head_dim: int) -> int:
    """Elements of one request's K and V for ``heads`` heads (the unit the migration plan moves)."""
    return 2 * layers * heads * length * head_dim
