"""SGLang's control endpoints: abort, pause / continue, flush, weight updates, memory release, the external
corpus of speculative decoding. Every one
answers with a JSON body (slime calls ``.json()`` on them)."""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from rollout_worker.api.load_format import BUCKET
from rollout_worker.api.sglang import (
    MEMORY_TAGS,
    AbortRequest,
    AddCorpusRequest,
    MemoryRequest,
    PauseRequest,
    RemoveCorpusRequest,
    UpdateTensorRequest,
    UpdateWeightsRequest,
    WeightVersionRequest,
)
from rollout_worker.config.model_config import ModelConfig
from rollout_worker.errors import Forbidden, UserError
from rollout_worker.server import tensor_update
from rollout_worker.server.deps import ServerState, server_state

router = APIRouter(tags=["sglang control"])


@router.post("/abort_request", summary="Abort one request (rid) or all (abort_all)")
async def abort_request(body: AbortRequest, request: Request) -> dict[str, Any]:
    engine = server_state(request).ready_engine()
    if body.abort_all:
        n = engine.abort(None, "aborted by abort_request")
    else:
        n = engine.abort(body.rid, "aborted by abort_request") if body.rid else 0
    return {"success": True, "aborted": n, "message": f"aborted {n} request(s)"}


@router.post("/pause_generation", summary="Pause: abort, retract (KV dropped) or in_place")
async def pause_generation(request: Request, body: PauseRequest | None = None) -> dict[str, Any]:
    mode = (body or PauseRequest()).mode
    server_state(request).ready_engine().pause(mode)
    return {"message": f"Generation paused (mode {mode})", "status": "ok"}


@router.post("/continue_generation", summary="Continue after a pause")
async def continue_generation(request: Request) -> dict[str, Any]:
    server_state(request).ready_engine().resume()
    return {"message": "Generation continued", "status": "ok"}


@router.api_route("/flush_cache", methods=["GET", "POST"], summary="Flush (400 while requests are in flight)")
async def flush_cache(request: Request) -> JSONResponse:
    state = server_state(request)
    engine = state.ready_engine()
    busy = engine.snapshot().unfinished
    if busy:
        msg = f"Cache not flushed: {busy} request(s) in flight"
        return JSONResponse({"success": False, "message": msg}, status_code=400)
    await state.bridge.call(engine.flush_cache)
    return JSONResponse({"success": True, "message": "Cache flushed."})


@router.post("/add_external_corpus", summary="Add documents speculative decoding drafts from")
async def add_external_corpus(body: AddCorpusRequest, request: Request) -> dict[str, Any]:
    state = server_state(request)
    engine = state.ready_engine()
    if state.codec is None:
        raise UserError("the model has no tokenizer: documents cannot be tokenized", "documents")
    codec, corpus_id = state.codec, body.corpus_id or f"corpus-{uuid.uuid4().hex[:12]}"

    def add() -> int:  # in a worker thread: tokenizing a large corpus must not hold up other requests
        return engine.add_corpus(corpus_id, [codec.encode(text) for text in body.documents])

    loaded = await state.bridge.call(add)
    return {
        "success": True,
        "corpus_id": corpus_id,
        "loaded_token_count": loaded,
        "message": f"added {len(body.documents)} document(s), {loaded} tokens",
    }


@router.post("/remove_external_corpus", summary="Drop an external corpus")
async def remove_external_corpus(body: RemoveCorpusRequest, request: Request) -> dict[str, Any]:
    state = server_state(request)
    engine = state.ready_engine()
    await state.bridge.call(lambda: engine.remove_corpus(body.corpus_id))
    return {"success": True, "message": f"removed corpus {body.corpus_id!r}"}


@router.get("/list_external_corpora", summary="The external corpora held, with their tokens")
async def list_external_corpora(request: Request) -> dict[str, Any]:
    return {"success": True, "corpus_token_counts": server_state(request).ready_engine().corpora()}


def _checkpoint_in_root(state: ServerState, raw: str) -> Path:
    """The checkpoint path, refused (403) unless it resolves below the weights root. A path outside gets
    the same answer whatever is there, and the answer does not say where the root is."""
    root = state.weights_root
    path = Path(raw).resolve()
    if os.path.commonpath([root, path]) != str(root):
        raise Forbidden(f"{raw} is outside the weights root (--weights-root)", "model_path")
    try:
        if not (path / "config.json").is_file():
            raise UserError(f"{raw} has no config.json", "model_path")
        new = ModelConfig.load(path)
    except OSError as exc:
        raise UserError(f"{raw}: {exc.strerror}", "model_path") from None
    except UserError as exc:
        raise exc.with_field("model_path") from None
    if _shape(new) != _shape(state.cfg.model):
        raise UserError(f"{raw} is a different model shape than the one being served", "model_path")
    return path


def _shape(c: ModelConfig) -> tuple[object, ...]:
    return (c.architecture, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.vocab_size)


@router.post(
    "/update_weights_from_disk",
    summary="Load new weights between steps (below --weights-root); while paused at once, the paused "
    "requests going on with them after continue",
)
async def update_weights_from_disk(body: UpdateWeightsRequest, request: Request) -> dict[str, Any]:
    state = server_state(request)
    path = _checkpoint_in_root(state, body.model_path)
    engine = state.ready_engine()
    async with state.weights_lock:
        waited = await state.bridge.call(
            engine.update_weights, str(path), body.weight_version, body.abort_all_requests
        )
        state.weights_path = path
    return {
        "success": True,
        "message": f"weights loaded from {path} (version {engine.weight_version})",
        "num_paused_requests": waited,
    }


@router.post("/update_weights_from_tensor", summary="Load named full tensors a trainer sends (VeRL, slime)")
async def update_weights_from_tensor(body: UpdateTensorRequest, request: Request) -> dict[str, Any]:
    state = server_state(request)
    engine = state.ready_engine()
    model = state.cfg.model
    tensors = await asyncio.to_thread(
        tensor_update.decode,
        body.serialized_named_tensors,
        state.settings.trust_pickled_tensors,
        body.load_format == BUCKET,
    )
    tensor_update.check(tensors, model)
    async with state.weights_lock:
        staged = await asyncio.to_thread(state.staging.stage, state.served_weights, model, tensors)
        waited = await state.serve_staged(
            staged, lambda: engine.update_weights(str(staged), body.weight_version, body.abort_all_requests)
        )
    return {
        "success": True,
        "message": f"{len(tensors)} tensor(s) loaded (version {engine.weight_version})",
        "num_paused_requests": waited,
    }


@router.get("/get_weight_version", summary="The version of the weights being served")
async def get_weight_version(request: Request) -> dict[str, Any]:
    return {"weight_version": server_state(request).ready_engine().weight_version}


@router.post("/update_weight_version", summary="Name the weights being served (aborts all by default)")
async def update_weight_version(body: WeightVersionRequest, request: Request) -> dict[str, Any]:
    state = server_state(request)
    engine = state.ready_engine()
    await state.bridge.call(engine.set_weight_version, body.new_version, body.abort_all_requests)
    return {
        "success": True,
        "message": f"Weight version updated to {body.new_version}",
        "new_version": body.new_version,
    }


async def _memory(request: Request, body: MemoryRequest | None, release: bool) -> dict[str, Any]:
    tags = tuple((body.tags if body else None) or MEMORY_TAGS)  # cuda_graph: graphs go with what they address
    state = server_state(request)
    engine = state.ready_engine()
    await state.bridge.call(engine.release_memory if release else engine.resume_memory, tags)
    return {"success": True, "message": f"{'released' if release else 'resumed'} {', '.join(tags)}"}


@router.post(
    "/release_memory_occupation",
    summary="Free weights and/or KV cache memory on every rank (400 while requests are in flight); new "
    "requests are refused (503) until the resume",
)
async def release_memory_occupation(request: Request, body: MemoryRequest | None = None) -> dict[str, Any]:
    return await _memory(request, body, release=True)


@router.post("/resume_memory_occupation", summary="Re-acquire released memory on every rank")
async def resume_memory_occupation(request: Request, body: MemoryRequest | None = None) -> dict[str, Any]:
    return await _memory(request, body, release=False)
