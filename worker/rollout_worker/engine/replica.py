"""One replica as seen by each of its ranks: continuous batching over a KV slab.

Every rank of a replica holds identical scheduler state and samples identically (full logits are
all-gathered), so the ranks stay in lockstep without exchanging tokens. A step either prefills newly
admitted requests (when any fit) or decodes every running request.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from rollout_worker.engine.cudagraph import DecodeGraphs, key_span
from rollout_worker.engine.finish import Finish, FinishLength, FinishStop
from rollout_worker.engine.kvcache import KVSlab
from rollout_worker.engine.messages import PromptLogprobs
from rollout_worker.engine.model import Decoder
from rollout_worker.engine.sampling import Draw, prompt_logprobs, sample
from rollout_worker.engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class Limits:
    max_batch: int
    kv_budget: int | None  # reserved (prompt + max_new) tokens per replica
    max_prefill_tokens: int


@dataclass(slots=True)
class StepOutput:
    kind: str  # prefill | decode | idle
    admitted: list[str] = field(default_factory=list)
    draws: list[tuple[Sequence, Draw]] = field(default_factory=list)
    finished: list[tuple[str, Finish]] = field(default_factory=list)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)


class Replica:
    def __init__(
        self,
        decoder: Decoder,
        slab: KVSlab,
        limits: Limits,
        eos_ids: tuple[int, ...],
        graphs: DecodeGraphs | None = None,
    ) -> None:
        self.slab, self.limits, self.eos_ids = slab, limits, eos_ids
        self.graphs = graphs  # decode steps replayed from CUDA graphs (None: eager)
        self._decoder = decoder
        self.running: list[Sequence] = []  # running[i] occupies slab slot i
        self.waiting: deque[Sequence] = deque()
        self.prefill_tokens_per_ms: float | None = None  # last measured prefill throughput

    @property
    def decoder(self) -> Decoder:
        return self._decoder

    @decoder.setter
    def decoder(self, decoder: Decoder) -> None:
        """New weights (a weight load): graphs captured over the old ones are dropped."""
        self._decoder = decoder
        if self.graphs is not None:
            self.graphs.clear()

    def release_kv(self) -> None:
        """Free the KV cache's memory (and the graphs that address it)."""
        if self.graphs is not None:
            self.graphs.clear()
        self.slab.release()

    def release_weights(self) -> None:
        """Drop the decoder's references to the weights (and the graphs that address them)."""
        if self.graphs is not None:
            self.graphs.clear()
        self._decoder.release()

    @property
    def unfinished(self) -> int:
        return len(self.running) + len(self.waiting)

    @property
    def kv_tokens(self) -> int:
        return sum(s.kv_len for s in self.running)

    # -- membership ----------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort(self, rids: tuple[str, ...] | None, finish: Finish) -> list[tuple[str, Finish]]:
        """Remove the named requests (all when None) wherever they are; returns their finish reasons."""
        gone: list[tuple[str, Finish]] = []
        for seq in [s for s in self.running if rids is None or s.spec.id in rids]:
            self._release(seq)
            gone.append((seq.spec.id, finish))
        kept = deque(s for s in self.waiting if not (rids is None or s.spec.id in rids))
        gone += [(s.spec.id, finish) for s in self.waiting if rids is None or s.spec.id in rids]
        self.waiting = kept
        return gone

    def retract(self) -> list[str]:
        """Running requests go back to the front of the queue, their KV dropped (re-prefilled later)."""
        back = list(self.running)
        self.running.clear()
        self.waiting.extendleft(reversed(back))
        return [s.spec.id for s in back]

    # -- stepping ------------------------------------------------------------------------------------
    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        lim = self.limits
        reserved, tokens = sum(s.reserved_tokens for s in self.running), 0
        while self.waiting and len(self.running) + len(admitted) < lim.max_batch:
            seq = self.waiting[0]
            need = len(seq.spec.prompt_ids) + len(seq.output)
            if lim.kv_budget is not None and reserved + seq.reserved_tokens > lim.kv_budget:
                break
            if admitted and tokens + need > lim.max_prefill_tokens:
                break
            admitted.append(self.waiting.popleft())
            reserved += seq.reserved_tokens
            tokens += need
        return admitted

    def step(self) -> StepOutput:
        """Prefill newly admitted requests if any fit, else decode every running request."""
        admitted = self._admit()
        if admitted:
            out = self.prefill(admitted, sample_fresh=True)
            out.admitted = [s.spec.id for s in admitted]
            return out
        if self.running:
            return self.decode()
        return StepOutput("idle")

    def prefill(self, seqs: list[Sequence], sample_fresh: bool) -> StepOutput:
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
        self.slab.ensure(slot0 + len(rows), width + 1)
        dev = self.decoder.embed.device
        tokens = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = torch.tensor(r)
        positions = torch.arange(width).expand(len(rows), width)
        self.running.extend(seqs)
        t0 = time.perf_counter()
        x = self.decoder.hidden(tokens.to(dev), positions.to(dev), self.slab, slot0=slot0)
        last = torch.tensor([len(r) - 1 for r in rows], device=dev)
        logits = self.decoder.logits(x[torch.arange(len(rows), device=dev), last])
        out = StepOutput("prefill")
        fresh = [s for s in seqs if not s.output] if sample_fresh else []
        if fresh:
            out.prompt_logprobs = self._prompt_logprobs(x, seqs, fresh)
        self.prefill_tokens_per_ms = sum(len(r) for r in rows) / max((time.perf_counter() - t0) * 1e3, 1e-3)
        only_prefill = [s for s in fresh if s.spec.max_new_tokens == 0]
        sampled = [(i, s) for i, s in enumerate(seqs) if s in fresh and s.spec.max_new_tokens > 0]
        if sampled:
            draws = sample(logits[[i for i, _ in sampled]], [s for _, s in sampled], self.eos_ids)
            self._append([s for _, s in sampled], draws, out)
        for seq in only_prefill:
            self._finish(seq, FinishLength(0), out)
        return out

    def _prompt_logprobs(
        self, x: torch.Tensor, seqs: list[Sequence], fresh: list[Sequence]
    ) -> dict[str, PromptLogprobs]:
        """Logprob of each prompt token from ``logprob_start_len`` on, for requests that asked for it."""
        want = [(b, s) for b, s in enumerate(seqs) if s in fresh and s.spec.wants_input_logprobs]
        if not want:
            return {}
        rows, pos, targets, spans = [], [], [], []
        for b, s in want:
            ids, start = s.spec.prompt_ids, s.spec.logprob_start_len
            js = range(max(start, 1), len(ids))
            rows += [b] * len(js)
            pos += [j - 1 for j in js]
            targets += [ids[j] for j in js]
            spans.append((s, start, len(js)))
        dev = x.device
        logits = self.decoder.logits(x[torch.tensor(rows, device=dev), torch.tensor(pos, device=dev)])
        top_n = max(s.spec.top_logprobs_num for _, s in want)
        vals, tops = prompt_logprobs(logits, targets, top_n)
        out, off = {}, 0
        for s, start, n in spans:
            head: list[float | None] = [None] if start == 0 else []
            k = s.spec.top_logprobs_num
            top = None
            if tops is not None and k > 0:
                top = tuple([None] * len(head) + [t[:k] if t else None for t in tops[off : off + n]])
            out[s.spec.id] = PromptLogprobs(start, (*head, *vals[off : off + n]), top)
            off += n
        return out

    def decode(self) -> StepOutput:
        seqs = list(self.running)
        tokens, positions = [s.output[-1] for s in seqs], [s.kv_len for s in seqs]
        if self.graphs is not None:
            logits = self.graphs.decode(self.decoder, self.slab, tokens, positions)
        else:
            logits = self.decode_logits(tokens, positions)
        out = StepOutput("decode")
        self._append(seqs, sample(logits, seqs, self.eos_ids), out)
        return out

    def decode_logits(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One eager decode step over slots 0..B-1. On CUDA it attends over the same key span a graph
        would (a multiple of 256 tokens), so eager and replayed steps compute the same function."""
        dev = self.decoder.embed.device
        top = max(positions)
        self.slab.ensure(len(tokens), top + 1)
        keys = key_span(top, self.slab.capacity) if dev.type == "cuda" else top + 1
        return self.decoder.step_logits(
            torch.tensor(tokens, device=dev)[:, None],
            torch.tensor(positions, device=dev)[:, None],
            self.slab,
            keys,
        )

    def _append(self, seqs: list[Sequence], draws: list[Draw], out: StepOutput) -> None:
        """Record each sampled token; finish by length first, then by EOS / stop token (as SGLang)."""
        done: list[tuple[Sequence, Finish]] = []
        for seq, d in zip(seqs, draws, strict=True):
            seq.output.append(d.token)
            out.draws.append((seq, d))
            spec = seq.spec
            if len(seq.output) >= spec.max_new_tokens:
                done.append((seq, FinishLength(spec.max_new_tokens)))
            elif not spec.ignore_eos and (d.token in self.eos_ids or d.token in spec.stop_token_ids):
                done.append((seq, FinishStop(d.token)))
        for seq, finish in done:
            self._finish(seq, finish, out)

    def _finish(self, seq: Sequence, finish: Finish, out: StepOutput) -> None:
        seq.finish = finish
        self._release(seq)
        out.finished.append((seq.spec.id, finish))

    def _release(self, seq: Sequence) -> None:
        """Free the request's slot; the last running request moves into it (slots stay compact)."""
        slot = next(i for i, s in enumerate(self.running) if s is seq)
        last = len(self.running) - 1
        if slot != last:
            self.slab.move(last, slot, self.running[last].kv_len)
            self.running[slot] = self.running[last]
        self.running.pop()
