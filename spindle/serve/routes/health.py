"""`GET /health`: liveness, queue figures and limits (503 while shutting down or without a worker)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from spindle.serve.errors import SafeJSONResponse
from spindle.serve.state import State

router = APIRouter(tags=["health"])


@router.get("/health")
async def health(state: State) -> Response:
    ok = state.worker.alive and not state.shutting_down and not state.store.closed
    body = {
        "status": "ok" if ok else "shutting_down" if state.shutting_down else "unavailable",
        "model": state.engine.model_id,
        "media": state.engine.media,
        "queue": state.store.stats(),
        "limits": state.limits.as_dict(),
    }
    return SafeJSONResponse(body, status_code=200 if ok else 503)
