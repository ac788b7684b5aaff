"""The decoder (Llama 3.x, Qwen2, Qwen3) as plain functions over a dict of (sharded) tensors.

Attention is written out explicitly and shared by prefill and decode: both write K/V into the paged pool at
the tokens' slots and attend over the keys gathered from the pool, with a causal mask. The only TP code is
two all-reduces per layer (after o_proj and down_proj; with the deterministic kernels of
:mod:`~rollout_worker.engine.kernels.deterministic`, all-gathers of fixed chunks' partial products added in
one fixed
order) and one all-gather of the vocab-parallel logits. A
shard's width (its query and KV heads) comes from :mod:`~rollout_worker.engine.model.sharding`: whole heads,
unevenly when the head counts do not divide TP, so each rank runs plain grouped-query attention over its
own heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from rollout_worker.config.model_config import ModelConfig
from rollout_worker.engine.kernels import deterministic as invariant
from rollout_worker.engine.kernels import fixed_order as native
from rollout_worker.engine.kernels import packed_linear as packed
from rollout_worker.engine.model.kv_cache import GatheredKV, KVPool, gather_slots
from rollout_worker.engine.model.parallel import ParallelState
from rollout_worker.engine.model.sharding import kv_head_range, q_head_range


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies as Hugging Face computes them (float32), with llama3 / linear scaling."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    sc = cfg.rope_scaling
    kind = None if sc is None else sc.get("rope_type", sc.get("type"))
    if sc is not None and kind == "linear":
        inv = inv / float(sc["factor"])
    elif sc is not None and kind == "llama3":
        factor, lo_f, hi_f = float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old = float(sc["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo_f, inv / factor, inv)
        smooth = (old / wavelen - lo_f) / (hi_f - lo_f)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi_f) & ~(wavelen > old / lo_f)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def _mean_last(x: torch.Tensor) -> torch.Tensor:
    return x.mean(-1, keepdim=True)


class Linear(Protocol):
    """A product as ``F.linear`` takes it: (x, w, b=None), w as the decoder prepared it (:data:`Weight`)."""

    def __call__(self, x: torch.Tensor, w: Any, b: torch.Tensor | None = None, /) -> torch.Tensor: ...


# a column-parallel or replicated weight: dense, packed for oneDNN, or for the fixed-order kernel
Weight = torch.Tensor | native.Packed
RowWeight = torch.Tensor | invariant.ChunkedWeight  # a row-parallel weight (chunked: deterministic)


@dataclass(slots=True)
class Layer:
    ln1: torch.Tensor
    wq: Weight
    wk: Weight
    wv: Weight
    bq: torch.Tensor | None
    bk: torch.Tensor | None
    bv: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    wo: RowWeight
    ln2: torch.Tensor
    w_gate: Weight
    w_up: Weight
    w_down: RowWeight


class Decoder:
    """Forward passes of one TP shard. Rebuilt (cheaply) whenever the weights or the layout change."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        ps: ParallelState,
        chunks: invariant.RowChunks | None = None,
        pack: bool = True,
    ) -> None:
        """``chunks``: the deterministic kernels (:mod:`~rollout_worker.engine.kernels.deterministic`) with
        these
        row-parallel chunks; None: the BLAS's and the backend's own orders. ``pack``: float32 products on
        CPU run on weights packed once for oneDNN (:mod:`~rollout_worker.engine.kernels.packed_linear`), or
        with the
        deterministic kernels for the fixed-order kernel where this machine has it
        (:func:`~rollout_worker.engine.kernels.deterministic.native_rule`); not packing, the deterministic
        kernels
        run the fixed-order kernel over the weights as they are."""
        self.cfg, self.ps = cfg, ps
        embed = weights["model.embed_tokens.weight"]
        self.packed = pack and packed.packs(embed)
        self.native = (
            bool(chunks)
            and not embed.is_cuda
            and invariant.native_rule(cfg.hidden_size, embed.dtype, self.packed)
        )
        # the deterministic kernels' attention: on the fixed-order kernel (which reads the keys as they are,
        # and no further than any row sees), else on torch's operations (on CPU over transposed keys)
        self.native_attention = bool(chunks) and invariant.native_attention(
            cfg.head_dim, embed.dtype, embed.is_cuda
        )
        self.keys_t = bool(chunks) and not embed.is_cuda and not self.native_attention
        kernels: tuple[Linear, Linear] = (
            (invariant.packed_linear, invariant.linear) if chunks else (packed.linear, F.linear)
        )
        self.linear: Linear = native.linear if self.native else kernels[0] if self.packed else kernels[1]
        self.mean_last = invariant.mean_last if chunks else _mean_last
        self.o_chunks = self.down_chunks = None
        if chunks:
            self.o_chunks = invariant.Chunks.of(chunks.attn_out, invariant.attn_shards(cfg, ps.tp), ps.shard)
            self.down_chunks = invariant.Chunks.of(
                chunks.mlp_down, invariant.mlp_shards(cfg, ps.tp), ps.shard
            )
            if not embed.is_cuda:  # each product's row rule, before the first forward needs it
                widths = (self.o_chunks.width, self.down_chunks.width)
                invariant.measure_rules(cfg, embed.dtype, self.packed, widths)
        q_lo, q_hi = q_head_range(cfg, ps.tp, ps.shard)  # shards may differ in width (uneven heads)
        kv_lo, kv_hi = kv_head_range(cfg, ps.tp, ps.shard)
        self.heads, self.kv_heads = q_hi - q_lo, kv_hi - kv_lo
        self.embed = embed
        self.norm = weights["model.norm.weight"]
        self.lm_head: Weight = self._product(weights["lm_head.weight"])
        self.layers: list[Layer] = [self._layer(weights, i) for i in range(cfg.num_layers)]
        dev = self.embed.device
        self.inv_freq = rope_inv_freq(cfg).to(dev)
        self.dtype = self.embed.dtype
        self.norm_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32

    def release(self) -> None:
        """Drop every reference to the weights (their memory is freed once the rank drops its dict)."""
        self.layers = []
        self.embed = self.norm = self.lm_head = torch.empty(0, device=self.embed.device)

    def _product(self, w: torch.Tensor) -> Weight:
        """A projection's weight as :attr:`linear` reads it (packed: a copy in oneDNN's layout, or in the
        fixed-order kernel's; else as it is)."""
        if self.packed:
            return native.pack(w) if self.native else packed.pack(w)
        return w

    def _row_product(self, w: torch.Tensor, chunks: invariant.Chunks | None) -> RowWeight:
        """A row-parallel projection's weight as :meth:`_row_parallel` reads it (with the deterministic
        kernels, in chunks as :func:`~rollout_worker.engine.kernels.deterministic.chunk_kernel` chooses: a
        copy in the
        fixed-order kernel's layout only where the decoder packs its weights)."""
        if chunks is None:  # the default kernels (never the fixed-order one)
            return packed.pack(w) if self.packed else w
        return invariant.row_weight(w, chunks, copies=self.packed)

    def _layer(self, w: dict[str, torch.Tensor], i: int) -> Layer:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        product = self._product
        return Layer(
            ln1=w[p + "input_layernorm.weight"],
            wq=product(w[a + "q_proj.weight"]),
            wk=product(w[a + "k_proj.weight"]),
            wv=product(w[a + "v_proj.weight"]),
            bq=w.get(a + "q_proj.bias"),
            bk=w.get(a + "k_proj.bias"),
            bv=w.get(a + "v_proj.bias"),
            q_norm=w.get(a + "q_norm.weight"),
            k_norm=w.get(a + "k_norm.weight"),
            wo=self._row_product(w[a + "o_proj.weight"], self.o_chunks),
            ln2=w[p + "post_attention_layernorm.weight"],
            w_gate=product(w[p + "mlp.gate_proj.weight"]),
            w_up=product(w[p + "mlp.up_proj.weight"]),
            w_down=self._row_product(w[p + "mlp.down_proj.weight"], self.down_chunks),
        )

    def rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x.to(self.norm_dtype)
        h = h * torch.rsqrt(self.mean_last(h.pow(2)) + self.cfg.rms_norm_eps)
        return w * h.to(x.dtype)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq  # [B, S, hd/2], float32 as in HF
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype)[:, :, None], emb.sin().to(self.dtype)[:, :, None]

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin

    def step_logits(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        pool: KVPool,
        write: torch.Tensor,
        keys: int,
        gathered: GatheredKV | None = None,
    ) -> torch.Tensor:
        """One decode step: logits [B, vocab] of tokens [B, 1] at positions [B, 1] (row b: row b of the
        pool's token table), K/V written at token slots ``write`` [B, 1], attending over the first ``keys``
        positions of each row (through ``gathered`` when given). No host synchronisation: a CUDA graph
        captures it."""
        read = pool.table[: tokens.shape[0], :keys]
        return self.logits(self.hidden(tokens, positions, pool, write, read, gathered)[:, 0])

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [N, vocab] of hidden states [N, hidden] (one all-gather under TP)."""
        return self.ps.all_gather_cat(self.linear(self.rms(x, self.norm), self.lm_head), dim=-1)

    def hidden(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        pool: KVPool,
        write: torch.Tensor,
        read: torch.Tensor,
        gathered: GatheredKV | None = None,
    ) -> torch.Tensor:
        """Final hidden states [B, S, hidden].

        tokens, positions: [B, S] (right-padded rows; padding is written past the row's length and is
        never attended to by its real tokens). ``write`` [B, S]: the pool's token slot of each input
        token's K/V; ``read`` [B, L]: the token slots of each row's positions 0..L-1 (masked by position),
        gathered from the pool into the step's batch. The pool must already hold every slot. ``gathered``
        (a decode step, S = 1): the keys and values come from it, kept from the last step, instead.
        """
        bsz, seq = tokens.shape
        cos, sin = self.rope(positions)
        seen = read.shape[1]  # keys any query sees (the padding past them is masked)
        whole_chunks = self.o_chunks is not None and not self.native_attention  # torch ops read whole chunks
        if whole_chunks and seen < invariant.key_span(seen):
            read = F.pad(read, (0, invariant.key_span(seen) - seen))  # slot 0: masked
        key_pos = torch.arange(read.shape[1], device=tokens.device)
        mask = (key_pos[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, S, L]: keys a query sees
        hd = self.cfg.head_dim
        scale = 1.0 / math.sqrt(hd)
        x = F.embedding(tokens, self.embed)
        # a CUDA decode step (default kernels) gathers its keys KV-head-major, as its products read them
        kv_major = gathered is None and seq == 1 and self.o_chunks is None and tokens.is_cuda
        if gathered is not None:
            gathered.begin(pool, read, positions[:, 0], keys_t=self.keys_t)
        else:
            pool.version += 1  # writes that no GatheredKV mirrors
        for i, lw in enumerate(self.layers):
            h = self.rms(x, lw.ln1)
            q = self.linear(h, lw.wq, lw.bq).view(bsz, seq, self.heads, hd)
            k = self.linear(h, lw.wk, lw.bk).view(bsz, seq, self.kv_heads, hd)
            v = self.linear(h, lw.wv, lw.bv).view(bsz, seq, self.kv_heads, hd)
            if lw.q_norm is not None and lw.k_norm is not None:
                q, k = self.rms(q, lw.q_norm), self.rms(k, lw.k_norm)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            pool.k[i][write] = k
            pool.v[i][write] = v
            if gathered is not None:
                attn = self._attend(q, *gathered.layer(i, pool, read, (k, v)), mask, scale, seen)
            elif kv_major:  # [KVh, B, L, hd]: one gather from the request's pages into the products' layout
                k_all, v_all = gather_slots(pool.k[i], read, True), gather_slots(pool.v[i], read, True)
                attn = attend_kv_major(q, k_all, v_all, mask, scale)
            else:  # [B, KVh, L, hd], gathered from the request's pages
                k_all, v_all = gather_slots(pool.k[i], read), gather_slots(pool.v[i], read)
                attn = self._attend(q, self._keys(k_all), v_all.transpose(1, 2), mask, scale, seen)
            x = x + self._row_parallel(attn, lw.wo, self.o_chunks)
            h = self.rms(x, lw.ln2)
            act = F.silu(self.linear(h, lw.w_gate)) * self.linear(h, lw.w_up)
            x = x + self._row_parallel(act, lw.w_down, self.down_chunks)
        if gathered is not None:
            gathered.end(pool, read)
        return x

    def _row_parallel(self, x: torch.Tensor, w: RowWeight, chunks: invariant.Chunks | None) -> torch.Tensor:
        """The full product of a row-parallel projection: summed by the backend's all-reduce, or (the
        deterministic kernels) its fixed chunks' partials added in one fixed tree, each shard's whole
        subtrees before the all-gather (SmolLM2's 9 attention chunks at TP 2: 2 + 3 sums, not 5 + 4)."""
        if chunks is None:
            assert isinstance(w, torch.Tensor)  # only the deterministic kernels keep a weight in chunks
            return self.ps.all_reduce(self.linear(x, w))
        assert isinstance(w, invariant.ChunkedWeight)
        parts = invariant.partials(x, w, chunks)
        if self.ps.tp == 1:
            return invariant.tree_sum(parts)
        mine = invariant.shard_sums(parts, chunks)  # each shard adds its whole subtrees of the tree first
        everyone = self.ps.all_gather_cat(mine, dim=0).split(mine.shape[0])
        return invariant.gathered_sum(list(everyone), chunks)

    def _keys(self, gathered: torch.Tensor) -> torch.Tensor:
        """Keys gathered from the pool [B, L, KVh, hd] as :meth:`_attend` takes them, [B, KVh, L, hd]: with
        the deterministic kernels on CPU's torch operations (:attr:`keys_t`) a transposed view of each KV
        head's [hd, L] row-major (as :class:`GatheredKV` keeps them there: one layout, one kernel; MKL's
        3-row product with a transposed operand took about 3x longer). The fixed-order kernel reads them as
        they are, and so does :class:`GatheredKV`, whose writes of a step's keys are then contiguous (into
        the transposed layout, one scattered element per head dimension)."""
        if not self.keys_t:
            return gathered.transpose(1, 2)
        return gathered.permute(0, 2, 3, 1).contiguous().transpose(2, 3)

    def _attend(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        vals: torch.Tensor,
        mask: torch.Tensor,
        scale: float,
        seen: int | None = None,
    ) -> torch.Tensor:
        """Attention of q [B, S, H, hd] over keys/vals [B, KVh, L, hd] (the keys as :meth:`_keys` lays them
        out) under mask [B, 1, S, L]: [B, S, H*hd]. ``seen``: the keys any query sees (the deterministic
        kernels read no further, rounded up to their key step; L may be padded past them).

        Each head is computed on its own, so TP (which splits heads) changes nothing. (A CUDA decode step
        with the default kernels goes through :func:`attend_kv_major` instead.)
        """
        if self.o_chunks is not None:
            return invariant.attend(q, keys.transpose(-1, -2), vals, mask, scale, seen)
        bsz, seq = q.shape[0], q.shape[1]
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, vals, attn_mask=mask, scale=scale, enable_gqa=True
        )  # [B, H, S, hd]
        return attn.transpose(1, 2).reshape(bsz, seq, self.heads * q.shape[-1])


def attend_kv_major(
    q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """One decode step's attention (the default kernels on CUDA): q [B, 1, H, hd] over keys/vals
    [KVh, B, L, hd] (gathered KV-head-major) under mask [B, 1, 1, L]: [B, 1, H * hd].

    The query heads of each KV head form one matrix (head ``h`` uses KV head ``h // (H // KVh)``), so the
    scores and the weighted values are two batched products that read the gathered keys in place. SDPA with
    a mask falls back to its math kernel here, which first copies K and V once per query head
    (``enable_gqa``); and keys gathered ``[B, L, KVh, hd]`` would be copied once more into a product's layout.
    """
    kvh, bsz, length, hd = keys.shape
    heads = q.shape[2]
    qg = q.view(bsz, kvh, heads // kvh, hd).transpose(0, 1)  # [KVh, B, G, hd]
    scores = torch.matmul(qg * scale, keys.transpose(-1, -2))  # [KVh, B, G, L]
    scores = scores.masked_fill(~mask.view(1, bsz, 1, length), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(vals.dtype, torch.float32)).to(vals.dtype)
    return torch.matmul(probs, vals).transpose(0, 1).reshape(bsz, 1, heads * hd)  # [B, KVh, G, hd] flat
