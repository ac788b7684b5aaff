"""SGLang endpoints of features this engine does not have (LoRA adapters, embedding and reward models),
answered as SGLang answers them when the feature is off: 400 and the reason, not 404. VeRL's HTTP adapter
calls them."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from rollout_worker.errors import UserError
from rollout_worker.web.errors import error_body

router = APIRouter(tags=["sglang (absent features)"])
NO_LORA = "LoRA is not supported by this engine (SGLang's --enable-lora has no counterpart here)"
NOT_EMBEDDING = (
    "this engine serves a generative model: it is not an embedding or reward model (SGLang's --is-embedding)"
)


def _lora_refused() -> JSONResponse:
    """SGLang's ``Load/UnloadLoRAAdapterReqOutput`` (``success: false``, status 400) plus our error body."""
    body: dict[str, Any] = {"success": False, "error_message": NO_LORA, "loaded_adapters": None}
    return JSONResponse({**body, **error_body(NO_LORA, None, 400)}, status_code=400)


@router.post("/load_lora_adapter", summary="LoRA: not supported (400, as SGLang without --enable-lora)")
async def load_lora_adapter() -> JSONResponse:
    return _lora_refused()


@router.post("/load_lora_adapter_from_tensors", summary="LoRA: not supported (400)")
async def load_lora_adapter_from_tensors() -> JSONResponse:
    return _lora_refused()


@router.post("/unload_lora_adapter", summary="LoRA: not supported (400)")
async def unload_lora_adapter() -> JSONResponse:
    return _lora_refused()


@router.api_route("/encode", methods=["POST", "PUT"], summary="Embeddings: not this model (400, as SGLang)")
@router.api_route("/classify", methods=["POST", "PUT"], summary="Reward scores: not this model (400)")
async def embedding() -> None:
    raise UserError(NOT_EMBEDDING)
