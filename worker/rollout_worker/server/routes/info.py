"""Health, model and server information, load, and Prometheus metrics."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from rollout_worker import __version__
from rollout_worker.api.requests import RequestSpec
from rollout_worker.api.sampling import Sampling
from rollout_worker.api.sglang import MEMORY_TAGS
from rollout_worker.engine.driver.engine import Engine
from rollout_worker.engine.driver.lifecycle import Status
from rollout_worker.server.deps import ServerState, server_state

router = APIRouter(tags=["sglang info"])


def _health(state: ServerState) -> tuple[int, dict[str, Any]]:
    status = Status() if state.engine is None else state.engine.status  # one immutable value, no lock
    body: dict[str, Any] = {"status": status.health.value}
    if status.failure:
        body["message"] = status.failure
    elif state.loading is not None:
        body["message"] = f"loading {state.loading}"
    elif state.engine is not None and status.serving:
        body.update(_doing(state.engine))
    ok = status.serving and state.exit_code is None and state.loading is None
    return (200 if ok else 503), body


def _doing(engine: Engine) -> dict[str, Any]:
    """What a serving engine is doing besides generating: paused, memory released, trainers' groups being
    joined (each read without a lock: immutable values)."""
    out: dict[str, Any] = {}
    said = []
    if engine.paused is not None:
        out["paused"] = engine.paused
        said.append(f"paused ({engine.paused})")
    if engine.released:
        out["memory_released"] = list(engine.released)
        said.append(f"memory released ({', '.join(engine.released)})")
    now = time.monotonic()
    joins = [
        {
            "group_name": j.group_name,
            "master_address": j.master_address,
            "master_port": j.master_port,
            "waited_s": round(now - j.since, 1),
            "timeout_s": j.timeout_s,
        }
        for j in engine.joining
    ]
    if joins:
        out["joining_weight_update_groups"] = joins
        said += [
            f"joining weight update group {j['group_name']!r} at {j['master_address']}:{j['master_port']} "
            f"({j['waited_s']:g} s of {j['timeout_s']:g} s)"
            for j in joins
        ]
    if said:
        out["message"] = "serving; " + "; ".join(said)
    return out


@router.get(
    "/health",
    summary="200 when every rank serves (the body says what else it does: paused, memory released, joining "
    "a trainer's group); 503 while starting or failed",
)
async def health(request: Request) -> JSONResponse:
    code, body = _health(server_state(request))
    return JSONResponse(body, status_code=code)


@router.get("/health_generate", summary="Like /health, and the engine generates one token")
async def health_generate(request: Request) -> JSONResponse:
    state = server_state(request)
    code, body = _health(state)
    if code != 200:
        return JSONResponse(body, status_code=code)
    engine = state.ready_engine()
    snap = engine.snapshot()
    if snap.paused is not None or snap.unfinished:
        return JSONResponse({**body, "message": "serving requests"})  # busy ranks are alive ranks
    if engine.released:  # alive, and not to generate until /resume_memory_occupation
        return JSONResponse(body)
    rid = f"health-{uuid.uuid4().hex}"
    q = state.bridge.open([rid])
    try:
        engine.submit(RequestSpec(rid, (0,), 1, Sampling(), ignore_eos=True))
    except BaseException:
        state.bridge.close(q, [rid], abort=False)
        raise
    try:
        while (await asyncio.wait_for(q.get(), timeout=20.0)).finish is None:
            pass
    except TimeoutError:
        return JSONResponse({"status": "unhealthy", "message": "no token in 20 s"}, status_code=503)
    finally:
        state.bridge.close(q, [rid])
    return JSONResponse(body)


def _model_info(state: ServerState) -> dict[str, Any]:
    eng = state.engine
    return {
        "model_path": str(state.settings.model),
        "served_model_name": state.model_name,
        "tokenizer_path": str(state.settings.model) if state.codec else None,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": eng.weight_version if eng else "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
    }


@router.get("/get_model_info", summary="Model path, tokenizer, weight version")
@router.get("/model_info", include_in_schema=False)  # SGLang 0.5's name
async def get_model_info(request: Request) -> dict[str, Any]:
    return _model_info(server_state(request))


def _server_info(state: ServerState) -> dict[str, Any]:
    s, cfg, eng = state.settings, state.cfg, state.engine
    layout = eng.layout if eng else cfg.layout
    graphs = cfg.engine.cuda_graphs and cfg.engine.device == "cuda"
    spec = cfg.engine.speculative_algorithm
    return {
        "model_path": str(s.model),
        "tokenizer_path": str(s.model),
        "served_model_name": state.model_name,
        "tp_size": layout.tp,
        "dp_size": layout.replicas,
        "pp_size": 1,
        "ep_size": 1,
        "nnodes": 1,
        "layout": str(layout),
        "candidate_layouts": [str(x) for x in cfg.candidates],
        "ranks": cfg.world,
        "num_gpus": cfg.world,  # SGLang's: the engine's devices (slime sizes its weight-update group by it)
        "dtype": cfg.dtype,
        "device": cfg.engine.device,
        "context_length": cfg.engine.context_length,
        "max_running_requests": cfg.engine.max_batch * layout.replicas,
        "kv_budget_tokens_per_replica": cfg.engine.kv_budget_tokens,
        "page_size": cfg.engine.page_size,
        # SGLang's field: tokens of the KV pool of one scheduler (here: of one replica)
        "max_total_num_tokens": cfg.engine.pool_tokens,
        "max_req_input_len": cfg.engine.context_length - 1,
        "enable_memory_saver": s.enable_memory_saver,  # a setting, as SGLang's (release / resume work anyway)
        "memory_tags": list(MEMORY_TAGS),
        "memory_released": list(eng.released) if eng else [],
        # per rank, the bytes it held once started and after each release / resume (None: not said yet)
        "memory_held": [
            None if h is None else {"weights_bytes": h.weights_bytes, "kv_cache_bytes": h.kv_cache_bytes}
            for h in (eng.memory_held if eng else ())
        ],
        "disable_cuda_graph": not graphs,
        "enable_deterministic_inference": cfg.engine.deterministic,  # SGLang's name of the setting
        "cuda_graph_max_bs": cfg.engine.max_batch if graphs else None,
        "host": s.host,
        "port": s.port,
        "weight_version": eng.weight_version if eng else "default",
        "rank_pids": eng.rank_pids if eng else [],
        "speculative_algorithm": None if spec == "none" else spec.upper(),  # SGLang's spelling: NGRAM
        "speculative_num_draft_tokens": cfg.engine.speculative_num_draft_tokens if spec != "none" else None,
        "internal_states": [
            {
                "layout": str(layout),
                # tokens a request's verify step emitted on average (None: none yet, or no speculation)
                "avg_spec_accept_length": eng.snapshot().spec_accept_length if eng else None,
                **state.metrics.state(),
            }
        ],
        "version": __version__,
        "engine": "elastic-rollout",
    }


@router.get("/get_server_info", summary="Server arguments, current TP size (tp_size) and replicas (dp_size)")
@router.get("/server_info", include_in_schema=False)  # SGLang 0.5's name
async def get_server_info(request: Request) -> dict[str, Any]:
    return _server_info(server_state(request))


@router.get("/get_load", summary="Per replica: running and waiting requests, KV tokens held")
async def get_load(request: Request) -> list[dict[str, Any]]:
    snap = server_state(request).ready_engine().snapshot()
    return [
        {"dp_rank": d, "num_reqs": r.running, "num_waiting_reqs": r.waiting, "num_tokens": r.kv_used}
        for d, r in enumerate(snap.replicas)
    ]


@router.get("/v1/loads", summary="Load snapshot (SGLang 0.5 shape)")
async def v1_loads(request: Request) -> dict[str, Any]:
    state = server_state(request)
    snap = state.ready_engine().snapshot()
    used, cap = snap.kv_used, snap.kv_allocated
    loads = [
        {
            "dp_rank": d,
            "num_running_reqs": r.running,
            "num_waiting_reqs": r.waiting + (snap.queued if d == 0 else 0),
            "num_total_reqs": r.running + r.waiting,
        }
        for d, r in enumerate(snap.replicas)
    ]
    return {
        "timestamp": time.time(),
        "version": __version__,
        "num_accelerators": state.cfg.world,
        "loads": loads,
        "num_used_tokens": used,
        "token_usage": used / cap if cap else 0.0,
    }


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    body, ctype = server_state(request).metrics.render()
    return Response(body, media_type=ctype)
