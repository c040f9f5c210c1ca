"""LoRA adapters loaded at run time (`spindle serve --lora-dir DIR --max-loras N`), chosen per request
with `lora` / `lora_scale` in the image and video bodies (`spindle.infer.adapters`).

  GET    /v1/loras          the loaded adapters, and what the adapter folder holds (`available`)
  POST   /v1/loras          load one: {"lora_name": NAME, "lora_path": PATH inside --lora-dir}
  GET    /v1/loras/{name}   one loaded adapter
  DELETE /v1/loras/{name}   unload it (its weights are freed); 409 while a request names it

SGLang-diffusion's names answer too: `POST /v1/set_lora` ({"lora_nickname", "lora_path"}: loads,
as POST /v1/loras; the adapter is then chosen per request, not made the server's one active
adapter) and `GET /v1/list_loras`. A path outside the adapter folder (or an adapter file linking out
of it) is refused with 403 naming it, a file that is no readable safetensors with 400 `invalid_lora`.
Loading and unloading wait for the running job (they change the model) and happen on every rank; an
unload that a request forbids (409) or a name not loaded (404) is answered at once.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request

from spindle.infer.adapters import AdapterError
from spindle.serve.errors import APIError, safe_text
from spindle.serve.schemas import LoadLoraRequest, LoraCard
from spindle.serve.state import ServeState, State, body_schema

router = APIRouter(tags=["loras"])


def api_error(e: AdapterError, param: str | None = None) -> APIError:
    return APIError(e.status, str(e), param=param, code=e.code)


def lora_list(state: ServeState) -> dict[str, Any]:
    adapters = state.engine.adapters
    return {
        "object": "list",
        "data": [LoraCard(**card).model_dump() for card in adapters.listing()] if adapters else [],
        "available": adapters.available() if adapters else [],
        "lora_dir": str(adapters.root) if adapters and adapters.root else None,
        "max_loras": adapters.max_loras if adapters else None,
    }


@router.get("/v1/loras")
async def list_loras(state: State):
    return lora_list(state)


@router.get("/v1/list_loras")  # SGLang-diffusion's name
async def list_loras_sglang(state: State):
    return lora_list(state)


async def load(request: Request, state: ServeState) -> dict[str, Any]:
    body = await state.read_request(request, LoadLoraRequest, family_options=False)
    try:
        # blocking: waits for the running job, then reads the file and injects the adapter
        adapter, evicted = await asyncio.to_thread(state.engine.load_adapter, body.lora_name, body.lora_path)
    except AdapterError as e:
        param = "lora_name" if e.code in ("invalid_lora_name", "lora_name_taken") else "lora_path"
        raise api_error(e, None if e.code in ("lora_loading_disabled", "lora_cache_full") else param) from None
    adapters = state.engine.adapters
    assert adapters is not None  # load_adapter refuses without them
    card = next(c for c in adapters.listing() if c["name"] == adapter.name)
    return {**LoraCard(**card).model_dump(), "evicted": evicted}


@router.post("/v1/loras", openapi_extra=body_schema(LoadLoraRequest))
async def load_lora(request: Request, state: State):
    return await load(request, state)


@router.post(
    "/v1/set_lora", openapi_extra=body_schema(LoadLoraRequest)
)  # SGLang-diffusion's name (lora_nickname, lora_path)
async def set_lora(request: Request, state: State):
    return await load(request, state)


@router.get("/v1/loras/{name}")
async def get_lora(name: str, state: State):
    adapters = state.engine.adapters
    for card in adapters.listing() if adapters else []:
        if card["name"] == name:
            return LoraCard(**card).model_dump()
    loaded = ", ".join(adapters.names()) if adapters else ""
    raise APIError(
        404, f"no loaded LoRA adapter named {safe_text(name)!r} (loaded: {loaded or 'none'})", code="lora_not_found"
    )


@router.delete("/v1/loras/{name}")
async def unload_lora(name: str, state: State):
    adapters = state.engine.adapters
    try:
        if adapters is not None:  # refused at once (404, 409 in use), not after the running job
            adapters.check_unload(name)
        adapter = await asyncio.to_thread(state.engine.unload_adapter, name)
    except AdapterError as e:
        raise api_error(e) from None
    return {"name": adapter.name, "object": "lora", "deleted": True}
