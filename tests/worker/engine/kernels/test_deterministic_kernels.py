"""The deterministic kernels, one reduction at a time (issue 19, item 2): a row's result is bitwise the same
alone, among 3, 4 and 63 other rows, at any position, and at TP 1, 2 and 4 (the real model's 9 heads / 3
KV groups included). Each test also runs the default kernel on the same inputs and requires it to differ
somewhere: that is what the invariant kernel is for, and it shows the comparison can fail. The products are
tested on both kernels the engine uses: MKL's ``sgemm`` (float64, bfloat16, float32 unpacked) and oneDNN's
product on packed weights (float32, ``engine.packed``); the row-parallel chunks in both forms of their
batched ``sgemm`` (the tokens as columns, with the stacked product for a few, or as rows) and on the
fixed-order kernel (``engine.native``, where this machine builds it: AVX-512 or AVX2, a C++ compiler) in both
its forms, over a packed copy (``native``) and over the weight as it is (``dense``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from rollout_worker.config.model_config import ModelConfig
from rollout_worker.engine.kernels import deterministic_attention as attn
from rollout_worker.engine.kernels import fixed_order, packed_linear, row_parallel, row_rules, tree_sums
from rollout_worker.engine.kernels import row_chunks as chunking
from rollout_worker.engine.kernels.choice import Attend
from rollout_worker.engine.model.presets import preset_config
from rollout_worker.engine.model.sharding import kv_head_range, q_head_range

OTHERS = (0, 3, 4, 63)  # other rows in the batch
Product = Callable[..., torch.Tensor]

# the fixed-order kernel runs where this machine builds it (AVX-512 or AVX2; .ci/run fails where it does not)
BUILT = pytest.mark.skipif(fixed_order.kernels() is None, reason="no AVX-512 or AVX2, or no C++ compiler")
NATIVE, DENSE = pytest.param("native", marks=BUILT), pytest.param("dense", marks=BUILT)


def _unpacked(w: fixed_order.Packed) -> torch.Tensor:
    """The dense [out, in] weight a one-chunk :func:`fixed_order.pack` holds."""
    _, blocks, k, width = w.blocks.shape
    return w.blocks[0].permute(0, 2, 1).reshape(blocks * width, k)[: w.out]


# kernel: (the invariant product, how it takes a weight, the default product on that weight)
KERNELS: dict[str, tuple[Product, Callable[[torch.Tensor], object], Product]] = {
    "sgemm": (row_rules.linear, lambda w: w, F.linear),
    "packed": (row_rules.packed_linear, packed_linear.pack, packed_linear.linear),
    # the fixed-order kernel, whose default is sgemm on the same weight
    "native": (fixed_order.linear, fixed_order.pack, lambda x, w: F.linear(x, _unpacked(w))),
    "dense": (fixed_order.linear, lambda w: w, F.linear),
}
kernels = pytest.mark.parametrize(
    "kernel",
    [
        "sgemm",
        pytest.param(
            "packed",
            marks=pytest.mark.skipif(not packed_linear.available(), reason="no oneDNN packed linear"),
        ),
        NATIVE,
        DENSE,
    ],
)


def setup_module() -> None:
    torch.set_num_threads(1)  # as each rank runs


def _smollm2() -> ModelConfig:
    return ModelConfig.from_dict(preset_config("smollm2-135m"), where="smollm2-135m")


def _batches(row: torch.Tensor, gen: torch.Generator) -> list[torch.Tensor]:
    """``row`` [1, ...] among each count of other rows, at the first, a middle and the last position."""
    out = []
    for n in OTHERS:
        for at in sorted({0, n // 2, n}):
            rest = torch.randn(n, *row.shape[1:], generator=gen)
            out.append(torch.cat((rest[:at], row, rest[at:])))
    return out


def _row_of(batch: torch.Tensor, row: torch.Tensor) -> int:
    return next(i for i in range(batch.shape[0]) if torch.equal(batch[i], row[0]))


@kernels
@pytest.mark.parametrize("out, k", [(1536, 576), (576, 1536)])
def test_linear_rows_do_not_depend_on_the_batch(kernel: str, out: int, k: int) -> None:
    linear, prepare, default = KERNELS[kernel]
    gen = torch.Generator().manual_seed(0)
    w = prepare(torch.randn(out, k, generator=gen))
    default_differs = False
    for _ in range(5):
        row = torch.randn(1, k, generator=gen)
        alone, alone_default = linear(row, w), default(row, w)
        for batch in _batches(row, gen):
            i = _row_of(batch, row)
            assert torch.equal(linear(batch, w)[i], alone[0]), batch.shape
            default_differs |= not torch.equal(default(batch, w)[i], alone_default[0])
    # sgemm's 1-row and 4-row kernels round differently (the case this kernel exists for); whether oneDNN's
    # packed 1-row kernel differs depends on the CPU (on AVX-512 where K > 1024; on an AVX2 CPU it did not)
    assert default_differs or kernel == "packed"


@kernels
def test_linear_columns_do_not_depend_on_the_tp_split(kernel: str) -> None:
    """Column-parallel: each shard's columns (real model: q heads split 3 / 6 at TP 2) equal the full
    product's (packed: each shard's rows of the weight packed on their own, as a rank packs its shard)."""
    linear, prepare, _ = KERNELS[kernel]
    cfg = _smollm2()
    gen = torch.Generator().manual_seed(1)
    hd = cfg.head_dim
    wq = torch.randn(cfg.num_heads * hd, cfg.hidden_size, generator=gen)
    wk = torch.randn(cfg.num_kv_heads * hd, cfg.hidden_size, generator=gen)
    for rows in (1, 3, 4, 64):
        x = torch.randn(rows, 1, cfg.hidden_size, generator=gen)
        q, k = linear(x, prepare(wq)), linear(x, prepare(wk))
        for tp in (2, 4):
            for s in range(tp):
                lo, hi = q_head_range(cfg, tp, s)
                assert torch.equal(linear(x, prepare(wq[lo * hd : hi * hd])), q[..., lo * hd : hi * hd])
                lo, hi = kv_head_range(cfg, tp, s)
                assert torch.equal(linear(x, prepare(wk[lo * hd : hi * hd])), k[..., lo * hd : hi * hd])


@kernels
def test_linear_folds_a_strided_3d_input_into_one_product(kernel: str) -> None:
    """A [B, 1, K] view whose size-1 dimension has an odd stride (what attention's output is at decode)
    is multiplied as one B-row product, not B one-row products."""
    linear, prepare, _ = KERNELS[kernel]
    gen = torch.Generator().manual_seed(2)
    w = prepare(torch.randn(576, 64, generator=gen))
    base = torch.randn(5, 4, 64, generator=gen)
    odd = base[:, :1]  # [5, 1, 64], strides (256, 64, 1)
    assert torch.equal(linear(odd, w), linear(odd.contiguous(), w))


def _row_parallel(
    x: torch.Tensor,
    w: torch.Tensor,
    bounds: tuple[int, ...],
    shards: list[tuple[int, int]],
    kernel: row_rules.ChunkKernel,
) -> torch.Tensor:
    """The row-parallel product as the ranks compute it on ``kernel``: each shard's partials added into its
    whole subtrees, gathered (here in one process), added up the fixed tree; also checked against the
    tree over every chunk's partial."""
    sums, parts = [], []
    for s, (lo, hi) in enumerate(shards):
        chunks = chunking.Chunks.of(bounds, shards, s)
        shard = w[:, lo:hi].contiguous()
        mine = row_parallel.partials(x[..., lo:hi], row_parallel.row_weight(shard, chunks, kernel), chunks)
        parts.append(mine)
        sums.append(chunking.shard_sums(mine, chunks))
    every = chunking.gathered_sum(sums, chunking.Chunks.of(bounds, shards, 0))
    assert torch.equal(every, tree_sums.tree_sum(torch.cat(parts)))
    return every


@pytest.mark.parametrize("kernel", [NATIVE, DENSE, "partials", "rows"])
def test_row_parallel_sum_does_not_depend_on_tp_or_batch(kernel: row_rules.ChunkKernel) -> None:
    """Attention output (9 heads of 64, uneven at TP 2 and 4) and MLP down (1536) of the real model, on
    each chunk kernel: the fixed-order kernel (packed or dense), or one batched sgemm product over the
    dense weight, the tokens as its columns (a row alone: one MKL product over the stacked chunks, where
    this CPU's MKL computes the same bits) or as its rows."""
    cfg = _smollm2()
    chunks = chunking.RowChunks.of(cfg, 4)
    gen = torch.Generator().manual_seed(3)
    cases = [
        (chunks.attn_out, chunking.attn_shards, cfg.num_heads * cfg.head_dim),
        (chunks.mlp_down, chunking.mlp_shards, cfg.intermediate_size),
    ]
    default_differs = False
    for bounds, shards_of, k in cases:
        w = torch.randn(cfg.hidden_size, k, generator=gen)
        row = torch.randn(1, 1, k, generator=gen)
        ref = _row_parallel(row, w, bounds, shards_of(cfg, 1), kernel)[0]
        for tp in (1, 2, 4):
            for batch in _batches(row, gen):
                i = _row_of(batch, row)
                got = _row_parallel(batch, w, bounds, shards_of(cfg, tp), kernel)[i]
                assert torch.equal(got, ref), (k, tp)
                halves = shards_of(cfg, 2)  # the default: each rank's product, summed
                default = sum(F.linear(batch[..., lo:hi], w[:, lo:hi]) for lo, hi in halves)
                default_differs |= not torch.equal(default[i], F.linear(row, w)[0])  # type: ignore[index]
    assert default_differs


@pytest.mark.parametrize("width", [64, 192, 1792])
def test_fused_rows_is_the_fewest_rows_that_give_the_batched_products_bits(width: int) -> None:
    """MKL's packed product over stacked chunks (``fuse``) gives a chunk's row the batched product's bits in
    every product of ``fused_rows`` rows or more (first, middle, last; the chunk first or last among three
    in the stack), and not with one row fewer; where the probe says it never does (None), the largest
    probe count differs indeed."""
    least = row_parallel.fused_rows(width, torch.float32)
    gen = torch.Generator().manual_seed(width + 1)
    w = torch.randn(48, width, generator=gen)
    row = torch.randn(width, generator=gen)
    rule = row_rules.least_rows("partials", width, torch.float32)
    batched = row_rules.chunk_products("partials", w, row.expand(rule, width), 1)[0, 0]
    stacked = w.repeat(3, 1)

    def among(count: int, at: int) -> list[torch.Tensor]:
        x = torch.randn(count, width, generator=gen)
        x[at] = row
        out = packed_linear.mkl_linear(x, packed_linear.mkl_pack(stacked, count))[at]
        return [out[:48], out[96:]]

    if least is None:
        assert not all(torch.equal(got, batched) for got in among(row_rules.PROBE_ROWS[-1], 0))
        return
    for count in sorted({least, least + 1, 2 * least + 3, 100}):
        for at in (0, count // 2, count - 1):
            assert all(torch.equal(got, batched) for got in among(count, at)), (count, at)
    if least > 1:
        assert not all(torch.equal(got, batched) for at in (0, least - 2) for got in among(least - 1, at))


def test_a_few_tokens_take_the_stacked_product_and_get_the_batched_bits() -> None:
    """The real model's row-parallel weights at TP 1, 2 and 4: where this CPU's MKL agrees (``fused_rows``),
    a token's partials come from the stacked product (it is called), bitwise those of the batched product
    over the dense weight; 2 tokens too where the packing's rows hold them."""
    cfg = _smollm2()
    row_chunks = chunking.RowChunks.of(cfg, 4)
    gen = torch.Generator().manual_seed(9)
    calls = 0
    real = packed_linear.mkl_linear

    def counted(x: torch.Tensor, w: packed_linear.MklPacked) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return real(x, w)

    for bounds, shards_of, k in (
        (row_chunks.attn_out, chunking.attn_shards, cfg.num_heads * cfg.head_dim),
        (row_chunks.mlp_down, chunking.mlp_shards, cfg.intermediate_size),
    ):
        w = torch.randn(cfg.hidden_size, k, generator=gen)
        for tp in (1, 2, 4):
            shards = shards_of(cfg, tp)
            for s, (lo, hi) in enumerate(shards):
                chunks = chunking.Chunks.of(bounds, shards, s)
                weight = row_parallel.row_weight(w[:, lo:hi].contiguous(), chunks, "partials")
                rows = row_parallel.stacked_rows(chunks, torch.float32)
                assert (weight.fused is None) == (rows is None)
                if weight.fused is None:
                    continue
                assert weight.fused.rows == rows and rows >= chunks.local
                dense = row_parallel.ChunkedWeight(weight.dense, "partials")
                for tokens in range(1, weight.fused.rows // chunks.local + 1):
                    x = torch.randn(tokens, 1, hi - lo, generator=gen)
                    before = calls
                    with pytest.MonkeyPatch.context() as m:
                        m.setattr(packed_linear, "mkl_linear", counted)
                        got = row_parallel.partials(x, weight, chunks)
                    assert calls == before + 1
                    assert torch.equal(got, row_parallel.partials(x, dense, chunks)), (k, tp, s, tokens)
    assert calls > 0 or row_parallel.fused_rows(64, torch.float32) is None


def test_each_shard_adds_its_whole_subtrees_first_and_the_tree_is_the_same() -> None:
    """Every split of 1 to 17 chunks into 1 to 4 shards: each shard's chunks as the fewest whole subtrees
    of the tree (fewer partials to gather than chunks where a shard holds 2 or more), whose sums, added up
    the tree, are bitwise the tree over every chunk, negative zeros included (a zero added to -0.0 makes
    +0.0, so the tree's padding zeros must be added where it adds them)."""
    gen = torch.Generator().manual_seed(6)
    assert tree_sums.tree_nodes(0, 5, 9) == ((2, 0), (0, 4))
    assert tree_sums.tree_nodes(5, 9, 9) == ((0, 5), (1, 3), (3, 1))
    assert tree_sums.tree_nodes(0, 4, 8) == ((2, 0),) and tree_sums.tree_nodes(0, 1, 1) == ((0, 0),)
    for n in range(1, 18):
        parts = torch.randn(n, 6, generator=gen)
        parts[:, 0] = -0.0  # every partial's first column: -0.0, whose tree sum is +0.0 only where it pads
        parts[n // 2 :, 1] = -0.0
        want = tree_sums.tree_sum(parts)
        for shards in range(1, min(n, 4) + 1):
            for cuts in _splits(n, shards):
                per_shard = tuple(b - a for a, b in zip((0, *cuts), (*cuts, n), strict=True))
                everyone = []
                for s in range(shards):
                    chunks = chunking.Chunks(1, per_shard, s)
                    nodes = chunks.nodes(s)
                    covered = [c for lv, j in nodes for c in range(j << lv, min((j + 1) << lv, n))]
                    assert covered == list(range(chunks.start, chunks.start + chunks.local))  # in order
                    mine = parts[chunks.start : chunks.start + chunks.local]
                    everyone.append(chunking.shard_sums(mine, chunks))
                got = chunking.gathered_sum(everyone, chunking.Chunks(1, per_shard, 0))
                assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (n, cuts)  # signs of 0
    uneven = chunking.Chunks(64, (5, 4), 0)  # SmolLM2's 9 attention chunks at TP 2: 2 + 3 subtrees, not 5 + 4
    assert [len(uneven.nodes(s)) for s in (0, 1)] == [2, 3]
    assert [len(chunking.Chunks(192, (4, 4), 0).nodes(s)) for s in (0, 1)] == [1, 1]


def _splits(n: int, shards: int) -> list[tuple[int, ...]]:
    """Every way to cut ``n`` chunks into ``shards`` non-empty runs: the cut points."""
    if shards == 1:
        return [()]
    return [
        (c, *(c + r for r in rest)) for c in range(1, n - shards + 2) for rest in _splits(n - c, shards - 1)
    ]


def test_chunks_are_never_split_by_a_layout() -> None:
    cfg = _smollm2()
    chunks = chunking.RowChunks.of(cfg, 4)
    for tp in (1, 2, 4):
        for lo, hi in chunking.attn_shards(cfg, tp):
            assert lo in chunks.attn_out and hi in chunks.attn_out
        for lo, hi in chunking.mlp_shards(cfg, tp):
            assert lo in chunks.mlp_down and hi in chunks.mlp_down
    assert chunks.attn_out[0] == 0 and chunks.attn_out[-1] == cfg.num_heads * cfg.head_dim
    assert chunks.mlp_down[-1] == cfg.intermediate_size


def test_tree_sum_ignores_trailing_zeros() -> None:
    gen = torch.Generator().manual_seed(4)
    parts = torch.randn(5, 3, 7, generator=gen)
    ref = tree_sums.tree_sum(parts)
    for extra in (1, 3, 11):
        assert torch.equal(tree_sums.tree_sum(torch.cat((parts, torch.zeros(extra, 3, 7)))), ref)
    assert not all(torch.equal(tree_sums.tree_sum(parts[p]), ref) for p in ([4, 3, 2, 1, 0], [1, 0, 2, 3, 4]))


def _t(keys: torch.Tensor) -> torch.Tensor:
    """Keys [B, KVh, L, hd] as attend takes them on CPU: a view of each KV head's [hd, L] row-major."""
    return keys.transpose(-1, -2).contiguous().transpose(-1, -2)


@pytest.fixture(params=["torch", NATIVE])
def attend(request: pytest.FixtureRequest) -> Attend:
    """The deterministic attention on the fixed-order kernel (where it is built) or on torch's operations
    (as elsewhere)."""
    return attn.attend if request.param == "torch" else fixed_order.attend


def test_attention_row_does_not_depend_on_batch_padding_prefill_or_tp(attend: Attend) -> None:
    """A query's output: decoded alone over its own keys; among 3, 4 and 63 other rows whose keys are
    longer (its keys padded to theirs); as the last row of a prefill of its whole sequence; and per TP
    shard of the real model's heads (9 query heads over 3 KV heads; at TP 4 a KV head is duplicated).
    Within float32 rounding of SDPA's."""
    cfg = _smollm2()
    hd, heads, kvh = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    gen = torch.Generator().manual_seed(5)
    own = 150  # two key chunks
    seq_q = torch.randn(1, own, heads, hd, generator=gen)
    k = torch.randn(1, kvh, own, hd, generator=gen)
    v = torch.randn(1, kvh, own, hd, generator=gen)
    q = seq_q[:, -1:]
    ref = attend(q, _t(k), v, torch.ones(1, 1, 1, own, dtype=torch.bool), 0.125)
    default_ref = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, scale=0.125, enable_gqa=True)
    assert torch.allclose(ref, default_ref.transpose(1, 2).reshape(ref.shape), atol=1e-5)
    default_differs = False
    for n in (3, 4, 63):
        for length in (own, own + 1, 300, 700):
            qs = torch.cat((q, torch.randn(n, 1, heads, hd, generator=gen)))
            ks = torch.cat(
                (F.pad(k, (0, 0, 0, length - own)), torch.randn(n, kvh, length, hd, generator=gen))
            )
            vs = torch.cat(
                (F.pad(v, (0, 0, 0, length - own)), torch.randn(n, kvh, length, hd, generator=gen))
            )
            mask = torch.ones(n + 1, 1, 1, length, dtype=torch.bool)
            mask[0, ..., own:] = False
            assert torch.equal(attend(qs, _t(ks), vs, mask, 0.125)[:1], ref), (n, length)
            default = F.scaled_dot_product_attention(
                qs.transpose(1, 2), ks, vs, attn_mask=mask, scale=0.125, enable_gqa=True
            )
            default_differs |= not torch.equal(default[:1], default_ref)
    causal = torch.tril(torch.ones(own, own, dtype=torch.bool))[None, None]
    assert torch.equal(attend(seq_q, _t(k), v, causal, 0.125)[:, -1:], ref)  # the prefill's last row
    for tp in (2, 4):
        for s in range(tp):
            qlo, qhi = q_head_range(cfg, tp, s)
            klo, khi = kv_head_range(cfg, tp, s)
            got = attend(q[:, :, qlo:qhi], _t(k[:, klo:khi]), v[:, klo:khi], causal[..., -1:, :], 0.125)
            assert torch.equal(got, ref[..., qlo * hd : qhi * hd]), (tp, s)
    assert default_differs  # SDPA's sums change with the padded key length


@pytest.mark.parametrize("hd", [64, 128])
def test_attention_over_keys_cut_to_key_step_is_bitwise_whole_chunks(
    hd: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Products cut to this CPU's ``key_step`` (the keys any row sees, rounded up) give every query row the
    bits of whole ``KEY_CHUNK`` chunks: rows seeing 1 to 300 keys, alone and in a batch whose longest row
    sees up to 300, decode rows and a prefill. Where no finer step holds (``KEY_CHUNK``), every candidate
    is shown to disagree. (torch's operations: the fixed-order kernel reads no further than ``seen``.)"""
    step = attn.key_step(hd, torch.float32)
    if step == row_rules.KEY_CHUNK:
        least = attn.query_rows(hd, torch.float32)
        assert not any(attn._cuts_agree(s, hd, torch.float32, least) for s in attn.KEY_STEPS)
        return
    gen = torch.Generator().manual_seed(hd)
    heads, kvh, length = 4, 2, 384
    k = torch.randn(5, kvh, length, hd, generator=gen)
    v = torch.randn(5, kvh, length, hd, generator=gen)
    for sees in ([1], [step + 1], [129, 5, 40], [250, 300, 2, 131, 7], [17, 16, 15, 128, 127]):
        rows = len(sees)
        q = torch.randn(rows, 1, heads, hd, generator=gen)
        mask = torch.arange(length)[None, None, None, :] < torch.tensor(sees)[:, None, None, None]
        seen = max(sees)
        cut = attn.attend(q, _t(k[:rows]), v[:rows], mask, 0.125, seen)
        with monkeypatch.context() as m:
            m.setattr(attn, "key_step", lambda *_: row_rules.KEY_CHUNK)
            whole = attn.attend(q, _t(k[:rows]), v[:rows], mask, 0.125, seen)
        assert torch.equal(cut, whole), sees
    causal = torch.tril(torch.ones(37, 37, dtype=torch.bool))[None, None]  # a prefill of 37 tokens
    q = torch.randn(1, 37, heads, hd, generator=gen)
    cut = attn.attend(q, _t(k[:1, :, :37]), v[:1, :, :37], causal, 0.125)
    with monkeypatch.context() as m:
        m.setattr(attn, "key_step", lambda *_: row_rules.KEY_CHUNK)
        assert torch.equal(cut, attn.attend(q, _t(k[:1, :, :37]), v[:1, :, :37], causal, 0.125))


@pytest.mark.parametrize("kernel", ["linear", NATIVE, DENSE, "partials", "rows", "scores", "values"])
@pytest.mark.parametrize("k", [64, 128, 576, 1536])
def test_least_rows_is_the_fewest_rows_that_agree(kernel: row_rules.Kernel, k: int) -> None:
    """Measured on this machine's BLAS: a row among ``least`` rows or more (first, middle, last; up to
    300) has one value, and among ``least - 1`` rows another (the rule is the smallest that holds). The
    fixed-order kernel's is 1 row, by construction."""
    least = row_rules.least_rows(kernel, k, torch.float32)
    assert kernel not in ("native", "dense") or least == 1
    gen = torch.Generator().manual_seed(k)
    probe = row_rules._probe(kernel, k, torch.float32, gen)
    row = torch.randn(k, generator=gen)

    def among(count: int, at: int) -> torch.Tensor:
        """The row's products in every variant of the call site (e.g. a chunk alone or among others)."""
        x = torch.randn(count, k, generator=gen)
        x[at] = row
        return torch.stack([out[at] for out in probe(x)])

    ref = among(least, 0)
    assert all(torch.equal(variant, ref[0]) for variant in ref)
    for count in sorted({least, least + 1, 2 * least + 3, 100, 300}):
        for at in (0, count // 2, count - 1):
            assert torch.equal(among(count, at), ref), (count, at)
    if least > 1:
        assert not (torch.equal(among(least - 1, 0), ref) and torch.equal(among(least - 1, least - 2), ref))


def test_chunk_kernel_takes_the_form_that_pads_to_fewer_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The row-parallel chunks' batched product takes the tokens as its columns where their rule is at most
    the rows' (one measured CPU's 2 against 9; a tie too, for the stacked product), else as its rows
    (another's 12 against 4); a form without a rule is not taken, and neither having one is refused."""
    rules: dict[str, int | None] = {}

    def least(kernel: str, k: int, dtype: torch.dtype) -> int:
        rule = rules[kernel]
        if rule is None:
            raise RuntimeError(f"no rule for {kernel}")
        return rule

    monkeypatch.setattr(row_rules, "least_rows", least)
    monkeypatch.setattr(fixed_order, "kernels", lambda: None)  # the MKL forms' choice, as on a CPU without it
    for columns, rows, want in ((2, 9, "partials"), (4, 4, "partials"), (12, 4, "rows"), (None, 12, "rows")):
        rules.update(partials=columns, rows=rows)
        assert row_parallel.chunk_kernel(192, torch.float32, copies=False) == want
    rules.update(partials=None, rows=None)
    with pytest.raises(RuntimeError, match=r"chunk products over K=192 .*run without --deterministic"):
        row_parallel.chunk_kernel(192, torch.float32, copies=False)


def test_chunk_kernel_takes_the_fixed_order_kernel_where_it_is_built_and_may_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fixed-order kernel is taken for float32 chunks where it is built here with its measured rule of 1
    row: over a packed copy where the decoder may hold one (it packs), else over the weight as it is;
    elsewhere the MKL forms' choice."""
    rules = {"native": 1, "dense": 1, "partials": 2, "rows": 9}
    monkeypatch.setattr(row_rules, "least_rows", lambda kernel, k, dtype: rules[kernel])
    built: list[object | None] = [object()]
    monkeypatch.setattr(fixed_order, "kernels", lambda: built[0])
    assert row_parallel.chunk_kernel(192, torch.float32) == "native"
    assert row_parallel.chunk_kernel(192, torch.float32, copies=False) == "dense"
    assert row_parallel.chunk_kernel(192, torch.float64) == "partials"
    rules["native"] = rules["dense"] = 2  # not what the kernel is built to do: not taken
    assert row_parallel.chunk_kernel(192, torch.float32) == "partials"
    assert row_parallel.chunk_kernel(192, torch.float32, copies=False) == "partials"
    rules["native"], rules["dense"], built[0] = 1, 1, None  # not built here
    assert row_parallel.chunk_kernel(192, torch.float32) == "partials"
    assert row_parallel.chunk_kernel(192, torch.float32, copies=False) == "partials"


def test_native_kernel_is_not_taken_where_it_does_not_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed build (a compiler error) is logged once and leaves the MKL kernels in charge, as a CPU
    without AVX-512 or AVX2 does."""
    from torch.utils import cpp_extension

    def fail(*_: object, **__: object) -> None:
        raise RuntimeError("Error building extension 'rollout_fixed_order'")

    monkeypatch.setattr(cpp_extension, "load", fail)
    monkeypatch.setattr(fixed_order, "machine_isa", lambda: "avx2")
    fixed_order.kernels.cache_clear()
    fixed_order.build.cache_clear()
    try:
        assert fixed_order.kernels() is None
        monkeypatch.setattr(fixed_order, "machine_isa", lambda: None)
        fixed_order.kernels.cache_clear()
        assert fixed_order.kernels() is None
    finally:
        fixed_order.kernels.cache_clear()
        fixed_order.build.cache_clear()


def _fixed(form: str, w: torch.Tensor, n: int) -> fixed_order.Packed | torch.Tensor:
    """w [out, n * width] as the fixed-order kernel's ``form`` reads it: packed in ``n`` chunks (a copy), or
    as it is, a view of a wider matrix (rows of another stride)."""
    if form == "native":
        return fixed_order.pack(w, n)
    wide = w.new_zeros(w.shape[0], w.shape[1] + 5)
    wide[:, 3 : 3 + w.shape[1]] = w
    return wide[:, 3 : 3 + w.shape[1]]


@BUILT
@pytest.mark.parametrize("form", ["native", "dense"])
@pytest.mark.parametrize(
    ("out", "k", "n"), [(576, 1536, 8), (576, 576, 9), (100, 192, 3), (17, 32, 2), (21, 200, 2)]
)
def test_native_partials_are_each_chunks_product_in_one_order_whatever_the_tokens(
    form: str, out: int, k: int, n: int
) -> None:
    """The fixed-order kernel in both forms against float64 (its error no worse than sgemm's bound), and
    bitwise: a token's chunk products alone, among 1-66 others at any position (every tile shape and tail),
    each chunk alone, and an output among fewer outputs (the tiles' tails) are the same; another order's
    differ. (On some CPUs MKL's sgemm of many rows computes the packed form's very bits: its kernel
    adds over K in the same order.)"""
    gen = torch.Generator().manual_seed(out + k)
    w, x = torch.randn(out, k, generator=gen), torch.randn(67, k, generator=gen)
    width = k // n
    every = fixed_order.partials(x, _fixed(form, w, n), n)
    exact = torch.stack(
        [
            x.double()[:, c * width : (c + 1) * width] @ w.double()[:, c * width : (c + 1) * width].T
            for c in range(n)
        ]
    )
    assert (every.double() - exact).abs().max() < 2e-6 * width
    weight = _fixed(form, w, n)
    for t in (1, 2, 3, 4, 5, 6, 7, 17, 63):
        for at in (0, 3, 67 - t):
            assert torch.equal(fixed_order.partials(x[at : at + t], weight, n), every[:, at : at + t]), (
                t,
                at,
            )
    for c in range(n):
        cols = slice(c * width, (c + 1) * width)
        alone = fixed_order.partials(x[:, cols].contiguous(), _fixed(form, w[:, cols].contiguous(), 1))[0]
        assert torch.equal(alone, every[c])
    for fewer in sorted({1, 3, 5, 15, 17, 63, 65, out - 1} & set(range(1, out))):
        assert torch.equal(fixed_order.partials(x, _fixed(form, w[:fewer], n), n), every[..., :fewer]), fewer
    rounded = (x[:, None, :width] * w[None, :, :width]).sum(-1)  # each product rounded, then torch's sum
    assert not torch.equal(rounded, every[0])  # another order gives other bits: the comparisons can fail


@pytest.mark.skipif(
    fixed_order.machine_isa() != "avx512" or fixed_order.kernels() is None,
    reason="needs a CPU that runs both builds",
)
def test_the_avx2_build_computes_the_avx512_builds_bits() -> None:
    """The kernel built for AVX2 (two 8-lane registers per vector) gives every product, packed and dense,
    and attention (a row that sees no key, scores far enough below the maximum that exp scales by 2^-126)
    the AVX-512 build's bits, so engines on either kind of CPU agree."""
    wide, narrow = fixed_order.build("avx512"), fixed_order.build("avx2")
    assert wide is not None and narrow is not None and (wide.isa, narrow.isa) == ("avx512", "avx2")
    gen = torch.Generator().manual_seed(7)
    for out, k, n in ((576, 1536, 8), (100, 192, 3), (21, 200, 2), (17, 32, 1)):
        w = torch.randn(out, k, generator=gen)
        for t in (1, 2, 3, 5, 64):
            x = torch.randn(t, k, generator=gen)
            packed_bits = [mod.partials(x, mod.pack(w, n), out) for mod in (wide, narrow)]
            assert torch.equal(*packed_bits), (out, k, n, t)
            assert torch.equal(wide.dense(x, w, n), narrow.dense(x, w, n)), (out, k, n, t)
    for hd, (bsz, seq, heads, kv, keys) in (
        (64, (3, 1, 9, 3, 251)),
        (128, (1, 37, 4, 2, 37)),
        (16, (2, 5, 2, 1, 17)),
    ):
        q = torch.randn(bsz, seq, heads, hd, generator=gen)
        kk, vv = (torch.randn(bsz, kv, keys + 3, hd, generator=gen) for _ in range(2))
        sees = torch.rand(bsz, seq, keys + 3, generator=gen) > 0.3
        sees[0, 0] = False  # a row that sees no key: zeros
        mask = sees.view(torch.uint8)
        for scale in (0.125, 5.0):
            got = [mod.attend(q, kk, vv, mask, scale, keys) for mod in (wide, narrow)]
            assert torch.equal(*got), (hd, scale)
            assert not got[0][0, 0].any()


def test_least_rows_finds_a_kernels_rule_or_says_it_has_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """On made-up kernels: one that rounds a row another way below 5 rows gets 5; one whose two variants
    (say, a chunk alone and among others) agree only from 2 rows gets 2; one whose row changes with every
    row count is refused with an error naming it."""

    def below_five(x: torch.Tensor) -> list[torch.Tensor]:
        return [x * 3 if x.shape[0] < 5 else x * 2]

    def variants(x: torch.Tensor) -> list[torch.Tensor]:
        return [x * 2, x * 2 if x.shape[0] > 1 else x * 3]

    def every_count(x: torch.Tensor) -> list[torch.Tensor]:
        return [x * x.shape[0]]

    for product, want in ((below_five, 5), (variants, 2), (every_count, None)):
        monkeypatch.setattr(row_rules, "_probe", lambda *_, p=product: p)
        row_rules.least_rows.cache_clear()
        if want is None:
            with pytest.raises(RuntimeError, match=r"linear product over K=8 .*every row count up to 256"):
                row_rules.least_rows("linear", 8, torch.float32)
        else:
            assert row_rules.least_rows("linear", 8, torch.float32) == want
    row_rules.least_rows.cache_clear()


def test_cuda_row_blocks_are_fixed_and_reassembled_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA every product has exactly ``CUDA_ROWS`` rows per block (one cuBLAS kernel whatever the
    batch; measured on a GPU in test_gpu.py). The padding rule, and the blocks' reassembly run here on CPU
    (the split forced): each row's result is the unblocked product's, in order, for 1 to 3 blocks."""
    assert [row_rules.padded_rows(n, True, 0) for n in (1, 127, 128, 129, 300)] == [128, 128, 128, 256, 384]
    assert [row_rules.padded_rows(n, False, 4) for n in (1, 3, 4, 63)] == [4, 4, 4, 63]
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(24, 64, generator=gen, dtype=torch.float64)
    chunks = chunking.Chunks(16, (4,), 0)
    monkeypatch.setattr(row_rules, "row_blocks", lambda flat: flat.split(8))
    for rows in (1, 8, 9, 20):
        x = torch.randn(rows, 64, generator=gen, dtype=torch.float64)
        assert torch.allclose(row_rules.linear(x, w), F.linear(x, w), rtol=0, atol=1e-12)
        parts = row_parallel.partials(x, row_parallel.ChunkedWeight(w, "rows"), chunks)
        assert parts.shape == (4, rows, 24)
        assert torch.allclose(parts.sum(0), F.linear(x, w), rtol=0, atol=1e-12)
