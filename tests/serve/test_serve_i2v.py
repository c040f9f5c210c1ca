"""`POST /v1/videos` on an image-to-video model (tiny Wan2.1 I2V) over real HTTP: `input_reference` as a
multipart file (OpenAI's video API, the official openai client) or a base64 data URL in JSON; every
problem with it a 400 naming the field. (A text-to-video model refusing one: tests/serve/test_serve.py.)"""

from __future__ import annotations

import base64
import io
import warnings

import numpy as np
import pytest

from spindle.api import load_generator
from spindle.serve import build_app
from tests.serve.test_serve import LiveServer, assert_error, decode_mp4, live_servers

KW = dict(prompt="a red kite over the sea", size="32x32", num_frames=5, num_inference_steps=2, guidance_scale=1.0)


def png_bytes(seed: int = 0, size: tuple[int, int] = (40, 56)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def gen(tiny_wan_i2v):
    return load_generator(tiny_wan_i2v, device="cpu")


@pytest.fixture
def serve(gen, tiny_wan_i2v):
    with live_servers(gen, tiny_wan_i2v, "tiny-wan-i2v") as start:
        yield start


def form(fields: dict) -> dict:
    return {k: (None, str(v)) for k, v in fields.items()}


def test_multipart_and_data_url_jobs_equal_the_engine(serve, gen):
    from PIL import Image

    s = serve(keep_frames=True)
    png = png_bytes()
    upload = s.client.post(
        "/v1/videos", files={**form({**KW, "seed": 5}), "input_reference": ("first.png", png, "image/png")}
    )
    assert upload.status_code == 200, upload.text
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    as_json = s.client.post("/v1/videos", json={**KW, "seed": 5, "input_reference": url})
    assert as_json.status_code == 200, as_json.text
    jobs = [upload.json(), as_json.json()]
    for job in jobs:
        assert s.wait(job["id"])["status"] == "completed"
    # (after the jobs: the engine serves one request at a time)
    ref = gen.generate(
        prompt=KW["prompt"], image=Image.open(io.BytesIO(png)), height=32, width=32, num_frames=5,
        num_inference_steps=2, guidance_scale=1.0, seed=5,
    ).frames  # fmt: skip
    for job in jobs:
        npy = s.client.get(f"/v1/videos/{job['id']}/content", params={"variant": "npy"}).content
        np.testing.assert_array_equal(np.load(io.BytesIO(npy)), ref)
    # another image, another video: the upload is what conditions it
    other = s.client.post(
        "/v1/videos", files={**form({**KW, "seed": 5}), "input_reference": ("b.png", png_bytes(1), "image/png")}
    ).json()
    s.wait(other["id"])
    npy = s.client.get(f"/v1/videos/{other['id']}/content", params={"variant": "npy"}).content
    assert np.abs(np.load(io.BytesIO(npy)) - ref).max() > 1e-3


def test_openai_client_videos_create_with_input_reference(serve):

    s = serve()
    client = s.openai_client()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        video = client.videos.create(
            prompt="a lighthouse",
            size="32x32",
            seconds="4",
            input_reference=("first.png", png_bytes(), "image/png"),
            extra_body={"num_inference_steps": 2, "seed": 3, "guidance_scale": 1.0},
        )
        s.wait(video.id)
        assert client.videos.retrieve(video.id).status == "completed"
        data = client.videos.download_content(video.id).read()
    assert decode_mp4(data).shape == (65, 32, 32, 3)


@pytest.mark.parametrize(
    "reference, status, code, match",
    [
        (None, 400, "invalid_request", r"input_reference is required for wan_i2v"),
        (("a.png", b"not a png", "image/png"), 400, "invalid_image", r"input_reference: the image cannot be decoded"),
        (("a.pdf", b"%PDF-1.4", "application/pdf"), 400, "invalid_image_type", r"application/pdf, not an image"),
        ("data:image/png;base64,@@@", 400, "invalid_image", r"the data URL's base64 does not decode"),
        ("data:text/plain;base64,aGk=", 400, "invalid_image_type", r"the data URL is text/plain, not an image"),
        ("https://example.com/a.png", 400, "invalid_image", r"URLs are not fetched"),
        ("big", 400, "image_too_large", r"the image is 64x64 = 4096 pixels; this server takes at most 2048"),
    ],
)
def test_bad_input_reference_is_a_400_naming_it(serve, reference, status, code, match):
    import re

    from spindle.engine_config import RequestLimits
    from spindle.serve.limits import ServeLimits

    s = serve(limits=ServeLimits(request=RequestLimits(max_pixels=2048)))
    if reference == "big":
        reference = ("big.png", png_bytes(size=(64, 64)), "image/png")
    if isinstance(reference, tuple):
        r = s.client.post("/v1/videos", files={**form(KW), "input_reference": reference})
    else:
        r = s.client.post("/v1/videos", json={**KW, **({"input_reference": reference} if reference else {})})
    err = assert_error(r, status, "input_reference", code)
    assert re.search(match, err["message"]), err["message"]
    assert s.client.get("/v1/videos").json()["data"] == []  # refused before any job exists


def test_a_file_in_another_field_is_refused(serve):
    s = serve()
    files = {**form(KW), "prompt": ("p.txt", b"a kite", "text/plain")}
    err = assert_error(s.client.post("/v1/videos", files=files), 400, "prompt", "unsupported_parameter")
    assert "this endpoint takes files as input_reference" in err["message"]


def test_last_image_conditions_a_first_last_frame_model(tiny_wan_flf2v, serve):
    """`last_image` (a Spindle extra next to OpenAI's input_reference): the FLF2V job equals
    generate(image=..., last_image=...); without a first frame, or on a model that embeds one image, a 400."""
    from PIL import Image

    flf2v = load_generator(tiny_wan_flf2v, device="cpu")
    with LiveServer(build_app(flf2v, root=str(tiny_wan_flf2v), model_id="tiny-flf2v", keep_frames=True)) as s:
        first, last = png_bytes(0), png_bytes(1, (32, 32))
        files = {"input_reference": ("a.png", first, "image/png"), "last_image": ("b.png", last, "image/png")}
        job = s.client.post("/v1/videos", files={**form({**KW, "seed": 2}), **files})
        assert job.status_code == 200, job.text
        assert s.wait(job.json()["id"])["status"] == "completed"
        npy = s.client.get(f"/v1/videos/{job.json()['id']}/content", params={"variant": "npy"}).content
        ref = flf2v.generate(
            prompt=KW["prompt"], image=Image.open(io.BytesIO(first)), last_image=Image.open(io.BytesIO(last)),
            height=32, width=32, num_frames=5, num_inference_steps=2, guidance_scale=1.0, seed=2,
        ).frames  # fmt: skip
        np.testing.assert_array_equal(np.load(io.BytesIO(npy)), ref)
        alone = s.client.post("/v1/videos", files={**form(KW), "last_image": ("b.png", last, "image/png")})
        assert (
            "last_image goes with an input_reference"
            in assert_error(alone, 400, "last_image", "invalid_request")["message"]
        )
    one_image = serve()  # Wan2.1 I2V: its transformer embeds one image per video
    url = "data:image/png;base64," + base64.b64encode(png_bytes()).decode()
    r = one_image.client.post("/v1/videos", json={**KW, "input_reference": url, "last_image": url})
    assert (
        "last_image needs a first-last-frame (FLF2V) checkpoint"
        in assert_error(r, 400, "last_image", "invalid_request")["message"]
    )
