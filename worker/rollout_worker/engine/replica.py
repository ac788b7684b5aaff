"""One replica as seen by each of its ranks: continuous batching over a KV slab.

Every rank of a replica holds identical scheduler state and samples identically (full logits are
all-gathered), so the ranks stay in lockstep without exchanging tokens.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import torch

from rollout_worker.engine.kvcache import KVSlab
from rollout_worker.engine.model import Decoder
from rollout_worker.engine.sampling import sample
from rollout_worker.engine.sequence import Sequence


class Replica:
    def __init__(
        self,
        decoder: Decoder,
        slab: KVSlab,
        max_batch: int,
        kv_budget: int | None,
        max_prefill_tokens: int,
        eos_ids: tuple[int, ...],
        on_finish: Callable[[Sequence], None],
    ) -> None:
        self.decoder, self.slab = decoder, slab
        self.max_batch, self.kv_budget, self.max_prefill_tokens = max_batch, kv_budget, max_prefill_tokens
        self.eos_ids = eos_ids
        self.on_finish = on_finish
        self.running: list[Sequence] = []  # running[i] occupies slab slot i
        self.waiting: deque[Sequence] = deque()
        self.prefill_tokens_per_ms: float | None = None  # last measured prefill throughput

    @property
    def unfinished(self) -> int:
        return len(self.running) + len(self.waiting)

    def _reserved(self) -> int:
        return sum(s.reserved_tokens for s in self.running)

    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        reserved, tokens = self._reserved(), 0
        while self.waiting and len(self.running) + len(admitted) < self.max_batch:
            seq = self.waiting[0]
            need = len(seq.spec.prompt_ids) + len(seq.output)
            if self.kv_budget is not None and reserved + seq.reserved_tokens > self.kv_budget:
                break
            if admitted and tokens + need > self.max_prefill_tokens:
                break
            admitted.append(self.waiting.popleft())
            reserved += seq.reserved_tokens
            tokens += need
        return admitted

    def step(self) -> str:
        """Prefill newly admitted requests if any fit, else decode every running request."""
        admitted = self._admit()
        if admitted:
            self.prefill(admitted, sample_fresh=True)
            return "prefill"
        if self.running:
            self.decode()
            return "decode"
        return "idle"

    def prefill(self, seqs: list[Sequence], sample_fresh: bool) -> None:
        """Append ``seqs`` to the running batch and build their KV cache in one padded forward pass.

        A fresh request (no output yet) is prefilled over its prompt and samples its first token; a
        resumed one is prefilled over prompt + output[:-1] (its cache after ``len(output)`` steps) and
        continues decoding from its last token.
        """
        slot0 = len(self.running)
        rows = [
            list(s.spec.prompt_ids) + s.output[:-1] if s.output else list(s.spec.prompt_ids) for s in seqs
        ]
        width = max(len(r) for r in rows)
        dev = self.decoder.embed.device
        tokens = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = torch.tensor(r)
        positions = torch.arange(width).expand(len(rows), width)
        last = torch.tensor([len(r) - 1 for r in rows])
        self.running.extend(seqs)
        t0 = time.perf_counter()
        logits = self.decoder.forward(tokens.to(dev), positions.to(dev), self.slab, last.to(dev), slot0=slot0)
        ms = (time.perf_counter() - t0) * 1e3
        self.prefill_tokens_per_ms = sum(len(r) for r in rows) / max(ms, 1e-3)
        fresh = [i for i, s in enumerate(seqs) if not s.output] if sample_fresh else []
        if fresh:
            toks = sample(logits[fresh], [seqs[i].spec.sampling for i in fresh], [0] * len(fresh))
            self._append([seqs[i] for i in fresh], toks)

    def decode(self) -> None:
        dev = self.decoder.embed.device
        tokens = torch.tensor([[s.output[-1]] for s in self.running], device=dev)
        positions = torch.tensor([[s.kv_len] for s in self.running], device=dev)
        last = torch.zeros(len(self.running), dtype=torch.long, device=dev)
        logits = self.decoder.forward(tokens, positions, self.slab, last)
        toks = sample(logits, [s.spec.sampling for s in self.running], [len(s.output) for s in self.running])
        self._append(list(self.running), toks)

    def _append(self, seqs: list[Sequence], toks: list[int]) -> None:
        done = []
        for seq, tok in zip(seqs, toks, strict=True):
            seq.output.append(tok)
            if (not seq.spec.ignore_eos and tok in self.eos_ids) or tok in seq.spec.stop_token_ids:
                seq.finish = {"type": "stop", "matched": tok}
            elif len(seq.output) >= seq.spec.max_new_tokens:
                seq.finish = {"type": "length", "length": len(seq.output)}
            if seq.finish is not None:
                done.append(seq)
        for seq in done:
            self._release(seq)
            self.on_finish(seq)

    def _release(self, seq: Sequence) -> None:
        """Free the request's slot; the last running request moves into it (slots stay compact)."""
        slot = next(i for i, s in enumerate(self.running) if s is seq)
        last = len(self.running) - 1
        if slot != last:
            self.slab.move(last, slot, self.running[last].kv_len)
            self.running[slot] = self.running[last]
        self.running.pop()
