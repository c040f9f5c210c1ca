"""The server's routes, one `APIRouter` per resource; `spindle.serve.app.create_app` includes them.

  health.py   GET  /health
  models.py   GET  /v1/models, /v1/models/{id}
  images.py   POST /v1/images/generations
  edits.py    POST /v1/images/edits (image-editing families: multipart image upload(s))
  videos.py   POST/GET /v1/videos, GET /v1/videos/{id}, GET /v1/videos/{id}/content, DELETE /v1/videos/{id}
  adapters.py GET/POST /v1/loras, GET/DELETE /v1/loras/{name} (+ SGLang-diffusion's /v1/set_lora, /v1/list_loras)

A route reaches the engine, the store and the limits through the `State` dependency
(`spindle.serve.state`), turns a body into a validated request with `spindle.serve.params.sampling_params`
(the one mapping) and raises `spindle.serve.errors.APIError` for a refusal. A new resource is a new module
here plus one line in `ROUTERS` (as `edits.py`, `POST /v1/images/edits`, and `adapters.py`, the
run-time LoRA adapters, were added).
"""

from __future__ import annotations

from spindle.serve.routes.adapters import router as adapters_router
from spindle.serve.routes.edits import router as edits_router
from spindle.serve.routes.health import router as health_router
from spindle.serve.routes.images import router as images_router
from spindle.serve.routes.models import router as models_router
from spindle.serve.routes.videos import router as videos_router

ROUTERS = (health_router, models_router, images_router, edits_router, videos_router, adapters_router)
