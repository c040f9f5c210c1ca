"""`GET /v1/models` and `GET /v1/models/{id}`: OpenAI's model shape for the one served model, plus its
family, media, the OpenAI default names that also reach it (`aliases`) and the server's limits."""

from __future__ import annotations

from fastapi import APIRouter

from spindle.serve.params import check_model, model_aliases
from spindle.serve.schemas import ModelCard, ModelList
from spindle.serve.state import ServeState, State

router = APIRouter(tags=["models"])


def model_card(state: ServeState) -> ModelCard:
    engine = state.engine
    return ModelCard(
        id=engine.model_id,
        created=state.created,
        family=engine.family,
        media=engine.media,
        aliases=model_aliases(engine),
        root=engine.root,
        limits=state.limits.as_dict(),
    )


@router.get("/v1/models")
async def list_models(state: State):
    return ModelList(data=[model_card(state)]).model_dump()


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, state: State):
    """The served model by its id or an alias (its card has the served id); anything else is a 404."""
    check_model(model_id, state.engine)
    return model_card(state).model_dump()
