"""Qwen-Image served through `POST /v1/images/generations` over real HTTP: the official openai
client's `images.generate(...)` with the family's own option (`true_cfg_scale`) as a request field
generated from its declaration (its errors: tests/serve/test_serve_family_options.py)."""

from __future__ import annotations

import numpy as np
import pytest

from spindle.api import load_generator
from spindle.serve import build_app
from tests.serve.test_serve import LiveServer, assert_error
from tests.serve.test_serve_images import png_array, to_uint8


@pytest.fixture(scope="module")
def qwen(tiny_checkpoint):
    root = tiny_checkpoint("qwenimage")
    return load_generator(root, device="cpu"), root


@pytest.fixture(scope="module")
def server(qwen):
    gen, root = qwen
    with LiveServer(build_app(gen, model_id="tiny-qwen-image", root=str(root))) as s:
        yield s


def test_openai_client_images_generate_with_true_cfg(server, qwen):

    gen, _ = qwen
    client = server.openai_client()
    extra = {"num_inference_steps": 2, "seed": 4, "negative_prompt": "blurry", "true_cfg_scale": 2.5}
    out = client.images.generate(prompt="a lighthouse on a cliff", n=2, size="48x32", extra_body=extra)
    assert len(out.data) == 2
    images = np.stack([png_array(d.b64_json) for d in out.data])
    assert images.shape == (2, 32, 48, 3)
    ref = gen.generate(
        prompt="a lighthouse on a cliff",
        height=32,
        width=48,
        num_outputs_per_prompt=2,
        **extra,
    ).frames
    np.testing.assert_array_equal(images, to_uint8(ref))  # PNG is lossless: exactly the engine's output
    # the option reached the engine: the default scale (4) gives another image
    default = gen.generate(prompt="a lighthouse on a cliff", height=32, width=48, num_outputs_per_prompt=2,
                           **{**extra, "true_cfg_scale": 4.0}).frames  # fmt: skip
    assert not np.array_equal(to_uint8(default), images)


# true_cfg_scale's type, bounds and rule, and unknown options, as request fields: the shared table,
# tests/serve/test_serve_family_options.py
def test_the_schedulers_step_minimum_is_a_400_naming_the_field(server):
    body = {"prompt": "x", "size": "32x32", "num_inference_steps": 1}
    assert_error(server.client.post("/v1/images/generations", json=body), 400, "num_inference_steps")


def test_a_size_past_the_rotary_table_is_a_400_naming_size(server):
    # 4 x 28680 px: 114720 pixels, well under --max-pixels, but 7170 patch rows put the text past
    # the model's 4096 rotary positions (see test_qwenimage)
    submitted = server.state.store.counters["submitted"]
    body = {"prompt": "x", "size": "4x28680", "num_inference_steps": 2}
    err = assert_error(server.client.post("/v1/images/generations", json=body), 400, "size", "invalid_request")
    assert "height is past this model's positional range" in err["message"] and "at most 28676" in err["message"]
    assert server.state.store.counters["submitted"] == submitted  # refused before it was queued
