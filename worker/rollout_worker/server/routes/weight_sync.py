"""Weight sync from a trainer by torch.distributed, as SGLang serves it (slime's default):
``/init_weights_update_group`` -> ``/update_weights_from_distributed`` (any number) ->
``/destroy_weights_update_group``. Every engine rank r joins the trainer's group as ``rank_offset + r``,
beside its step loop (generation goes on while the ranks wait for the trainer; ``/health`` shows the join);
the trainer broadcasts full tensors; the engine stages them as a checkpoint and loads it between steps,
every rank its slice of the current layout (``rollout_worker.engine.rank.weight_sync``)."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

from fastapi import APIRouter, Request

from rollout_worker.api.load_format import BUCKET
from rollout_worker.api.sglang import (
    DestroyWeightsGroupRequest,
    DistributedUpdateRequest,
    InitWeightsGroupRequest,
)
from rollout_worker.engine import messages as m
from rollout_worker.errors import UserError
from rollout_worker.server import tensor_update
from rollout_worker.server.deps import server_state

router = APIRouter(tags=["sglang weight sync"])


@router.post(
    "/init_weights_update_group",
    summary="Every rank joins a trainer's process group, generation going on meanwhile (timeout: seconds)",
)
async def init_weights_update_group(body: InitWeightsGroupRequest, request: Request) -> dict[str, Any]:
    state = server_state(request)
    engine = state.ready_engine()
    world = state.cfg.world
    if body.rank_offset + world > body.world_size:
        raise UserError(
            f"ranks {body.rank_offset}..{body.rank_offset + world - 1} of this engine's {world} do not fit "
            f"in world_size {body.world_size}",
            "world_size",
        )
    if body.backend == "nccl" and state.cfg.engine.device == "cpu":
        raise UserError("nccl needs CUDA and this engine runs on CPU; use gloo", "backend")
    await _listening(body.master_address, body.master_port, min(JOIN_WAIT_S, body.timeout))
    await state.bridge.call(
        engine.join_weight_group,
        lambda t: m.JoinWeightGroup(
            body.master_address,
            body.master_port,
            body.rank_offset,
            body.world_size,
            body.group_name,
            body.backend,
            body.timeout,
            t,
        ),
    )
    return {"success": True, "message": f"joined weight update group {body.group_name!r}"}


@router.post("/update_weights_from_distributed", summary="Receive a trainer's broadcast and load it")
async def update_weights_from_distributed(body: DistributedUpdateRequest, request: Request) -> dict[str, Any]:
    state = server_state(request)
    engine = state.ready_engine()
    engine.check_weight_group(body.group_name)
    dtypes = tensor_update.check_announced(body.names, body.dtypes, body.shapes, state.cfg.model)
    async with state.weights_lock:
        staged, file = state.staging.stage_index(state.served_weights, state.cfg.model, body.names)
        cmd = lambda t: m.ReceiveWeights(  # noqa: E731
            body.group_name,
            tuple(body.names),
            tuple(dtypes),
            tuple(tuple(s) for s in body.shapes),
            body.load_format == BUCKET,
            str(staged),
            str(file),
            t,
        )
        waited = await state.serve_staged(
            staged,
            lambda: engine.update_weights_from_group(
                body.group_name, cmd, body.weight_version, body.abort_all_requests
            ),
        )
    return {
        "success": True,
        "message": f"{len(body.names)} tensor(s) received and loaded (version {engine.weight_version})",
        "num_paused_requests": waited,
    }


JOIN_WAIT_S = 5.0  # how long the trainer's rendezvous may take to listen after its own init call began


async def _listening(host: str, port: int, wait_s: float) -> None:
    """The trainer's rendezvous must listen at ``host:port`` (it does within moments of the trainer's own
    init call, which it makes beside this request): else a 400 naming ``master_address`` after ``wait_s``,
    before any rank waits for a trainer that is not there."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout=1.0)
        except (socket.gaierror, UnicodeError, ValueError) as exc:  # not an address: no use waiting
            raise UserError(
                f"{host!r} is not an address this host can resolve: {exc}", "master_address"
            ) from None
        except (OSError, TimeoutError) as exc:
            if time.monotonic() >= deadline:
                raise UserError(
                    f"nothing listens at {host}:{port} (the trainer's rendezvous) after {wait_s:g} s: "
                    f"{exc or type(exc).__name__}",
                    "master_address",
                ) from None
            await asyncio.sleep(0.1)
            continue
        writer.close()
        return


@router.post("/destroy_weights_update_group", summary="Every rank leaves a trainer's process group")
async def destroy_weights_update_group(body: DestroyWeightsGroupRequest, request: Request) -> dict[str, Any]:
    state = server_state(request)
    engine = state.ready_engine()
    await state.bridge.call(engine.leave_weight_group, body.group_name)
    return {"success": True, "message": f"left weight update group {body.group_name!r}"}
