"""`POST /v1/images/edits` over real HTTP on tiny Qwen-Image-Edit models: the official openai client's
`images.edit(...)` (one image, and a list sent as `image[]`) and a repeated multipart `image` field
return exactly the engine's edit; every malformed upload is a 4xx naming the field, nothing queued;
a mask, a text-to-image model and a video model are refused naming why."""

from __future__ import annotations

import base64
import io
import re

import numpy as np
import pytest
from PIL import Image

from spindle.api import load_generator
from spindle.engine_config import RequestLimits
from spindle.serve import build_app
from spindle.serve.limits import ServeLimits
from tests.serve.test_serve import LiveServer, assert_error, live_servers
from tests.serve.test_serve_i2v import form, png_bytes
from tests.serve.test_serve_images import png_array, to_uint8

# image_area 64x64: the references are small (the pipelines' 1024x1024 costs seconds on a CPU)
EXTRA = {"num_inference_steps": 2, "seed": 3, "image_area": 64 * 64}
KW = {"prompt": "make the circle red", "size": "64x32", **EXTRA}


@pytest.fixture(scope="module")
def plus(tiny_checkpoint):
    root = tiny_checkpoint("qwenimage_edit_plus")
    return load_generator(root, device="cpu"), root


@pytest.fixture
def serve(plus):
    gen, root = plus
    with live_servers(gen, root, "tiny-qwen-image-edit-plus") as start:
        yield start


def engine_edit(gen, images, **kw):
    """What the engine generates for the same edit (the server must answer exactly this, as PNGs)."""
    pil = [Image.open(io.BytesIO(b)) for b in images]
    params = {"height": 32, "width": 64, **EXTRA, **kw}
    return to_uint8(gen.generate(prompt=KW["prompt"], image=pil, **params).frames)


def test_openai_client_images_edit_one_and_several_images(serve, plus):

    gen, _ = plus
    s = serve()
    client = s.openai_client()
    first, second = png_bytes(0), png_bytes(1, (48, 32))
    one = client.images.edit(
        image=("a.png", first, "image/png"),
        prompt=KW["prompt"],
        size="64x32",
        response_format="b64_json",
        extra_body=EXTRA,
    )
    np.testing.assert_array_equal(png_array(one.data[0].b64_json)[None], engine_edit(gen, [first]))
    # a list: the openai client sends `image[]` parts, in order
    two = client.images.edit(
        image=[("a.png", first, "image/png"), ("b.png", second, "image/png")],
        prompt=KW["prompt"],
        size="64x32",
        n=2,
        extra_body=EXTRA,
    )
    images = np.stack([png_array(d.b64_json) for d in two.data])
    expected = engine_edit(gen, [first, second], num_outputs_per_prompt=2)
    np.testing.assert_array_equal(images, expected)
    assert np.abs(expected[0].astype(int) - engine_edit(gen, [first])[0]).max() > 0  # the second image counts


def test_repeated_image_field_json_data_urls_and_the_size_from_the_image(serve, plus):
    gen, _ = plus
    s = serve()
    first, second = png_bytes(0), png_bytes(1, (48, 32))
    files = [(k, v) for k, v in form(KW).items()] + [
        ("image", ("a.png", first, "image/png")),
        ("image", ("b.png", second, "image/png")),
    ]
    r = s.client.post("/v1/images/edits", files=files)
    assert r.status_code == 200, r.text
    expected = engine_edit(gen, [first, second])
    np.testing.assert_array_equal(png_array(r.json()["data"][0]["b64_json"])[None], expected)
    urls = ["data:image/png;base64," + base64.b64encode(b).decode() for b in (first, second)]
    r = s.client.post("/v1/images/edits", json={**KW, "image": urls})
    assert r.status_code == 200, r.text
    np.testing.assert_array_equal(png_array(r.json()["data"][0]["b64_json"])[None], expected)
    # no size: the pipeline's own, from the last image (48x32 at 64x64 pixels, sides multiples of 32: 64x64)
    body = {k: v for k, v in KW.items() if k != "size"}
    r = s.client.post("/v1/images/edits", json={**body, "image": urls})
    assert r.status_code == 200, r.text
    size = r.json()["size"]
    pil = [Image.open(io.BytesIO(b)) for b in (first, second)]
    ref = gen.generate(prompt=KW["prompt"], image=pil, **EXTRA).frames
    assert size == f"{ref.shape[2]}x{ref.shape[1]}"
    np.testing.assert_array_equal(png_array(r.json()["data"][0]["b64_json"])[None], to_uint8(ref))


def upload(name="a.png", data=None, kind="image/png"):
    return ("image", (name, png_bytes(0) if data is None else data, kind))


@pytest.mark.parametrize(
    "parts, status, param, code, match",
    [
        ([upload(data=b"not a png")], 400, "image", "invalid_image", r"image: the image cannot be decoded"),
        ([upload("a.pdf", b"%PDF-1.4", "application/pdf")], 400, "image", "invalid_image_type", r"application/pdf"),
        ([upload()] * 4, 400, "image", "too_many_images", r"^image: qwenimage_edit_plus takes 1 to 3 .* got 4$"),
        ([upload(data=png_bytes(0, (64, 64)))], 400, "image", "image_too_large", r"at most 3000 \(--max-pixels\)"),
        ([upload(), ("mask", ("m.png", png_bytes(2), "image/png"))], 400, "mask", None, r"inpainting masks are not"),
        ([("image", (None, "hello"))], 400, "image", "invalid_image", r"URLs are not fetched|base64 data URL"),
        ([], 422, "image", None, r"image: Field required"),
        ([upload(), ("other", ("o.png", png_bytes(2), "image/png"))], 400, "other", None, r"takes files as image"),
    ],
    ids=["not_an_image", "wrong_type", "too_many", "too_large", "mask", "text_not_file", "missing", "other_file"],
)
def test_bad_uploads_are_4xx_naming_the_field(serve, parts, status, param, code, match):
    s = serve(limits=ServeLimits(request=RequestLimits(max_pixels=3000)))  # 64x32 outputs, 56x40 inputs
    r = s.client.post("/v1/images/edits", files=[*form(KW).items(), *parts])
    err = assert_error(r, status, param, code)
    assert re.search(match, err["message"]), err
    assert s.state.store.counters["submitted"] == 0  # refused before any job


def test_one_image_family_refuses_two_and_text_models_refuse_edits(tiny_checkpoint):
    edit = tiny_checkpoint("qwenimage_edit")
    with LiveServer(build_app(load_generator(edit), model_id="edit", root=str(edit))) as s:
        r = s.client.post("/v1/images/edits", files=[*form(KW).items(), upload(), upload()])
        err = assert_error(r, 400, "image", "too_many_images")
        assert err["message"] == "image: qwenimage_edit takes 1 conditioning image(s); got 2"
        # and the generations route points an editing model to this one
        r = s.client.post("/v1/images/generations", json={"prompt": "x", "size": "32x32"})
        assert "to POST /v1/images/edits" in assert_error(r, 400, "model", "use_edits_endpoint")["message"]
    text = tiny_checkpoint("qwenimage")
    with LiveServer(build_app(load_generator(text), model_id="t2i", root=str(text))) as s:
        plain = form({"prompt": "make it red", "size": "32x32"})  # (image_area is no option of qwenimage: a 422)
        err = assert_error(s.client.post("/v1/images/edits", files=[*plain.items(), upload()]), 400, "model")
        assert "generates images from text alone and takes no input image" in err["message"], err
        assert s.state.store.counters["submitted"] == 0


def test_an_input_image_area_past_max_pixels_is_refused_naming_it(serve):
    """--max-pixels bounds every image a request makes, the inputs resized to `image_area` too."""
    s = serve(limits=ServeLimits(request=RequestLimits(max_pixels=3000)))
    r = s.client.post("/v1/images/edits", files=[*form({**KW, "size": "32x32"}).items(), upload()])
    err = assert_error(r, 400, "image_area", None)
    assert "image_area is 4096 pixels; this server takes at most 3000 pixels per image (--max-pixels)" in err["message"]
    assert s.state.store.counters["submitted"] == 0
    small = {**KW, "size": "32x32", "image_area": 2048, "condition_image_area": 1024}  # both areas are inputs
    ok = s.client.post("/v1/images/edits", files=[*form(small).items(), upload()])
    assert ok.status_code == 200, ok.text
