"""`POST /v1/images/generations` with an image family (the tiny Flux checkpoint) over real HTTP,
including the official openai client's `images.generate(...)`."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from spindle.api import load_generator
from spindle.serve import build_app
from tests.conftest import failing_next_forward
from tests.serve.test_serve import LiveServer, assert_error


@pytest.fixture(scope="module")
def flux(tiny_flux):

    return load_generator(tiny_flux, device="cpu"), tiny_flux


@pytest.fixture(scope="module")
def server(flux):
    gen, root = flux
    with LiveServer(build_app(gen, model_id="tiny-flux", root=str(root))) as s:
        yield s


def png_array(b64: str) -> np.ndarray:
    from PIL import Image

    data = base64.b64decode(b64)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def to_uint8(frames: np.ndarray) -> np.ndarray:
    return (np.clip(frames, 0.0, 1.0) * 255.0).round().astype(np.uint8)


def test_openai_client_images_generate(server, flux):

    gen, _ = flux
    client = server.openai_client()
    out = client.images.generate(
        prompt="a lighthouse on a cliff",
        n=2,
        size="32x32",
        response_format="b64_json",
        extra_body={"num_inference_steps": 2, "seed": 4},
    )
    assert isinstance(out.created, int) and len(out.data) == 2
    images = np.stack([png_array(d.b64_json) for d in out.data])
    assert images.shape == (2, 32, 32, 3)
    ref = gen.generate(
        prompt="a lighthouse on a cliff", height=32, width=32, num_inference_steps=2, seed=4, num_outputs_per_prompt=2
    ).frames
    np.testing.assert_array_equal(images, to_uint8(ref))  # PNG is lossless: exactly the engine's output
    assert server.state.store.stats()["stored"] == 0  # image results are not kept after the response


def test_images_over_httpx_and_errors(server):
    c = server.client
    r = c.post(
        "/v1/images/generations",
        json={
            "prompt": "a red door",
            "size": "32x32",
            "num_inference_steps": 2,
            "seed": 1,
            "negative_prompt": "dark",
            "guidance_scale": 2.0,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) >= {"created", "data"} and len(body["data"]) == 1 and body["seed"] == 1
    assert png_array(body["data"][0]["b64_json"]).shape == (32, 32, 3)

    assert_error(c.post("/v1/images/generations", json={"prompt": "x", "size": "32by32"}), 400, "size")
    assert_error(c.post("/v1/images/generations", json={"prompt": "x", "size": "30x32"}), 400, "size")
    assert_error(
        c.post("/v1/images/generations", json={"prompt": "x", "response_format": "url"}), 400, "response_format"
    )
    assert_error(c.post("/v1/images/generations", json={"prompt": "x", "n": 0}), 422, "n")
    assert_error(c.post("/v1/images/generations", json={"prompt": "x", "steps": 2}), 422, "steps")
    # an image model answers /v1/videos with a pointer to the images endpoint
    err = assert_error(c.post("/v1/videos", json={"prompt": "x", "size": "32x32"}), 400, "model", "use_images_endpoint")
    assert "/v1/images/generations" in err["message"]


def test_a_failing_image_request_gets_500_and_the_next_works(server, flux):
    gen, _ = flux
    with failing_next_forward(gen.transformer):
        req = {"prompt": "a boat", "size": "32x32", "num_inference_steps": 2, "seed": 2}
        err = assert_error(server.client.post("/v1/images/generations", json=req), 500, code="generation_failed")
        assert "injected fault" in err["message"] and err["type"] == "server_error"
        assert server.client.post("/v1/images/generations", json=req).status_code == 200


def test_numeric_fields_refuse_booleans_and_numeric_strings(server):
    """`true` or `"2"` is never read as 1 or 2: a 422 naming the field (JSON is typed; forms are
    text and read leniently, see test_serve.py's openai-client test)."""
    c = server.client
    submitted = server.state.store.counters["submitted"]
    base = {"prompt": "x", "size": "32x32", "num_inference_steps": 1}
    for name in ("num_inference_steps", "n", "seed", "guidance_scale", "true_cfg_scale"):  # the last: Flux's option
        for value in (True, "2"):
            err = assert_error(c.post("/v1/images/generations", json={**base, name: value}), 422, name)
            assert err["type"] == "invalid_request_error"
    assert server.state.store.counters["submitted"] == submitted  # none of them was queued


def test_the_model_field_names_the_served_model_or_an_openai_default(server):
    c = server.client
    base = {"prompt": "a kite", "size": "32x32", "num_inference_steps": 1, "seed": 0}
    for name in ("tiny-flux", "dall-e-2", "dall-e-3", "gpt-image-1"):
        r = c.post("/v1/images/generations", json={**base, "model": name})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "tiny-flux"  # who answered: the served id, whatever alias was named
    submitted = server.state.store.counters["submitted"]
    for name in ("flux-pro", "sora-2"):  # another model; a video default on an image server
        err = assert_error(c.post("/v1/images/generations", json={**base, "model": name}), 404, "model")
        assert err["code"] == "model_not_found" and "'tiny-flux'" in err["message"] and name in err["message"]
        assert "'dall-e-3'" in err["message"]  # the names that do reach it
    assert server.state.store.counters["submitted"] == submitted  # refused before it was queued
    card = c.get("/v1/models").json()["data"][0]
    assert card["id"] == "tiny-flux" and "dall-e-3" in card["aliases"] and "sora-2" not in card["aliases"]
    assert c.get("/v1/models/dall-e-3").json()["id"] == "tiny-flux"
    assert_error(c.get("/v1/models/sora-2"), 404, "model", "model_not_found")


def test_openai_knobs_are_honoured_or_refused_never_ignored(server):
    c = server.client
    base = {"prompt": "a kite", "size": "32x32", "num_inference_steps": 1, "seed": 0}
    for quality in ("auto", "standard"):  # OpenAI's defaults: the model's own settings
        assert c.post("/v1/images/generations", json={**base, "quality": quality}).status_code == 200
    submitted = server.state.store.counters["submitted"]
    for field, value in [
        ("quality", "hd"),
        ("quality", "high"),
        ("style", "natural"),
        ("background", "transparent"),
        ("output_compression", 50),
        ("output_format", "webp"),
    ]:
        err = assert_error(c.post("/v1/images/generations", json={**base, field: value}), 400, field)
        assert err["code"] == "unsupported_parameter" and err["message"].startswith(f"{field}: ")
    err = assert_error(c.post("/v1/images/generations", json={**base, "quality": "hd"}), 400, "quality")
    assert "num_inference_steps" in err["message"]  # what to set instead
    assert server.state.store.counters["submitted"] == submitted


def test_engine_errors_name_the_openai_field(server):
    c = server.client
    err = assert_error(c.post("/v1/images/generations", json={"prompt": "x", "size": "32x32", "n": 11}), 400, "n")
    assert err["message"].startswith("n is 11;") and "num_outputs_per_prompt" not in err["message"]
    err = assert_error(c.post("/v1/images/generations", json={"prompt": "x", "size": "30x32"}), 400, "size")
    assert err["message"].startswith("size: width must be")


def test_openapi_documents_the_served_familys_options(server):
    schema = server.client.get("/openapi.json").json()
    body = schema["paths"]["/v1/images/generations"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"prompt", "n", "quality", "true_cfg_scale"} <= set(body["properties"])
