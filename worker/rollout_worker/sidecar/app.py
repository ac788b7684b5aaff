"""The sidecar's two FastAPI applications, served by one process on two ports.

API port (reading): ``GET /v1/progress``, ``/v1/state``, ``/v1/samples``, ``/v1/reconfigurations``, and
the open ``/healthz``, ``/readyz``, ``/metrics``. Admin port (changing the engine): ``PUT /v1/plan``,
``POST /v1/reconfigure``, forwarded to the engine, whose answers (409 for a stale plan, 400 for a layout it
cannot run) come back as they are. A NetworkPolicy can then keep everyone but the operator away from the
admin port.

Every route but the three open ones needs ``Authorization: Bearer <token>`` (401 without, 403 wrong); every
body and query is validated (422 naming the field); bodies over ``max_body_bytes`` get 413. Nothing from a
request is used as a file path.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Query, Request, Response, Security
from fastapi.responses import JSONResponse
from fastapi.security import HTTPBearer

from rollout_worker import __version__
from rollout_worker.api.plan import Plan, ReconfigEvent
from rollout_worker.api.sidecar import Health, Progress, SamplesPage, SidecarState
from rollout_worker.api.state import PlanResponse, ReconfigureRequest, ReconfigureResponse
from rollout_worker.sidecar.deps import Sidecar
from rollout_worker.sidecar.engine_client import EngineAnswer, EngineUnreachable
from rollout_worker.web.errors import ErrorBody, ErrorResponse, install_error_handlers
from rollout_worker.web.middleware import ApiKey, BodyLimit

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
_bearer = Security(
    HTTPBearer(auto_error=False, description="The sidecar's token: Authorization: Bearer <token>")
)
_ERR = {"model": ErrorBody}
_AUTH: dict[int | str, dict[str, Any]] = {401: _ERR, 403: _ERR, 422: _ERR}
SinceStep = Annotated[int, Query(ge=0, lt=2**63, description="Finished lengths after this engine step.")]


def _side(request: Request) -> Sidecar:
    side: Sidecar = request.app.state.sidecar
    return side


async def _unreachable(_: Request, exc: Exception) -> Response:
    """Any route that needed the engine and got no answer: 503."""
    return ErrorResponse(f"engine unreachable: {exc}", None, 503)


async def _engine_answer(_: Request, exc: Exception) -> JSONResponse:
    """The engine's own error answer, passed on as it is (status and body)."""
    assert isinstance(exc, EngineAnswer)
    return JSONResponse(exc.body, status_code=exc.status)


api = APIRouter()
protected = APIRouter(prefix="/v1", dependencies=[_bearer], responses=_AUTH)
admin = APIRouter(prefix="/v1", dependencies=[_bearer], responses=_AUTH)


@api.get("/healthz", response_model=Health, summary="The sidecar process is alive (open)")
async def healthz() -> Health:
    return Health(status="ok")


@api.get(
    "/readyz",
    response_model=Health,
    summary="200 once the engine answers and is healthy, else 503 (open)",
    responses={503: {"model": Health}},
)
async def readyz(request: Request) -> Any:
    watch = _side(request).watch
    if watch.ready:
        return Health(status="ready")
    return JSONResponse(Health(status="not ready", message=watch.problem).model_dump(), status_code=503)


@api.get("/metrics", summary="Prometheus metrics (open)", response_class=Response)
async def metrics(request: Request) -> Response:
    body, ctype = _side(request).metrics.render()
    return Response(body, media_type=ctype)


@protected.get(
    "/progress", response_model=Progress, summary="Samples done / total, engine load, layout, tokens/s"
)
async def progress(request: Request) -> Progress:
    return _side(request).progress()


@protected.get(
    "/state",
    response_model=SidecarState,
    summary="The engine's planner snapshot (since_step passed through) plus the work not submitted yet",
    responses={503: _ERR},
)
async def state(request: Request, since_step: SinceStep = 0) -> Any:
    return await _side(request).state(since_step)


@protected.get(
    "/reconfigurations",
    response_model=list[ReconfigEvent],
    summary="Every layout switch the engine made (its /v1/reconfigurations)",
    responses={503: _ERR},
)
async def reconfigurations(request: Request) -> Any:
    return await _side(request).client.call("GET", "/v1/reconfigurations")


@protected.get(
    "/samples",
    response_model=SamplesPage,
    summary="Finished samples in the order written; pass `next` back as `after` (404 in service mode)",
    responses={404: _ERR},
)
async def samples(
    request: Request,
    after: Annotated[
        int, Query(ge=0, lt=2**63, description="Samples already read (the last page's `next`).")
    ] = 0,
    limit: Annotated[int, Query(ge=1, le=1000, description="At most this many samples.")] = 100,
) -> SamplesPage:
    return _side(request).samples(after, limit)


async def _forward(request: Request, method: str, path: str, body: Any, timeout: float) -> JSONResponse:
    status, answer = await _side(request).client.forward(method, path, body, timeout)
    return JSONResponse(answer, status_code=status)


@admin.put(
    "/plan",
    response_model=PlanResponse,
    summary="Forward a plan to the engine (its 409 when based_on_layout is stale, its 400, as they are)",
    responses={400: _ERR, 409: _ERR, 503: _ERR},
)
async def put_plan(body: Plan, request: Request) -> JSONResponse:
    return await _forward(request, "PUT", "/v1/plan", body.model_dump(mode="json"), 30.0)


@admin.post(
    "/reconfigure",
    response_model=ReconfigureResponse,
    summary="Forward an immediate switch to the engine; answers with its event",
    responses={400: _ERR, 409: _ERR, 503: _ERR},
)
async def post_reconfigure(body: ReconfigureRequest, request: Request) -> JSONResponse:
    return await _forward(request, "POST", "/v1/reconfigure", body.model_dump(mode="json"), 600.0)


def _app(
    side: Sidecar, title: str, description: str, routers: list[APIRouter], open_paths: frozenset[str]
) -> FastAPI:
    app = FastAPI(title=title, version=__version__, description=description)
    app.state.sidecar = side
    for r in routers:
        app.include_router(r)
    install_error_handlers(app, validation_status=422, http_errors=True)
    app.add_exception_handler(EngineUnreachable, _unreachable)
    app.add_exception_handler(EngineAnswer, _engine_answer)
    app.add_middleware(ApiKey, key=side.token, open_paths=open_paths)
    app.add_middleware(BodyLimit, limit=side.settings.max_body_bytes)
    return app


def create_api_app(side: Sidecar) -> FastAPI:
    return _app(
        side,
        "elastic-rollout sidecar",
        "A pod's progress, the engine's state for the planner, and the finished samples.",
        [api, protected],
        OPEN_PATHS,
    )


def create_admin_app(side: Sidecar) -> FastAPI:
    return _app(
        side,
        "elastic-rollout sidecar (admin)",
        "Changing the pod's engine: plans and immediate switches, forwarded to the engine.",
        [admin],
        frozenset(),
    )
