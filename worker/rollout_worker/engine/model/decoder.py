"""The decoder (Llama 3.x, Qwen2, Qwen3) as plain functions over a dict of (sharded) tensors.

Attention is written out explicitly and shared by prefill and decode: both write K/V into the paged pool at
the tokens' slots and attend over the keys gathered from the pool, with a causal mask. The only TP code is
two all-reduces per layer (after o_proj and down_proj; with the deterministic kernels, all-gathers of
fixed chunks' partial products added in one fixed order) and one all-gather of the vocab-parallel logits.
Which kernel runs each product, the attention and RMSNorm's mean is the decoder's
:class:`~rollout_worker.engine.kernels.choice.Kernels`, chosen once before it is built. A shard's width
(its query and KV heads) comes from :mod:`~rollout_worker.engine.model.sharding`: whole heads, unevenly
when the head counts do not divide TP, so each rank runs plain grouped-query attention over its own heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rollout_worker.config.model_config import ModelConfig
from rollout_worker.engine.kernels.choice import Kernels, RowProjection, RowWeight, Weight
from rollout_worker.engine.kernels.row_chunks import Chunks, attn_shards, mlp_shards
from rollout_worker.engine.kernels.row_parallel import ChunkedWeight, chunked_product
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
        kernels: Kernels | None = None,
    ) -> None:
        """``kernels``: the products, attention and mean this decoder runs
        (:meth:`~rollout_worker.engine.kernels.choice.Kernels.choose`, for the weights' dtype and device);
        None: the default kernels, weights packed where that helps."""
        self.cfg, self.ps = cfg, ps
        embed = weights["model.embed_tokens.weight"]
        self.kernels = kernels or Kernels.of(cfg, embed.dtype, embed.device)
        if (self.kernels.dtype, self.kernels.device) != (embed.dtype, embed.device.type):
            raise ValueError(
                f"kernels chosen for {self.kernels.dtype} on {self.kernels.device}, weights in {embed.dtype} "
                f"on {embed.device.type}"
            )
        self.linear = self.kernels.product()
        self.attend = self.kernels.attention_entry()
        self.paged_decode = self.kernels.paged_decode_entry()
        self.mean_last = self.kernels.mean_last()
        self.o_chunks: Chunks | None = None
        self.down_chunks: Chunks | None = None
        fixed = self.kernels.chunks
        if fixed is not None:  # this shard's fixed chunks of the row-parallel products
            self.o_chunks = Chunks.of(fixed.bounds.attn_out, attn_shards(cfg, ps.tp), ps.shard)
            self.down_chunks = Chunks.of(fixed.bounds.mlp_down, mlp_shards(cfg, ps.tp), ps.shard)
        q_lo, q_hi = q_head_range(cfg, ps.tp, ps.shard)  # shards may differ in width (uneven heads)
        kv_lo, kv_hi = kv_head_range(cfg, ps.tp, ps.shard)
        self.heads, self.kv_heads = q_hi - q_lo, kv_hi - kv_lo
        self.embed = embed
        self.norm = weights["model.norm.weight"]
        self.lm_head: Weight = self.kernels.weight(weights["lm_head.weight"])
        self.layers: list[Layer] = [self._layer(weights, i) for i in range(cfg.num_layers)]
        dev = self.embed.device
        self.inv_freq = rope_inv_freq(cfg).to(dev)
        self.dtype = self.embed.dtype
        self.norm_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32

    def release(self) -> None:
        """Drop every reference to the weights (their memory is freed once the rank drops its dict)."""
        self.layers = []
        self.embed = self.norm = self.lm_head = torch.empty(0, device=self.embed.device)

    def _row_product(self, w: torch.Tensor, projection: RowProjection) -> RowWeight:
        chunks = self.o_chunks if projection == "attn_out" else self.down_chunks
        return self.kernels.row_weight(w, chunks, projection)

    def _layer(self, w: dict[str, torch.Tensor], i: int) -> Layer:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        product = self.kernels.weight
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
            wo=self._row_product(w[a + "o_proj.weight"], "attn_out"),
            ln2=w[p + "post_attention_layernorm.weight"],
            w_gate=product(w[p + "mlp.gate_proj.weight"]),
            w_up=product(w[p + "mlp.up_proj.weight"]),
            w_down=self._row_product(w[p + "mlp.down_proj.weight"], "mlp_down"),
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
        span = self.kernels.read_keys(seen)
        if seen < span:  # the attention reads whole key chunks
            read = F.pad(read, (0, span - seen))  # slot 0: masked
        key_pos = torch.arange(read.shape[1], device=tokens.device)
        mask = (key_pos[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, S, L]: keys a query sees
        hd = self.cfg.head_dim
        scale = 1.0 / math.sqrt(hd)
        x = F.embedding(tokens, self.embed)
        # a CUDA decode step (default kernels) reads the pages in place, or gathers its keys KV-head-major
        # as its products read them
        paged = self.paged_decode if seq == 1 else None
        lengths = positions[:, 0]  # with the paged kernel: a decode step's keys per row
        kv_major = gathered is None and self.kernels.kv_major(seq)
        if paged is not None:
            lengths = (lengths + 1).to(torch.int32)
            gathered = None  # nothing to keep: the kernel reads the pool
        if gathered is not None:
            gathered.begin(pool, read, positions[:, 0], self.kernels)
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
            if paged is not None:  # the pages read in place
                attn = paged(q[:, 0], pool.k[i], pool.v[i], read, lengths, scale).view(bsz, 1, -1)
            else:
                if gathered is not None:
                    keys, vals = gathered.layer(i, pool, read, (k, v))
                elif kv_major:  # [KVh, B, L, hd]: one gather from the pages into the products' layout
                    keys = gather_slots(pool.k[i], read, True).transpose(0, 1)
                    vals = gather_slots(pool.v[i], read, True).transpose(0, 1)
                else:  # [B, KVh, L, hd], gathered from the request's pages
                    keys = self.kernels.keys_of(gather_slots(pool.k[i], read))
                    vals = gather_slots(pool.v[i], read).transpose(1, 2)
                attn = self.attend(q, keys, vals, mask, scale, seen)
            x = x + self._row_parallel(attn, lw.wo, self.o_chunks)
            h = self.rms(x, lw.ln2)
            act = F.silu(self.linear(h, lw.w_gate)) * self.linear(h, lw.w_up)
            x = x + self._row_parallel(act, lw.w_down, self.down_chunks)
        if gathered is not None:
            gathered.end(pool, read)
        return x

    def _row_parallel(self, x: torch.Tensor, w: RowWeight, chunks: Chunks | None) -> torch.Tensor:
        """The full product of a row-parallel projection: summed by the backend's all-reduce, or (the
        deterministic kernels) its fixed chunks' partials added in one fixed tree
        (:func:`~rollout_worker.engine.kernels.row_parallel.chunked_product`)."""
        if chunks is None:
            assert isinstance(w, torch.Tensor)  # only the deterministic kernels keep a weight in chunks
            return self.ps.all_reduce(self.linear(x, w))
        assert isinstance(w, ChunkedWeight)
        return chunked_product(x, w, chunks, self.ps)
