"""The planner tick (pure): an engine state -> the planner's snapshot -> a decision and the plan to push,
with a profile in which TP=2 pays in the tail; a new wave lets a consolidated pod shrink its TP size, and
requests retracted back to the queue are no new wave."""

from __future__ import annotations

from pathlib import Path

from rollout_profiler.planning.latency import LatencyModel
from rollout_profiler.planning.policy import PlannerPolicy
from rollout_profiler.planning.tick import PodMemory, snapshot, tick
from rollout_profiler.profile import Profile
from rollout_worker.api.plan import Plan, Trigger
from rollout_worker.api.state import (
    EngineState,
    FinishedLengths,
    ReplicaRequests,
    RunningRequest,
    WaitingRequest,
)
from rollout_worker.scheduling.layout import Layout

PROFILE = Path(__file__).parents[2] / "data" / "tiny-2rank-tp2-pays.json"
POLICY = PlannerPolicy(candidates=(Layout(2, 1), Layout(1, 2)), margin=0.1, min_gain_ms=5.0)


def _state(running: list[int], waiting: int = 0, layout: Layout = Layout(2, 1)) -> EngineState:
    reps = [ReplicaRequests() for _ in range(layout.replicas)]
    for i, g in enumerate(running):
        reps[i % layout.replicas].running.append(
            RunningRequest(rid=f"r{i}", prompt_len=8, generated=g, max_new_tokens=400)
        )
    for i in range(waiting):
        reps[0].waiting.append(WaitingRequest(rid=f"w{i}", prompt_len=20, max_new_tokens=50))
    return EngineState(
        layout=layout,
        step=10,
        time_s=1.0,
        ranks_ready=[True, True],
        paused=False,
        reconfiguring=False,
        replicas=reps,
        finished=FinishedLengths(since_step=0),
        weight_version="v",
        reconfigurations=0,
    )


def test_snapshot_and_tick_are_pure() -> None:
    snap = snapshot(_state([5, 6, 7], waiting=2), not_submitted=3)
    assert [len(r.generated) for r in snap.replicas] == [2, 1]
    assert [len(r.wait_generated) for r in snap.replicas] == [2, 0]  # the engine's, one by one
    assert [r.waiting for r in snap.replicas] == [2, 1]  # 3 not submitted, by number, dealt
    assert [r.unfinished for r in snap.replicas] == [6, 2]
    assert snap.waiting_prompt_len == 20 and snap.waiting_cap == 50
    model = LatencyModel(Profile.from_json(PROFILE))
    mem = PodMemory(lengths=[20, 22, 25, 30, 31, 33, 35, 40], capped=[False] * 8)
    tail = tick(_state([300]), mem, model, POLICY, None)  # one long request left: consolidate
    assert tail.decision.action == "switch" and tail.plan is not None
    assert tail.plan.based_on_layout == Layout(2, 1) and tail.plan.triggers[0].layout == Layout(1, 2)
    assert tail.decision.predicted_gain_ms > tail.decision.predicted_cost_ms * 1.1
    busy = tick(_state([1] * 16), PodMemory(), model, POLICY, None)  # a full batch: keep 2x1
    assert busy.decision.action == "keep" and busy.plan is None


def test_a_new_wave_moves_a_consolidated_pod_back_toward_throughput() -> None:
    model = LatencyModel(Profile.from_json(PROFILE))
    one = Layout(1, 2)
    # consolidated, a few requests running: shrinking is not considered
    mem = PodMemory()
    quiet = tick(_state([40, 50], layout=one), mem, model, POLICY, None)
    assert quiet.plan is None and not quiet.inputs["new_wave"]
    # a wave arrives and queues behind them: back to 2x1
    wave = tick(_state([40, 50], waiting=14, layout=one), mem, model, POLICY, None)
    assert wave.inputs["new_wave"] and wave.plan is not None
    assert wave.plan.triggers[0].layout == Layout(2, 1)
    # new weights (the next RL iteration): the first requests may move it back before any queue forms
    mem = PodMemory()
    first = _state([1] * 8, layout=one)
    mem.absorb(first)
    assert tick(first, mem, model, POLICY, None).plan is None  # same weights: no shrink
    for new_weights in ({"weight_version": "v2"}, {"weight_loads": 1}):  # renamed, or loaded: same name
        mem = PodMemory()
        mem.absorb(first)
        updated = first.model_copy(update=new_weights)
        mem.absorb(updated)
        moved = tick(updated, mem, model, POLICY, None)
        assert moved.inputs["new_wave"] and moved.plan is not None, new_weights
        assert moved.plan.triggers[0].layout == Layout(2, 1)


def _retracted(state: EngineState, n: int) -> EngineState:
    """``state`` with its first ``n`` running requests retracted: back in their replica's queue, their tokens
    kept (as the engine reports a request retracted for want of KV pages)."""
    moved = state.model_copy(deep=True)
    for rep in moved.replicas:
        back, rep.running = rep.running[:n], rep.running[n:]
        rep.waiting += [
            WaitingRequest(
                rid=r.rid, prompt_len=r.prompt_len, max_new_tokens=r.max_new_tokens, generated=r.generated
            )
            for r in back
        ]
        n -= len(back)
    return moved


def test_requests_retracted_back_to_the_queue_are_no_new_wave() -> None:
    """A consolidated pod under memory pressure: half its batch retracted goes back to the queue, which the
    old rule (any waiting request) read as a new wave and answered by shrinking; the work the pod knows is
    the same, so no wave, no shrink. A request that then arrives is one."""
    model = LatencyModel(Profile.from_json(PROFILE))
    one = Layout(1, 2)
    mem = PodMemory()
    full = _state([40 + i for i in range(16)], layout=one)
    assert not tick(full, mem, model, POLICY, None).inputs["new_wave"]
    pressed = _retracted(full, 8)
    assert sum(len(r.waiting) for r in pressed.replicas) == 8
    kept = tick(pressed, mem, model, POLICY, None)
    assert not kept.inputs["new_wave"] and kept.plan is None, kept.decision.reason
    # the same queue, made of new requests the pod did not know (the old rule's reading): a wave, a shrink
    fresh = _state([40 + i for i in range(8)], waiting=8, layout=one)
    grown = PodMemory()
    tick(_state([40 + i for i in range(8)], layout=one), grown, model, POLICY, None)
    shrunk = tick(fresh, grown, model, POLICY, None)
    assert shrunk.inputs["new_wave"] and shrunk.plan is not None
    assert shrunk.plan.triggers[0].layout == Layout(2, 1)


def test_a_held_plan_the_planner_would_no_longer_set_is_refreshed() -> None:
    """The later triggers of a pushed chain never fire on a stale prediction: on a tick that keeps the
    layout, a held plan for it whose triggers differ from the planner's fresh ones is replaced (by an
    empty plan when the planner plans nothing, e.g. in a cooldown); an unchanged one is left alone."""
    model = LatencyModel(Profile.from_json(PROFILE))
    mem = PodMemory(lengths=[20, 22, 25, 30, 31, 33, 35, 40], capped=[False] * 8)
    stale = Plan(based_on_layout=Layout(2, 1), triggers=[Trigger(unfinished_at_most=1, layout=Layout(1, 2))])
    busy = _state([1] * 16).model_copy(update={"plan": stale})  # a full batch: keep 2x1, nothing planned
    got = tick(busy, PodMemory(), model, POLICY, None)
    assert got.decision.action == "keep" and got.decision.plan == ()
    assert got.plan == Plan(based_on_layout=Layout(2, 1), triggers=[])
    fresh = tick(_state([1] * 16), PodMemory(), model, POLICY, None)
    assert fresh.plan is None  # nothing held: nothing to refresh
    other = busy.model_copy(update={"plan": stale.model_copy(update={"based_on_layout": Layout(1, 2)})})
    assert tick(other, PodMemory(), model, POLICY, None).plan is None  # held for another layout: void anyway
    tail = tick(_state([300]), mem, model, POLICY, None)  # a switch: its own plan, whatever is held
    later = stale.model_copy(update={"triggers": [Trigger(unfinished_at_most=0, layout=Layout(1, 2))]})
    held = tick(_state([300]).model_copy(update={"plan": later}), PodMemory(lengths=list(mem.lengths),
                capped=list(mem.capped)), model, POLICY, None)  # fmt: skip
    assert tail.plan is not None and held.plan == tail.plan and held.decision.action == "switch"


def test_a_held_plan_with_a_trigger_due_stands() -> None:
    """A switch the engine fires at its next step is neither taken back nor pushed again by a tick that lands
    before that step (the decision that pushed it stays the one its switch is recorded against)."""
    model = LatencyModel(Profile.from_json(PROFILE))
    due = Plan(based_on_layout=Layout(2, 1), triggers=[Trigger(unfinished_at_most=16, layout=Layout(1, 2))])
    busy = _state([1] * 16).model_copy(update={"plan": due})  # 16 unfinished: the trigger is due
    got = tick(busy, PodMemory(), model, POLICY, None)
    assert got.decision.action == "keep" and got.decision.plan == ()  # the planner would set nothing now
    assert got.plan is None  # yet the held plan stands
    mem = PodMemory(lengths=[20, 22, 25, 30, 31, 33, 35, 40], capped=[False] * 8)
    tail = _state([300]).model_copy(update={"plan": due.model_copy(update={"triggers": [
        Trigger(unfinished_at_most=1, layout=Layout(1, 2))]})})  # fmt: skip
    again = tick(tail, mem, model, POLICY, None)
    assert again.decision.action == "switch" and again.plan is None  # due: not pushed twice
    later = due.model_copy(update={"triggers": [Trigger(unfinished_at_most=15, layout=Layout(1, 2))]})
    assert tick(busy.model_copy(update={"plan": later}), PodMemory(), model, POLICY, None).plan == Plan(
        based_on_layout=Layout(2, 1), triggers=[]
    )  # not due yet: refreshed
