"""The planner's endpoints: the engine's state, a forward plan executed at the step a trigger fires, an
immediate switch, and the history of switches. Schemas: ``rollout_worker.api.state`` / ``api.plan``."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request

from rollout_worker.api.plan import Plan, ReconfigEvent
from rollout_worker.api.state import EngineState, PlanResponse, ReconfigureRequest, ReconfigureResponse
from rollout_worker.server.deps import server_state

router = APIRouter(prefix="/v1", tags=["planner"])


@router.get("/state", response_model=EngineState, summary="Layout, requests per replica, finished lengths")
async def get_state(request: Request, since_step: int = Query(0, ge=0)) -> EngineState:
    return server_state(request).ready_engine().state(since_step)


@router.put(
    "/plan",
    response_model=PlanResponse,
    summary="Replace the plan (409 when based_on_layout is not the current layout)",
    responses={409: {"description": "The engine's layout changed since the plan was made"}},
)
async def put_plan(body: Plan, request: Request) -> PlanResponse:
    engine = server_state(request).ready_engine()
    engine.set_plan(body if body.triggers else None)
    state = engine.state()
    n = len(body.triggers)
    return PlanResponse(plan=state.plan, layout=state.layout, message=f"plan of {n} trigger(s) accepted")


@router.post(
    "/reconfigure",
    response_model=ReconfigureResponse,
    summary="Switch layout at the next step boundary (cancels the plan), also while paused (the paused "
    "requests move and stay paused); answers with the event",
)
async def post_reconfigure(body: ReconfigureRequest, request: Request) -> ReconfigureResponse:
    state = server_state(request)
    engine = state.ready_engine()
    event = await state.bridge.call(engine.reconfigure, body.layout, body.method)
    if event is None:
        return ReconfigureResponse(event=None, layout=engine.layout, message=f"already in {body.layout}")
    msg = f"{event.src} -> {event.dst} {event.outcome}" + (f": {event.error}" if event.error else "")
    return ReconfigureResponse(event=event, layout=engine.layout, message=msg)


@router.get("/reconfigurations", response_model=list[ReconfigEvent], summary="Every switch so far")
async def get_reconfigurations(request: Request) -> list[ReconfigEvent]:
    return server_state(request).ready_engine().reconfigurations()
