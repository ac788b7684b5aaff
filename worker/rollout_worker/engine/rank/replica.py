"""One replica as seen by each of its ranks: continuous batching over a paged KV pool.

Every rank of a replica holds identical scheduler state and samples identically (full logits are
all-gathered), so the ranks stay in lockstep without exchanging tokens. A step either prefills newly
admitted requests (when any fit) or decodes every running request. What to admit and what to retract when
a decode step cannot get its pages are decided by :mod:`rollout_worker.scheduling.admission` (optimistic
admission, as SGLang); a retracted request keeps its tokens, waits at the front of the queue and is
re-prefilled from prompt + generated tokens (sampling is counter-based, so its tokens do not change).

A failure that belongs to one request (its prompt logprobs, its sampling: non-finite logits, an edge case of
its parameters) aborts that request alone, with the error as the abort message; every rank computes it from
the same values with the same code, so every rank aborts the same request at the same step (the loop checks
that they agree). A failure of the forward pass (which holds the collectives) is the replica's, not a
request's: it fails the rank.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from rollout_worker.engine.finish import Finish, FinishAbort, FinishLength, FinishStop
from rollout_worker.engine.messages import PromptLogprobs
from rollout_worker.engine.model.decoder import Decoder
from rollout_worker.engine.model.kv_cache import GatheredKV, KVPool
from rollout_worker.engine.rank.cuda_graphs import DecodeGraphs, key_span
from rollout_worker.engine.rank.sampling import Draw, Failure, prompts_logprobs, sample, verify
from rollout_worker.engine.rank.scheduler import (
    PASS_TOKENS,
    Limits,
    admissible,
    cacheable_row,
    prefill_passes,
    prefill_row,
    prompts_first,
    to_retract_now,
)
from rollout_worker.engine.rank.sequence import Sequence
from rollout_worker.engine.rank.speculation import Speculator, extra_pages, verify_inputs
from rollout_worker.scheduling.admission import SGLANG_RATIO, RatioPolicy, ratio_after_retraction


@dataclass(slots=True)
class StepOutput:
    kind: str  # prefill | decode | verify (a decode step that verified drafts) | idle
    admitted: list[str] = field(default_factory=list)
    retracted: list[str] = field(default_factory=list)
    draws: list[tuple[Sequence, Draw]] = field(default_factory=list)
    cached: dict[str, int] = field(default_factory=dict)  # fresh requests' prompt tokens found cached
    computed: int = 0  # tokens a prefill computed
    reused: int = 0  # tokens a prefill found in the prefix cache instead
    finished: list[tuple[str, Finish]] = field(default_factory=list)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (rid, why) aborted by their own failure
    pass_rows: int = 0  # token rows a decode or verify pass computed (padding included)


class Replica:
    def __init__(
        self,
        decoder: Decoder,
        pool: KVPool,
        limits: Limits,
        eos_ids: tuple[int, ...],
        graphs: DecodeGraphs | None = None,
        ratio: RatioPolicy = SGLANG_RATIO,
        speculator: Speculator | None = None,
    ) -> None:
        self.policy, self.ratio = ratio, ratio.init  # the new-token ratio: see scheduling.admission
        self.retractions = 0
        self.admissions = 0  # requests admitted so far (Sequence.admitted: the order of admission)
        self.pool, self.limits, self.eos_ids = pool, limits, eos_ids
        self.graphs = graphs  # decode steps replayed from CUDA graphs (None: eager)
        self.speculator = speculator  # drafts verified in decode steps (None: no speculation)
        # eager decode on CPU keeps the running batch's gathered K/V between steps (a second copy of it;
        # on a GPU the memory is worth more: not used there)
        self.gathered = GatheredKV() if graphs is None and pool.device.type == "cpu" else None
        self._decoder = decoder
        self.running: list[Sequence] = []  # running[i] occupies row i of the pool's token table
        self.stale_kv: set[str] = set()  # running requests whose K/V older weights computed (see decoder)
        self.waiting: deque[Sequence] = deque()
        self.prefill_tokens_per_ms: float | None = None  # last measured prefill throughput
        self.poison: tuple[str, int] | None = None  # test hook (messages.Faults): (rid, from output token)

    @property
    def decoder(self) -> Decoder:
        return self._decoder

    @decoder.setter
    def decoder(self, decoder: Decoder) -> None:
        """New weights (a weight load): graphs captured over the old ones are dropped, and so is the prefix
        cache (its K/V were computed with the old ones). Requests running on (paused in place while the
        weights changed) keep their K/V, which is kept out of the prefix cache from now on."""
        self._decoder = decoder
        self.pool.flush_cache()
        self.stale_kv |= {s.spec.id for s in self.running}
        if self.graphs is not None:
            self.graphs.clear()

    def release_kv(self) -> None:
        """Free the KV cache's memory (and the graphs that address it)."""
        if self.graphs is not None:
            self.graphs.clear()
        if self.gathered is not None:
            self.gathered.clear()
        self.pool.release()

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
            self._end(seq, finish)
            gone.append((seq.spec.id, finish))
        kept = deque(s for s in self.waiting if not (rids is None or s.spec.id in rids))
        gone += [(s.spec.id, finish) for s in self.waiting if rids is None or s.spec.id in rids]
        self.waiting = kept
        return gone

    def retract(self) -> list[str]:
        """Running requests go back to the front of the queue, their KV dropped (re-prefilled later)."""
        back = list(self.running)
        self.drop_running()
        self.waiting.extendleft(reversed(back))
        return [s.spec.id for s in back]

    def drop_running(self) -> None:
        """Empty the running batch, giving back its pages (the sequences are kept by the caller)."""
        for row, seq in enumerate(self.running):
            self.pool.free(seq.pages)
            self.pool.clear_row(row)
        self.running.clear()
        self.stale_kv.clear()
        if self.gathered is not None:
            self.gathered.clear()

    def hold_running_kv(self, shared: dict[str, tuple[str, int]] | None = None) -> None:
        """Pages and token-table rows for the running requests' cached tokens (a new replica's requests
        before their KV arrives by migration). ``shared``: request -> (a request before it, how many of
        that one's first pages it shares), as they did on the old replica; those pages are cached."""
        by_id = {s.spec.id: s for s in self.running}
        for row, seq in enumerate(self.running):
            kin = (shared or {}).get(seq.spec.id)
            if kin is not None:
                seq.pages.extend(by_id[kin[0]].pages[: kin[1]])
                self.pool.shared.acquire(seq.pages)
            self._reserve(seq, seq.kv_len)
            if seq.spec.id not in self.stale_kv:
                self.pool.cache_prefix(prefill_row(seq), seq.pages)
            self.pool.bind(row, seq.pages)

    # -- stepping ------------------------------------------------------------------------------------
    def _admit(self) -> list[Sequence]:
        n = admissible(self.waiting, self.running, self.pool, self.ratio, self.limits)
        return [self.waiting.popleft() for _ in range(n)]

    def _retract_for_step(self) -> list[str]:
        """Make room for the next decode step's pages: retract what :func:`scheduler.to_retract_now` picks
        (back to the front of the queue, pages freed) and re-estimate the ratio; else let the ratio decay."""
        seqs = to_retract_now(self.running, self.pool)
        if not seqs:
            self.ratio = self.policy.decayed(self.ratio)
            return []
        for seq in seqs:
            self._release(seq)
        self.waiting.extendleft(reversed(seqs))
        self.ratio = ratio_after_retraction([s.req for s in self.running])
        self.retractions += len(seqs)
        return [s.spec.id for s in seqs]

    def step(self) -> StepOutput:
        """Prefill newly admitted requests if any fit, else decode every running request."""
        admitted = self._admit()
        if admitted:
            out = self.prefill(prompts_first(admitted), sample_fresh=True)
            out.admitted = [s.spec.id for s in admitted]
            return out
        if self.running:
            return self.decode()
        return StepOutput("idle")

    def prefill(self, seqs: list[Sequence], sample_fresh: bool) -> StepOutput:
        """Append ``seqs`` to the running batch and build their KV cache in padded forward passes over
        consecutive rows (:func:`prefill_passes`: one, unless padding would cost more than a pass).

        A fresh request (no output yet) is prefilled over its prompt and samples its first token; a
        resumed one is prefilled over prompt + output[:-1] (its cache after ``len(output)`` steps) and
        continues decoding from its last token. Each row computes only the tokens after the prefix it found
        in the prefix cache, which an earlier row of the same pass, or of an earlier pass, may have put
        there: a layer writes every row's K/V before any row reads, so a row attends to the shared pages as
        they are written. (The samples of a prompt, admitted together, compute one token each after the
        first: padded to the prompt's width they would cost as much as the whole prompt each; see
        :func:`prompts_first`.)
        """
        slot0, pool = len(self.running), self.pool
        cacheable = [cacheable_row(s) for s in seqs]
        # Held while the rows take their pages, so that no row's allocation evicts a cached prefix another
        # row was admitted to share (admission counted on it).
        pinned = [p for row, limit in cacheable for p in pool.shared.match(row, limit)]
        pool.shared.acquire(pinned)
        rows, starts = [], []
        for i, (s, (row, limit)) in enumerate(zip(seqs, cacheable, strict=True)):
            s.admitted, self.admissions = self.admissions, self.admissions + 1
            starts.append(pool.share(s.pages, row, limit))
            self._reserve(s, len(row))
            pool.cache_prefix(row, s.pages)
            pool.bind(slot0 + i, s.pages)  # (grows the token table as needed)
            rows.append(row)
        pool.shared.release(pinned)
        self.running.extend(seqs)
        out = StepOutput("prefill", computed=sum(len(r) for r in rows) - sum(starts), reused=sum(starts))
        fresh = [s for s in seqs if not s.output] if sample_fresh else []
        out.cached = {s.spec.id: c for s, c in zip(seqs, starts, strict=True) if s in fresh}
        t0 = time.perf_counter()
        widths = [len(r) - c for r, c in zip(rows, starts, strict=True)]  # tokens computed per row
        last: list[torch.Tensor] = []  # each row's last hidden state
        for run in prefill_passes(widths, PASS_TOKENS[pool.device.type]):
            x = self._forward(rows[run.start : run.stop], starts[run.start : run.stop], slot0 + run.start)
            at = torch.tensor([widths[i] - 1 for i in run], device=x.device)
            last.append(x[torch.arange(len(run), device=x.device), at])
            if fresh:
                got, failed = prompts_logprobs(self.decoder.logits, x, seqs[run.start : run.stop], fresh)
                for seq, failure in failed:  # this request's, not the engine's
                    self._fail(seq, failure, out)
                out.prompt_logprobs |= got
        logits = self._poisoned(self.decoder.logits(torch.cat(last)), seqs)
        self.prefill_tokens_per_ms = out.computed / max((time.perf_counter() - t0) * 1e3, 1e-3)
        live = [s for s in fresh if s.finish is None]  # (a request whose prompt logprobs failed is aborted)
        only_prefill = [s for s in live if s.spec.max_new_tokens == 0]
        sampled = [(i, s) for i, s in enumerate(seqs) if s in live and s.spec.max_new_tokens > 0]
        if sampled:
            draws = sample(logits[[i for i, _ in sampled]], [s for _, s in sampled], self.eos_ids)
            self._append([s for _, s in sampled], draws, out)
        for seq in only_prefill:
            self._finish(seq, FinishLength(0), out)
        return out

    def _forward(self, rows: list[list[int]], starts: list[int], slot0: int) -> torch.Tensor:
        """Hidden states [rows, width, hidden] of one padded prefill pass: row ``i`` (the token table's row
        ``slot0 + i``) computes its tokens from ``starts[i]`` on."""
        pool, dev = self.pool, self.decoder.embed.device
        width = max(len(r) - c for r, c in zip(rows, starts, strict=True))
        keys = max(len(r) for r in rows)
        tokens = torch.zeros((len(rows), width), dtype=torch.long)
        positions = torch.zeros((len(rows), width), dtype=torch.long)
        write = torch.zeros((len(rows), width), dtype=torch.long, device=dev)  # padding: the null slot 0
        for i, (r, c) in enumerate(zip(rows, starts, strict=True)):
            n = len(r) - c
            tokens[i, :n] = torch.tensor(r[c:])
            positions[i, :n] = torch.arange(c, len(r))
            positions[i, n:] = len(r) - 1
            write[i, :n] = pool.table[slot0 + i, c : len(r)]
        read = pool.table[slot0 : slot0 + len(rows), :keys]
        return self.decoder.hidden(tokens.to(dev), positions.to(dev), pool, write, read)

    def _reserve(self, seq: Sequence, tokens: int) -> None:
        if not self.pool.reserve(seq.pages, tokens):
            raise RuntimeError(f"KV pool of {self.pool.tokens} tokens is full")

    def decode(self) -> StepOutput:
        retracted = self._retract_for_step()
        spec = self.speculator
        if spec is not None:
            drafts = spec.plan(self.running)
            room = extra_pages(self.running, drafts, self.pool.page_size) <= self.pool.free_pages
            if any(drafts) and room:
                return self._verify(spec, drafts, retracted)
        seqs = list(self.running)
        logits = self.step_logits()
        out = StepOutput("decode", retracted=retracted, pass_rows=len(seqs))
        self._append(seqs, sample(self._poisoned(logits, seqs), seqs, self.eos_ids), out)
        if not self.running and self.gathered is not None:
            self.gathered.clear()  # the batch is done: its copy goes
        return out

    def _verify(self, spec: Speculator, drafts: list[list[int]], retracted: list[str]) -> StepOutput:
        """A decode step that verifies each running request's drafts (:mod:`speculation`): one pass over
        its last token and drafts, then the tokens plain decoding would emit, 1 to k+1 a request, each
        recorded as a decode step records its token (a finish ends the run)."""
        seqs, pool = list(self.running), self.pool
        for b, (seq, d) in enumerate(zip(seqs, drafts, strict=True)):
            self._reserve(seq, seq.kv_len + 1 + len(d))
            pool.bind(b, seq.pages)
        dev = self.decoder.embed.device
        tokens, positions, write, read = verify_inputs(seqs, drafts, pool, dev)
        x = self.decoder.hidden(tokens, positions, pool, write, read)
        counts = [1 + len(d) for d in drafts]
        at = torch.tensor([[b, i] for b, n in enumerate(counts) for i in range(n)], device=dev)
        rows = self.decoder.logits(x[at[:, 0], at[:, 1]]).split(counts)  # one product (and gather) for all
        out = StepOutput("verify", retracted=retracted, pass_rows=len(seqs) * max(counts))
        emitted = []
        for seq, d, row in zip(seqs, drafts, rows, strict=True):
            got = verify(self._poisoned(row, [seq] * len(row)), seq, d, self.eos_ids)
            draws: list[Draw | Failure] = [got] if isinstance(got, Failure) else list(got)
            emitted.append(0 if isinstance(got, Failure) else len(got))
            for draw in draws:
                self._append([seq], [draw], out)
                if seq.finish is not None:
                    break
        spec.learn(seqs, drafts, emitted)
        return out

    def _poisoned(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The test hook: the poisoned request's rows become NaN (as a numerical blow-up would make them)."""
        if self.poison is None:
            return logits
        rid, at = self.poison
        rows = [i for i, s in enumerate(seqs) if s.spec.id == rid and len(s.output) >= at]
        if rows:
            logits = logits.clone()
            logits[rows] = float("nan")
        return logits

    def step_logits(self) -> torch.Tensor:
        """Logits [B, vocab] of one decode step of the running batch (each request's last token)."""
        seqs = self.running
        tokens, positions = [s.output[-1] for s in seqs], [s.kv_len for s in seqs]
        pool = self.pool
        for seq, pos in zip(seqs, positions, strict=True):
            self._reserve(seq, pos + 1)
        write = [pool.slot(s.pages, p) for s, p in zip(seqs, positions, strict=True)]
        pool.ensure_table(len(seqs), max(positions) + 1)
        dev = self.decoder.embed.device
        write_t = torch.tensor(write, device=dev)
        pool.table[torch.arange(len(seqs), device=dev), torch.tensor(positions, device=dev)] = write_t
        if self.graphs is not None:
            return self.graphs.decode(self.decoder, pool, tokens, positions, write)
        return self.decode_logits(tokens, positions, write_t)

    def decode_logits(self, tokens: list[int], positions: list[int], write: torch.Tensor) -> torch.Tensor:
        """One eager decode step over token-table rows 0..B-1 (K/V written at slots ``write``). On CUDA it
        attends over the same key span a graph would (a multiple of 256 tokens), so eager and replayed
        steps compute the same function."""
        dev = self.decoder.embed.device
        top = max(positions)
        keys = key_span(top, self.pool.capacity) if dev.type == "cuda" else top + 1
        return self.decoder.step_logits(
            torch.tensor(tokens, device=dev)[:, None],
            torch.tensor(positions, device=dev)[:, None],
            self.pool,
            write[:, None],
            keys,
            self.gathered,
        )

    def _append(self, seqs: list[Sequence], draws: list[Draw | Failure], out: StepOutput) -> None:
        """Record each sampled token; finish by length first, then by EOS / stop token (as SGLang); a
        request whose row failed is aborted."""
        done: list[tuple[Sequence, Finish]] = []
        for seq, d in zip(seqs, draws, strict=True):
            if isinstance(d, Failure):
                done.append((seq, _aborted(d)))
                out.failed.append((seq.spec.id, d.message))
                continue
            seq.output.append(d.token)
            out.draws.append((seq, d))
            spec = seq.spec
            if len(seq.output) >= spec.max_new_tokens:
                done.append((seq, FinishLength(spec.max_new_tokens)))
            elif not spec.ignore_eos and (d.token in self.eos_ids or d.token in spec.stop_token_ids):
                done.append((seq, FinishStop(d.token)))
        for seq, finish in done:
            self._finish(seq, finish, out)

    def _fail(self, seq: Sequence, failure: Failure, out: StepOutput) -> None:
        out.failed.append((seq.spec.id, failure.message))
        self._finish(seq, _aborted(failure), out)

    def _finish(self, seq: Sequence, finish: Finish, out: StepOutput) -> None:
        seq.finish = finish
        self._end(seq, finish)
        out.finished.append((seq.spec.id, finish))

    def _end(self, seq: Sequence, finish: Finish) -> None:
        """Release a running request that ended (by itself, or by a stop string the driver matched); unless
        it was aborted, the full pages of every token whose K/V it wrote (its prompt and all but its last
        output token) stay in the prefix cache, as SGLang's radix cache keeps a finished request's: the
        next turn of a conversation (this one's tokens and more) finds them; nor when older weights computed
        its K/V (``stale_kv``: it ran on, paused in place, through a weight load)."""
        if not isinstance(finish, FinishAbort) and seq.spec.id not in self.stale_kv:
            self.pool.cache_prefix(prefill_row(seq), seq.pages)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        """Free the request's pages and row; the last running request moves into its row (rows stay
        compact)."""
        slot = next(i for i, s in enumerate(self.running) if s is seq)
        last = len(self.running) - 1
        self.pool.free(seq.pages)
        self.stale_kv.discard(seq.spec.id)
        if slot != last:
            self.pool.move_row(last, slot)
            self.running[slot] = self.running[last]
        else:
            self.pool.clear_row(slot)
        self.running.pop()


def _aborted(failure: Failure) -> FinishAbort:
    return FinishAbort(f"request failed: {failure.message}")
