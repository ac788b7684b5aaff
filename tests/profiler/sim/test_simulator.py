"""Simulator: hand-computed cases (independent replicas, admission by KV memory, preemption and its
recompute cost, a switch), and what an oracle and the adaptive policy may and may not know."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from rollout_profiler.planning.latency import LatencyModel
from rollout_profiler.planning.predictor import Prior
from rollout_profiler.profile import CostModel, KVCapacity, ModelShape, Profile, StepPoint
from rollout_profiler.profiling import modelled
from rollout_profiler.sim import simulate as sim_run
from rollout_profiler.sim.config import SimConfig, SimResult, Switch
from rollout_profiler.sim.memory import DONE, Admission
from rollout_profiler.sim.oracle import oracle
from rollout_profiler.sim.policies import AdaptiveController, ScheduleController, run_adaptive
from rollout_profiler.sim.probe import probed_adaptive
from rollout_profiler.sim.simulate import parse_policies, simulate
from rollout_profiler.sim.simulator import Simulator
from rollout_profiler.sim.workloads import Workload, synthetic
from rollout_worker.errors import UserError
from rollout_worker.scheduling.layout import Layout

SHAPE = ModelShape("toy", "LlamaForCausalLM", 64, 2, 8, 8, 8, 128, 100)
COSTS = CostModel(1e30, 0.0, 100.0, 50.0, 1.0, 30.0, 5.0)  # a grow switch costs 5 + 1 + 0 ms (migrate)


def profile(lines: dict[int, tuple[float, float]], kv: dict[int, int] | None = None) -> Profile:
    """2 GPUs: a replica step of ``a + s x batch`` ms at TP ``t`` (``lines[t] = (a, s)``), any context."""
    pts = [
        StepPoint(2 // t, t, b, c, a + s * b)
        for t, (a, s) in lines.items()
        for b in (1, 2, 4, 8)
        for c in (0, 1000)
    ]
    cap = None if kv is None else KVCapacity(kv, {"rule": "by hand"})
    return Profile(
        "hand2", SHAPE, "test", "cpu", 2, "", "float32", "modelled", pts, [], COSTS, kv_capacity=cap
    )


def workload(lengths: list[int], prompt: int = 10, cap: int | None = None) -> Workload:
    n = len(lengths)
    return Workload("hand", np.array(lengths), np.full(n, prompt), np.full(n, cap or max(lengths)))


def test_static_replicas_step_independently() -> None:
    """2x1, requests dealt 0, 1, 0, 1: replica 0 holds lengths 4 and 1, replica 1 lengths 2 and 2."""
    sim = Simulator(
        LatencyModel(profile({1: (10.0, 5.0), 2: (6.0, 3.0)})),
        workload([4, 2, 1, 2]),
        SimConfig(2, admission="engine"),
    )
    r = sim.run(Layout(2, 1), name="static:1")
    # replica 0: batch 2 (20 ms), then batch 1 for 3 steps (15 ms each) = 65 ms; replica 1: 2 x 20 = 40 ms.
    # In lockstep the pod would take 20 + max(15, 20) + 15 + 15 = 70 ms.
    assert r.latency_s == pytest.approx(0.065)
    assert r.gpu_busy == pytest.approx((65 + 40) / (2 * 65))
    assert r.reconfigs == [] and r.admission == "engine"
    r2 = sim.run(Layout(1, 2), name="static:2")  # one replica: batch 4, 3, 1, 1 -> 18 + 15 + 9 + 9
    assert r2.latency_s == pytest.approx(0.051)


class _ForkAt(AdaptiveController):
    """Forks the run at ``t_ms`` (then decides nothing)."""

    def __init__(self, t_ms: float) -> None:
        self.t, self.forks, self.at = t_ms, [], []

    def next_time(self, sim: Simulator) -> float:
        return self.t if not self.forks else math.inf

    def on_time(self, sim: Simulator, t_ms: float) -> None:
        self.forks.append(sim.fork())
        self.at.append(t_ms)


def test_a_fork_plays_on_as_the_run_it_left_and_can_take_another_path() -> None:
    sim = Simulator(
        LatencyModel(profile({1: (10.0, 5.0), 2: (6.0, 3.0)}, kv={1: 60, 2: 200})),
        workload([40, 9, 25, 3, 30, 12], prompt=5),
        SimConfig(2, admission="paged"),
    )
    ctl = _ForkAt(150.0)
    whole = sim.run(Layout(2, 1), name="whole", controller=ctl)
    (fork,) = ctl.forks
    assert 0 < fork.unfinished() < 6 and fork.model is sim.model  # forked mid-run, sharing the model
    other = fork.fork()  # a fork of the fork, switched to 1x2 at the fork's time
    alone = fork.resume("fork")
    assert alone.latency_s == whole.latency_s and alone.preemptions == whole.preemptions
    assert other.unfinished() > 0  # resuming one fork left the other where it was
    other.switch(Switch(Layout(1, 2), "auto", other.lengths - other.req.gen, "probe"), ctl.at[0])
    switched = other.resume("switched")
    assert [e.dst for e in switched.reconfigs] == [Layout(1, 2)] and whole.reconfigs == []
    assert switched.latency_s != whole.latency_s


def test_admission_by_kv_memory_changes_the_result() -> None:
    """1x2 holds 60 KV tokens; each request reserves prompt 10 + max_new_tokens 20 = 30 under the engine
    policy, so two run at a time instead of four."""
    lines = {1: (10.0, 5.0), 2: (6.0, 3.0)}
    wl = workload([5, 5, 5, 5], prompt=10, cap=20)
    free = Simulator(LatencyModel(profile(lines)), wl, SimConfig(2, admission="engine")).run(
        Layout(1, 2), name="x"
    )
    assert free.latency_s == pytest.approx(5 * 18 / 1e3)  # batch 4: 6 + 12 ms, 5 steps
    limited = Simulator(LatencyModel(profile(lines, {1: 30, 2: 60})), wl, SimConfig(2, admission="engine"))
    r = limited.run(Layout(1, 2), name="x")
    assert r.latency_s == pytest.approx(2 * 5 * 12 / 1e3) and r.preemptions == 0  # two waves of batch 2
    # 2x1: 30 tokens per replica, one request at a time on each: 2 x 5 steps of 15 ms
    assert limited.run(Layout(2, 1), name="x").latency_s == pytest.approx(0.150)
    assert Simulator(
        LatencyModel(profile(lines, {1: 30, 2: 60})), wl, SimConfig(2, admission="engine", memory=False)
    ).run(Layout(1, 2), name="x").latency_s == pytest.approx(free.latency_s)


def test_sglang_preempts_the_newest_and_pays_its_recompute() -> None:
    """50 KV tokens, 4 requests of prompt 10 and 5 tokens: optimistic admission takes all 4 (40 tokens);
    after 2 steps (48 used) the third would not fit, so the newest (12 tokens) is preempted; the other 3
    finish in 3 steps of batch 3; the preempted one is re-prefilled (12 tokens at 100 tokens/ms) and runs
    its last 3 steps alone."""
    prof = profile({1: (10.0, 5.0), 2: (6.0, 3.0)}, {1: 25, 2: 50})
    sim = Simulator(
        LatencyModel(prof), workload([5, 5, 5, 5], prompt=10, cap=5), SimConfig(2, admission="sglang")
    )
    r = sim.run(Layout(1, 2), name="x")
    assert r.preemptions == 1 and r.recomputed_tokens == 12
    assert r.latency_s == pytest.approx((2 * 18 + 3 * 15 + 12 / 100 + 3 * 9) / 1e3)
    assert r.admission == "sglang"
    engine = Simulator(
        LatencyModel(prof), workload([5, 5, 5, 5], prompt=10, cap=5), SimConfig(2, admission="engine")
    )
    e = engine.run(Layout(1, 2), name="x")  # reserves 15 each: 3 run, then 1
    assert e.preemptions == 0 and e.latency_s == pytest.approx((5 * 15 + 5 * 9) / 1e3)


def test_paged_pays_a_prefill_step_per_round_of_admissions() -> None:
    """``paged`` follows the engine step by step: at most 2 running, 4 requests of prompt 10 and 5 tokens.
    Each round of 2 is one prefill (20 tokens at 100 tokens/ms = 0.2 ms, but never less than a decode step
    of 2 rows, 12 ms), which samples the first token; then 4 decode steps of batch 2 (12 ms each)."""
    prof = profile({1: (10.0, 5.0), 2: (6.0, 3.0)}, {1: 500, 2: 1000})
    cfg = SimConfig(2, admission="paged", max_batch=2, page_size=4)
    r = Simulator(LatencyModel(prof), workload([5, 5, 5, 5], prompt=10, cap=5), cfg).run(
        Layout(1, 2), name="x"
    )
    assert r.preemptions == 0
    assert r.latency_s == pytest.approx(2 * (12 + 4 * 12) / 1e3)


def test_paged_switch_carries_running_requests_without_a_prefill() -> None:
    """As the engine's switch (``engine.migration.place``): the requests whose KV a switch carries keep
    running on the new replicas when the admission rule admits them there, with no prefill step (the
    switch's cost prices moving their KV); those that do not fit wait, their KV dropped, and are
    re-prefilled when admitted."""
    lines = {1: (10.0, 1.0), 2: (6.0, 1.0)}
    wl = workload([1, 2, 3, 5, 6])
    cfg = SimConfig(2, admission="paged")
    sim = Simulator(LatencyModel(profile(lines, {1: 1000, 2: 2000})), wl, cfg)
    r = sim.run(Layout(2, 1), name="s", controller=ScheduleController([(3, Layout(1, 2))]))
    (ev,) = r.reconfigs
    # 3 carried at 41 ms; then decode steps only, 6 + batch ms: 3, 2, 1, 1 running (no prefill round)
    assert ev.time_s == pytest.approx(0.041) and ev.requests_running == 3
    assert r.latency_s == pytest.approx((41 + 9 + 8 + 7 + 7) / 1e3)
    assert r.recomputed_tokens == 0 and r.preemptions == 0
    tight = Simulator(LatencyModel(profile(lines, {1: 1000, 2: 28})), wl, cfg)
    t = tight.run(Layout(2, 1), name="s", controller=ScheduleController([(3, Layout(1, 2))]))
    assert t.recomputed_tokens > 0 and t.latency_s > r.latency_s  # 28 tokens: not all 3 are kept


def test_switch_when_two_are_left_pays_its_cost_and_free_switches_shift_the_run() -> None:
    lines = {1: (10.0, 1.0), 2: (6.0, 1.0)}
    sim = Simulator(LatencyModel(profile(lines)), workload([1, 2, 3, 5]), SimConfig(2, admission="engine"))
    ctl = ScheduleController([(2, Layout(1, 2))])
    r = sim.run(Layout(2, 1), name="s", controller=ctl)
    # replica 0: [1, 3], replica 1: [2, 5]. At 24 ms replica 1 finishes its 2-token request (2 left);
    # replica 0 finishes the step it is in (ends at 34 ms, which also ends its 3-token request); the switch
    # costs 5 + 1 + 0 ms; 1x2 runs the last request's 3 remaining tokens at 7 ms.
    assert r.latency_s == pytest.approx((34 + 6 + 21) / 1e3)
    (ev,) = r.reconfigs
    assert (str(ev.src), str(ev.dst), ev.method, ev.requested) == ("2x1", "1x2", "migrate", "auto")
    # the event is the engine's: its step clock (+1 per replica step: 3 + 2, +1 for the switch) and the time
    # the switch committed (34 + 6 ms)
    assert (ev.requests_running, ev.requests_waiting, ev.step) == (1, 0, 6)
    assert ev.predicted_ms == pytest.approx(6.0) and ev.time_s == pytest.approx(0.040)
    assert ev.kv_bytes_moved == 12 * 1024 // 2  # prompt 10 + 2 generated; TP 1 -> 2 moves half the heads
    free = sim.run(
        Layout(2, 1), name="s", controller=ScheduleController([(2, Layout(1, 2))]), free_switches=True
    )
    assert free.latency_s == pytest.approx(r.latency_s - r.switch_ms / 1e3)
    assert [x[2] for x in r.timeline][-1] == 2


def check_timeline(r: SimResult, tps: set[int]) -> None:
    times = [x[0] for x in r.timeline]
    left = [x[1] for x in r.timeline]
    assert times == sorted(times) and times[-1] <= r.latency_s + 1e-9
    assert left == sorted(left, reverse=True) and left[-1] == 0
    assert {x[2] for x in r.timeline} <= tps
    assert 0 < r.gpu_busy <= 1.0 + 1e-9


@pytest.fixture(scope="module")
def llama() -> LatencyModel:
    return LatencyModel(modelled.build(modelled.LLAMA_31_8B, "llama"))


@pytest.mark.parametrize(
    ("name", "prompts", "admission"), [("deepscaler-8k", 16, "engine"), ("sparse-tail", 32, "sglang")]
)
def test_references_order_and_timelines(llama: LatencyModel, name: str, prompts: int, admission: str) -> None:
    wl = synthetic(name, 1, prompts=prompts)
    prev = synthetic(name, 1001, prompts=prompts)
    cfg = SimConfig(
        8, admission=admission, prior=Prior.from_samples(prev.lengths, prev.caps), oracle_replays=12
    )
    policies = [
        "static:1",
        "static:2",
        "static:4",
        "static:8",
        "adaptive",
        "oracle",
        "free-switch",
        "tail-bound",
    ]
    res = simulate(llama, wl, cfg, policies)
    assert list(res) == policies
    for p in policies[:5]:
        assert res["tail-bound"].latency_s <= res["free-switch"].latency_s <= res["oracle"].latency_s
        assert res["oracle"].latency_s <= res[p].latency_s + 1e-12, p
        check_timeline(res[p], {1, 2, 4, 8})
    assert all(not r.reconfigs for p, r in res.items() if p.startswith("static"))


def test_oracle_reports_a_replayable_chain(llama: LatencyModel) -> None:
    wl = synthetic("cap-mass-10", 2, prompts=8)
    sim = Simulator(llama, wl, SimConfig(8, oracle_replays=10))
    statics = [sim.run(Layout.for_tp(8, t), name=f"static:{t}") for t in (1, 2, 4, 8)]
    blind = oracle(sim, statics)
    clairvoyant = oracle(sim, [*statics, blind], balance="length")
    assert clairvoyant.latency_s <= blind.latency_s <= min(r.latency_s for r in statics)
    if blind.detail.startswith("chain"):  # the search won: its chain, replayed, gives its latency
        start, *steps = blind.detail.split(" (")[0].removeprefix("chain ").split(" -> ")
        schedule = [(int(s.split("@")[1]), Layout.parse(s.split("@")[0])) for s in steps]
        ctl = ScheduleController(schedule, balance="count")
        assert sim.run(Layout.parse(start), name="x", controller=ctl).latency_s == pytest.approx(
            blind.latency_s
        )


class _Watched(AdaptiveController):
    """The adaptive controller, also recording when the first request longer than ``cut`` finishes."""

    cut, first_long_done = 3000, math.inf

    def on_finish(self, sim: Simulator, t_ms: float) -> Switch | None:
        if math.isinf(self.first_long_done) and ((sim.req.status == DONE) & (sim.lengths > self.cut)).any():
            self.first_long_done = t_ms
        return super().on_finish(sim, t_ms)


def test_adaptive_does_not_peek_at_lengths(llama: LatencyModel) -> None:
    """Two workloads that agree on every request shorter than 3,000 tokens (the others are 2,000 longer
    in the second): identical decisions until the first long request finishes."""
    base = synthetic("deepscaler-8k", 4, prompts=16)
    longer = np.where(base.lengths > 3000, np.minimum(base.lengths + 2000, base.caps), base.lengths)
    other = Workload("other", longer, base.prompt_lens, base.caps)
    runs, cuts = [], []
    for wl in (base, other):
        sim = Simulator(llama, wl, SimConfig(8))
        ctl = _Watched(sim.policy(), None, 250.0)
        sim.run(Layout(4, 2), name="adaptive", controller=ctl)
        runs.append(list(zip(ctl.times, ctl.decisions, strict=True)))
        cuts.append(ctl.first_long_done)
    assert cuts[0] < cuts[1]  # nothing differs before the first long request of the first finishes ...
    before = [[(t, d) for t, d in run if t < cuts[0]] for run in runs]
    assert len(before[0]) > 50 and before[0] == before[1]  # ... and the planner saw no difference
    assert runs[0] != runs[1]


def test_bad_policies_and_config() -> None:
    assert parse_policies("static:1, adaptive,oracle,tail-bound", 8) == [
        "static:1",
        "adaptive",
        "oracle",
        "tail-bound",
    ]
    with pytest.raises(UserError, match="item 2") as err:
        parse_policies("static:1,fast", 8)
    assert err.value.field == "policies"
    with pytest.raises(UserError, match="TP 3 does not divide 8"):
        parse_policies("static:3", 8)
    with pytest.raises(UserError, match="no policy"):
        parse_policies(" , ", 8)
    with pytest.raises(UserError, match="engine") as err:
        SimConfig(8, admission="vllm")
    assert err.value.field == "admission"
    with pytest.raises(UserError):
        SimConfig(8, initial_layout="3y2")


def test_a_request_that_fits_no_replica_is_refused() -> None:
    prof = profile({1: (10.0, 5.0), 2: (6.0, 3.0)}, {1: 10, 2: 100})
    sim = Simulator(LatencyModel(prof), workload([5, 5], prompt=10, cap=20), SimConfig(2))
    assert sim.candidates() == [Layout(1, 2)]  # 2x1 holds 10 tokens, a request reserves 30
    with pytest.raises(UserError, match="does not fit"):
        sim.run(Layout(2, 1), name="static:1")


def test_the_adaptive_controller_runs_the_operators_tick_a_new_wave_shrinks() -> None:
    """The policy does not allow shrinking, but the pod starts consolidated (1x2) with a wave waiting (two
    run at a time): the operator's tick treats a queue of requests that never ran, before any switch, as a
    new wave and moves back to 2x1, which runs four at a time. A controller that called the planner directly
    never shrank."""
    prof = profile({1: (10.0, 5.0), 2: (6.0, 3.0)})
    wl = workload([50] * 16, cap=50)
    cfg = SimConfig(2, admission="engine", max_batch=2, initial_layout="1x2")
    sim = Simulator(LatencyModel(prof), wl, cfg)
    assert not sim.policy().allow_shrink
    r = run_adaptive(sim)
    assert [(str(e.src), str(e.dst)) for e in r.reconfigs][:1] == [("1x2", "2x1")]
    assert r.latency_s < sim.run(Layout(1, 2), name="static:2").latency_s


def test_the_cooldown_runs_from_the_commit_of_a_switch() -> None:
    """Two long requests on 2x1: 1x2 pays at once; the switch costs 106 ms (100 ms of graph capture). With a
    45 ms cooldown every tick in the 45 ms after the switch *committed* keeps for the cooldown, as in the
    operator, whose engine reports the switch when it commits (a cooldown counted from the decision would
    be over before the switch ends)."""
    costs = replace(COSTS, graph_capture_ms=100.0)
    prof = replace(profile({1: (10.0, 5.0), 2: (6.0, 3.0)}), costs=costs)
    sim = Simulator(LatencyModel(prof), workload([400, 400]), SimConfig(2, admission="engine"))
    ctl = AdaptiveController(replace(sim.policy(), cooldown_s=0.045), None, 10.0)
    r = sim.run(Layout(2, 1), name="adaptive", controller=ctl)
    (ev,) = r.reconfigs
    assert ev.predicted_ms == pytest.approx(106.0)
    assert ev.time_s == pytest.approx((ctl.times[0] + ev.predicted_ms) / 1e3)  # decided at the first tick
    after = [(t - ev.time_s * 1e3, d.reason) for t, d in zip(ctl.times, ctl.decisions, strict=True)][1:]
    assert [dt for dt, why in after if why.startswith("cooldown")] == pytest.approx([10.0, 20.0, 30.0, 40.0])


def test_the_pod_state_reports_each_finished_length_once() -> None:
    """What the controller reads is what an engine reports: the lengths finished since a step, each once."""
    lengths = [3, 9, 5, 7, 2, 8, 4]
    sim = Simulator(LatencyModel(profile({1: (10.0, 5.0), 2: (6.0, 3.0)})), workload(lengths), SimConfig(2))
    ctl = AdaptiveController(sim.policy(), None, 7.0)
    r = sim.run(Layout(2, 1), name="adaptive", controller=ctl)
    last = sim.state(r.latency_s * 1e3, ctl.memory.since_step)
    assert 0 < len(ctl.memory.lengths) < len(lengths)
    assert sorted(ctl.memory.lengths + last.finished.lengths) == sorted(lengths)
    assert last.finished.total == len(lengths) and not any(r.running or r.waiting for r in last.replicas)


def test_paged_skips_only_steps_that_admit_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """While requests wait, ``paged`` asks the engine's admission only from the step where a bound says it
    might admit: the run is the one that asks at every step (same retractions, same time but for how
    segments split the step latency's context). The case admits between completions too: asking only when
    a request finishes gives another run."""
    prof = profile({1: (10.0, 5.0), 2: (6.0, 3.0)}, {1: 300, 2: 600})
    lengths = np.clip(np.round(np.random.default_rng(5).lognormal(np.log(30), 1.0, 64)), 2, 200).astype(int)
    wl = Workload("tail", lengths, np.full(64, 12), lengths)  # max_new_tokens = length, as the engine's tests
    cfg = SimConfig(2, admission="paged", max_batch=16, page_size=4)
    real = Admission._steps_admitting_none

    def run(steps: Any) -> SimResult:
        monkeypatch.setattr(Admission, "_steps_admitting_none", steps)
        return Simulator(LatencyModel(prof), wl, cfg).run(Layout(2, 1), name="x")

    skipped: list[int] = []

    def bound(self: Admission, *args: Any) -> int:
        skipped.append(real(self, *args))
        return skipped[-1]

    fast, every, at_ends = run(bound), run(lambda *_: 1), run(lambda *_: 1 << 40)
    assert max(skipped) > 1, "the bound never skipped a step: the case does not test it"
    assert fast.preemptions == every.preemptions
    assert fast.latency_s == pytest.approx(every.latency_s, rel=1e-9)
    assert at_ends.latency_s != pytest.approx(every.latency_s, rel=1e-6)


def test_progress_hears_every_run_as_it_goes() -> None:
    """Each event of each run: its name, simulated ms in order, unfinished requests down to the last one
    (what `rolloutctl simulate` prints while a long run goes on)."""
    heard: list[tuple[str, float, int]] = []
    model = LatencyModel(profile({1: (10.0, 5.0), 2: (6.0, 3.0)}))
    cfg = SimConfig(2, admission="engine")
    simulate(model, workload([4, 2, 1, 2]), cfg, ["static:1", "adaptive"], lambda *e: heard.append(e))
    for run in ("static:1", "adaptive"):
        events = [(t, left) for name, t, left in heard if name == run]
        assert events[0] == (events[0][0], 4) and events[-1][1] == 1, events
        times = [t for t, _ in events]
        assert times == sorted(times) and times[-1] > 0
        lefts = [left for _, left in events]
        assert lefts == sorted(lefts, reverse=True)


def test_default_policies_follow_the_gpus_and_the_profile() -> None:
    default_policies = sim_run.default_policies
    assert default_policies(2, [1, 2, 4, 8]) == [
        "static:1", "static:2", "adaptive", "oracle", "free-switch", "tail-bound"
    ]  # fmt: skip
    assert default_policies(6, [1, 2, 4, 8])[:3] == ["static:1", "static:2", "adaptive"]  # 3, 6 not profiled
    assert default_policies(8, [1, 2, 4, 8])[:4] == ["static:1", "static:2", "static:4", "static:8"]


def test_a_probed_adaptive_run_is_the_adaptive_run(llama: LatencyModel) -> None:
    """The probes (the planner asked how long the pod will take, forks played to the end) change nothing in
    the run: ``bench planner`` takes the probed run as the adaptive one."""
    wl = synthetic("deepscaler-8k", 2, prompts=16)
    prev = synthetic("deepscaler-8k", 1002, prompts=16)
    prior = Prior.from_samples(prev.lengths, prev.caps)
    cfg = SimConfig(8, admission="paged", prior=prior, initial_layout="8x1")  # TP1 first: it will switch
    plain = run_adaptive(Simulator(llama, wl, cfg))
    probed, probes = probed_adaptive(Simulator(llama, wl, cfg), (0.2, 0.5))
    assert len(probes) == 2 and plain.reconfigs  # probed at both times, and the run switched
    assert probed.latency_s == plain.latency_s and probed.preemptions == plain.preemptions
    assert [(e.step, e.dst) for e in probed.reconfigs] == [(e.step, e.dst) for e in plain.reconfigs]
