"""A rank process: long-lived, driven by its inbox, stepping its replica at its own pace.

Each step boundary the rank takes its new commands. The driver sends every command meant for a replica to
each of its ranks, in the same order; the replica's leader (shard 0) decides how many it applies now and
tells the other ranks of its TP group with one small broadcast, so every rank of a replica applies the
same commands at the same step. TP-1 replicas need no collective at all. Replicas never wait for each
other, except at a *global* command (a reconfiguration, a weight load), where every rank of the pod meets.
An idle or paused replica blocks on its inbox instead of spinning.

A request that fails on its own (see :mod:`~rollout_worker.engine.rank.replica`) is aborted by every rank of
its
replica at the same step; the same broadcast carries the leader's digest of the requests so aborted, and a
rank whose own digest differs fails (its replica's ranks would no longer run the same batch).

The rank dies with the driver: a watchdog thread waits on the driver's pidfd (any death, SIGKILL included)
and ends the process; PR_SET_PDEATHSIG covers the parent (a forkserver on CPU) as well.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue as queue_mod
import signal
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rollout_worker.drafting.corpus import add_corpus, remove_corpus
from rollout_worker.engine import messages as m
from rollout_worker.engine.config import EngineConfig
from rollout_worker.engine.finish import PAUSE_ABORT, Finish
from rollout_worker.engine.messages import Faults
from rollout_worker.engine.rank import weight_sync
from rollout_worker.engine.rank.rank_state import RankState, build_state, device_for, load_weights
from rollout_worker.engine.rank.reconfigure import reconfigure
from rollout_worker.engine.rank.rendezvous import join
from rollout_worker.engine.rank.sequence import Sequence
from rollout_worker.engine.rank.speculation import PassCost
from rollout_worker.errors import UserError
from rollout_worker.proc import die_with_parent, when_gone

log = logging.getLogger(__name__)


class Outbox:
    """The one pipe every rank writes to, under a lock: a message written before a collective is read by
    the driver before any message written after it (the driver relies on this order)."""

    def __init__(self, conn: Any, lock: Any) -> None:
        self.conn, self.lock = conn, lock

    def send(self, msg: m.Report) -> None:
        with self.lock:
            self.conn.send(msg)


class RankLoop:
    def __init__(self, st: RankState, inbox: Any, outbox: Outbox) -> None:
        self.st, self.inbox, self.outbox = st, inbox, outbox
        self.stopping = False
        self.pending: list[tuple[str, Finish]] = []  # finished by a command, reported at the next report
        self.retracted: list[str] = []
        self.step_ms: list[float] = []
        self.faulted = 0  # digest of the requests this replica aborted for their own failures
        self.weight_groups = weight_sync.TrainerGroups(st.rank, outbox.send)  # groups with trainers
        self.pass_cost = PassCost()  # the leader's fit of its decode and verify passes' times

    @property
    def idle(self) -> bool:
        return self.st.paused or self.st.replica.unfinished == 0

    def run(self) -> None:
        while not self.stopping:
            for cmd in self.take(block=self.idle):
                self.handle(cmd)
            if self.stopping:
                break
            if not self.idle:
                self.step()
            elif self.pending or self.retracted:
                self.report(m.StepReport(self.st.replica_index, self.st.epoch, self.st.step, "idle", 0.0))

    # -- inbox ---------------------------------------------------------------------------------------
    def take(self, block: bool) -> list[m.Command]:
        st = self.st
        if st.layout.tp == 1:
            self._set_cost(self.pass_cost.ratio())
            return self._drain(block)
        if st.is_leader:
            msgs = self._drain(block)
            _, _, cost = self.st.group_sync(len(msgs), self.faulted, self.pass_cost.ratio())
            self._set_cost(cost)
            return msgs
        first = [self.inbox.get()] if block else []
        k, faulted, cost = self.st.group_sync(0, self.faulted)
        self._set_cost(cost)
        if faulted != self.faulted:
            raise RuntimeError(
                f"the ranks of replica {st.replica_index} disagree on which requests failed "
                f"(rank {st.rank} saw a failure its leader did not, or the reverse)"
            )
        return first + [self.inbox.get() for _ in range(k - len(first))]

    def _set_cost(self, ratio: int) -> None:
        """Every rank of the replica speculates from its leader's pass cost ratio (the same on all)."""
        spec = self.st.replica.speculator
        if spec is not None:
            spec.ratio = ratio

    def _drain(self, block: bool) -> list[m.Command]:
        """Everything in the inbox now (at least one message when ``block``), up to a global command."""
        msgs = [self.inbox.get()] if block else []
        while not (msgs and isinstance(msgs[-1], m.GLOBAL_COMMANDS)):
            try:
                msgs.append(self.inbox.get_nowait())
            except queue_mod.Empty:
                break
        return msgs

    # -- commands ------------------------------------------------------------------------------------
    def handle(self, cmd: m.Command) -> None:
        st, rep = self.st, self.st.replica
        if isinstance(cmd, m.Submit):
            rep.add(Sequence(spec=cmd.spec))
        elif isinstance(cmd, m.Abort):
            self.pending += rep.abort(cmd.rids, cmd.finish)
        elif isinstance(cmd, m.Pause):
            st.paused = True
            if cmd.mode == "abort":
                self.pending += rep.abort(None, PAUSE_ABORT)
            elif cmd.mode == "retract":
                self.retracted += rep.retract()
        elif isinstance(cmd, m.Resume):
            st.paused = False
        elif isinstance(cmd, m.Reconfigure):
            self.reconfigure(cmd)
        elif isinstance(cmd, m.LoadWeights):
            self.load(cmd)
        elif isinstance(cmd, m.JoinWeightGroup):
            self.weight_groups.join(cmd)  # beside the step loop: the thread answers the driver
        elif isinstance(cmd, m.LeaveWeightGroup):
            self.weight_groups.leave(cmd.group_name)
            self.outbox.send(m.Done(cmd.ticket, st.rank, True))
        elif isinstance(cmd, m.ReceiveWeights):
            self.receive_weights(cmd)
        elif isinstance(cmd, m.ReleaseMemory | m.ResumeMemory):
            self.memory(cmd)
        elif isinstance(cmd, m.FlushCache):
            rep.pool.flush_cache()
            if rep.speculator is not None:
                rep.speculator.forget_requests()  # as SGLang's flush resets its n-gram cache
            self.outbox.send(m.Done(cmd.ticket, st.rank, True))
        elif isinstance(cmd, m.AddCorpus):
            add_corpus(st.corpus, cmd.corpus_id, cmd.documents)
            self.outbox.send(m.Done(cmd.ticket, st.rank, True))
        elif isinstance(cmd, m.RemoveCorpus):
            remove_corpus(st.corpus, cmd.corpus_id)
            self.outbox.send(m.Done(cmd.ticket, st.rank, True))
        elif isinstance(cmd, m.Shutdown):
            self.stopping = True

    def reconfigure(self, cmd: m.Reconfigure) -> None:
        self.flush()  # the driver learns of everything before the switch first
        self.st, event, placements = reconfigure(self.st, cmd.target, cmd.method, cmd.reason)
        self.pass_cost = PassCost()  # another layout, other step times
        self.faulted = 0  # every rank meets here; the new groups start agreeing afresh
        if self.st.rank == 0:
            self.outbox.send(m.Switched(cmd.ticket, event, tuple(placements), self.st.epoch, self.st.step))
        dist.barrier()  # ... and of the switch before any report of the new layout

    def load(self, cmd: m.LoadWeights) -> None:
        """Load new weights for the current layout on every rank; all keep them or none does."""
        st, error = self.st, ""
        try:
            weights = load_weights(st.cfg, cmd.path, st.layout, st.rank, st.device)
            st.fault("load")
        except Exception as exc:  # a bad checkpoint on one rank: every rank keeps its old weights
            why = str(exc) if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}"
            error = f"rank {st.rank}: {why}"
        ok = self.agree(error)
        if ok:
            st.weights, st.weights_path = weights, cmd.path
            st.replica.decoder = st.decoder(weights, st.layout)
        if st.rank == 0:
            self.outbox.send(m.Done(cmd.ticket, st.rank, ok, error or ("" if ok else "another rank failed")))
        dist.barrier()

    def agree(self, error: str) -> bool:
        """True when no rank of the pod had an error (every rank calls this at the same point)."""
        flag = torch.tensor([0 if error else 1], dtype=torch.int64, device=self.st.sync_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def receive_weights(self, cmd: m.ReceiveWeights) -> None:
        """Receive the trainer's broadcast into a staged checkpoint (rank 0 writes it) and load it."""
        st, error = self.st, ""
        try:
            pg = self.weight_groups[cmd.group_name]
            shapes = [list(s) for s in cmd.shapes]
            got = weight_sync.receive(pg, list(cmd.names), list(cmd.dtypes), shapes, st.device, cmd.bucket)
            if st.rank == 0:
                from safetensors.torch import save_file

                save_file({k: v.to("cpu").contiguous() for k, v in got.items()}, cmd.file)
            del got
        except Exception as exc:
            error = f"rank {st.rank}: {type(exc).__name__}: {exc}"
        if self.agree(error):  # rank 0 wrote the file before this meeting
            self.load(m.LoadWeights(cmd.path, cmd.ticket))
            return
        if st.rank == 0:
            self.outbox.send(m.Done(cmd.ticket, st.rank, False, error or "another rank failed"))
        dist.barrier()

    def memory(self, cmd: m.ReleaseMemory | m.ResumeMemory) -> None:
        """Release or re-acquire weights / KV cache memory (the engine is idle: the driver checked), then
        say what this rank holds, before the Done the driver waits for."""
        st = self.st
        try:
            if isinstance(cmd, m.ReleaseMemory):
                if "kv_cache" in cmd.tags:
                    st.replica.release_kv()
                if "weights" in cmd.tags:
                    st.weights = {}
                    st.replica.release_weights()
            else:
                if "weights" in cmd.tags and not st.weights:
                    st.weights = load_weights(st.cfg, st.weights_path, st.layout, st.rank, st.device)
                    st.replica.decoder = st.decoder(st.weights, st.layout)
                if "kv_cache" in cmd.tags:
                    st.replica.pool.reacquire()
            self.outbox.send(held(st))
            self.outbox.send(m.Done(cmd.ticket, st.rank, True))
        except Exception as exc:
            self.outbox.send(
                m.Done(cmd.ticket, st.rank, False, f"rank {st.rank}: {type(exc).__name__}: {exc}")
            )

    # -- stepping ------------------------------------------------------------------------------------
    def step(self) -> None:
        st = self.st
        t0 = time.perf_counter()
        out = st.replica.step()
        ms = (time.perf_counter() - t0) * 1e3
        st.step += 1
        for rid, why in out.failed:
            self.faulted = _chain(self.faulted, rid)
            if st.is_leader:
                log.warning("request %s aborted at step %d: %s", rid, st.step, why)
        if not st.is_leader:
            return
        if out.pass_rows:
            self.pass_cost.add(out.pass_rows, ms)
        self.retracted += out.retracted
        report = m.StepReport(
            replica=st.replica_index,
            epoch=st.epoch,
            step=st.step,
            kind=out.kind,
            ms=ms,
            admitted=tuple(out.admitted),
            tokens=[m.TokenOut(seq.spec.id, d.token, d.logprob, d.top) for seq, d in out.draws],
            finished=out.finished,
            prompt_logprobs=out.prompt_logprobs,
            cached=out.cached,
            prefill_tokens=out.computed,
            reused_tokens=out.reused,
            retractions=len(out.retracted),
        )
        self.report(report)

    def report(self, r: m.StepReport) -> None:
        """Send (leaders only) with the replica's counts and anything commands finished or retracted."""
        rep = self.st.replica
        r.finished = [*self.pending, *r.finished]
        r.retracted = tuple(self.retracted)
        r.running, r.waiting = len(rep.running), len(rep.waiting)
        r.kv_tokens, r.kv_capacity, r.kv_paged = rep.kv_tokens, rep.pool.tokens, rep.pool.used_tokens
        self.pending, self.retracted = [], []
        if self.st.is_leader:
            self.outbox.send(r)

    def flush(self) -> None:
        if self.pending or self.retracted:
            self.report(m.StepReport(self.st.replica_index, self.st.epoch, self.st.step, "idle", 0.0))


def held(st: RankState) -> m.MemoryHeld:
    """What this rank holds now: its shard of the weights and its replica's KV pool, in bytes."""
    weights = sum(t.numel() * t.element_size() for t in st.weights.values())
    return m.MemoryHeld(st.rank, weights, st.replica.pool.nbytes)


def _chain(digest: int, rid: str) -> int:
    """The digest of the failed requests so far, extended by ``rid`` (63 bits: an int64 on the wire)."""
    h = hashlib.blake2b(f"{digest}:{rid}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1


# -- process entry ------------------------------------------------------------------------------------
def rank_main(
    rank: int,
    cfg: EngineConfig,
    store: tuple[str, int],
    inbox: Any,
    outbox_conn: Any,
    outbox_lock: Any,
    driver_pid: int,
    faults: Faults | None = None,
    task: Callable[[RankState, dict[str, Any]], dict[str, Any]] | None = None,
    task_args: dict[str, Any] | None = None,
) -> None:
    """Process entry: set up, then serve the inbox until Shutdown (or run one measurement ``task``)."""
    die_with_parent()
    when_gone(driver_pid, lambda: os._exit(1), name="driver-watchdog")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver handles Ctrl-C and stops the ranks
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    outbox = Outbox(outbox_conn, outbox_lock)
    try:
        _, backend, _ = device_for(rank, cfg)
        join(backend, rank, cfg.world, store, timedelta(seconds=cfg.engine.collective_timeout_seconds))
        st = build_state(rank, cfg, faults)
        if task is not None:
            result = task(st, task_args or {})
            dist.barrier()
            outbox.send(m.TaskResult(rank, result))
            return
        outbox.send(m.Ready(rank, os.getpid()))
        outbox.send(held(st))
        RankLoop(st, inbox, outbox).run()
    except BaseException as exc:
        msg = str(exc) if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}"
        with contextlib.suppress(OSError):  # the driver may be gone already
            outbox.send(m.Failed(rank, msg, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
