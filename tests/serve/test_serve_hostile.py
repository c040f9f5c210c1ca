"""Hostile and careless requests against a live server (real uvicorn on loopback, real HTTP, the
tiny Wan / Flux checkpoints): every one gets a 4xx JSON error naming the field, none a 5xx, none is
queued and then fails for a reason validation could see, and the server stays healthy after.
Then a property-based test (hypothesis) sends generated bodies, bounded in count and time."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spindle.engine_config import RequestLimits
from spindle.serve import ServeLimits, build_app
from tests.serve.test_serve import LiveServer, assert_error, gen  # noqa: F401 - `gen`: the tiny Wan generator fixture
from tests.serve.test_serve_images import flux  # noqa: F401 - the tiny Flux generator fixture

OK = dict(prompt="a kite", size="32x32", num_frames=1, num_inference_steps=1)  # cheapest valid job
BIG = "9" * 5000  # more digits than Python's int() takes from text (4300)


def js(**fields) -> bytes:
    """A JSON body; float('inf') / float('nan') become the bare tokens Infinity / NaN."""
    return json.dumps(fields).encode()


def raw_json(text: str) -> bytes:
    return text.encode()


def multipart(fields: dict[str, str], boundary: str = "Spindle-BOUNDARY-x7Q") -> bytes:
    """A form body; a `_charset_` field declares the form's charset (RFC 7578 4.6)."""
    parts = []
    for name, value in fields.items():
        head = f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n'
        data = value if isinstance(value, bytes) else str(value).encode()
        parts.append(head.encode() + b"\r\n" + data + b"\r\n")
    return b"".join(parts) + f"--{boundary}--\r\n".encode()


JSON = "application/json"
FORM = "multipart/form-data; boundary=Spindle-BOUNDARY-x7Q"

# (id, body, content-type, expected status, expected param)
VIDEO_CASES = [
    # non-finite numbers as JSON tokens, and absurd magnitudes
    ("guidance-Infinity", raw_json('{"prompt": "a", "guidance_scale": Infinity}'), JSON, 422, "guidance_scale"),
    ("guidance--Infinity", raw_json('{"prompt": "a", "guidance_scale": -Infinity}'), JSON, 422, "guidance_scale"),
    ("guidance-NaN", raw_json('{"prompt": "a", "guidance_scale": NaN}'), JSON, 422, "guidance_scale"),
    ("guidance-1e999", raw_json('{"prompt": "a", "guidance_scale": 1e999}'), JSON, 422, "guidance_scale"),
    # past the sampling schema's bound (<= 100), which the body's field carries: refused as the body is read
    ("guidance-1e300", js(**OK, guidance_scale=1e300), JSON, 422, "guidance_scale"),
    ("seconds-Infinity", raw_json('{"prompt": "a", "seconds": Infinity}'), JSON, 422, "seconds"),
    ("seconds-NaN", raw_json('{"prompt": "a", "seconds": NaN}'), JSON, 422, "seconds"),
    ("seconds-huge", js(prompt="a", seconds=1e308), JSON, 422, "seconds"),
    ("steps-Infinity", raw_json('{"prompt": "a", "num_inference_steps": Infinity}'), JSON, 422, "num_inference_steps"),
    ("steps-1e9", js(**{**OK, "num_inference_steps": 10**9}), JSON, 400, "num_inference_steps"),
    ("steps-1e30", js(**{**OK, "num_inference_steps": 10**30}), JSON, 400, "num_inference_steps"),
    ("seed-NaN", raw_json('{"prompt": "a", "seed": NaN}'), JSON, 422, "seed"),
    ("seed-5000-digits", raw_json('{"prompt": "a", "seed": ' + BIG + "}"), JSON, 422, "seed"),
    ("seed-negative-5000-digits", raw_json('{"prompt": "a", "seed": -' + BIG + "}"), JSON, 422, "seed"),
    ("seed-2**64", js(**OK, seed=2**64), JSON, 422, "seed"),
    ("frames-5000-digits", raw_json('{"prompt": "a", "num_frames": ' + BIG + "}"), JSON, 422, "num_frames"),
    ("frames-1000000001", js(**{**OK, "num_frames": 1000000001}), JSON, 400, "num_frames"),
    ("frames-past-limit", js(**{**OK, "num_frames": 261}), JSON, 400, "num_frames"),
    # within the server's limits but past the tiny model's rotary range (64 latent frames: 253 frames)
    ("frames-past-positions", js(**{**OK, "num_frames": 257}), JSON, 400, "num_frames"),
    ("width-past-positions", js(**{**OK, "size": "1040x32"}), JSON, 400, "size"),
    ("size-100000x100000", js(**{**OK, "size": "100000x100000"}), JSON, 400, "size"),
    ("size-5000-digits", js(**{**OK, "size": "32x" + BIG}), JSON, 400, "size"),
    ("size-0x0", js(**{**OK, "size": "0x0"}), JSON, 400, "size"),
    ("size-negative", js(**{**OK, "size": "-32x32"}), JSON, 400, "size"),
    ("size-int", js(**{**OK, "size": 32}), JSON, 422, "size"),
    ("seconds-and-frames", js(**OK, seconds=1), JSON, 400, "seconds"),
    ("seconds-past-frame-limit", js(prompt="a", size="32x32", seconds=3000), JSON, 400, "seconds"),
    # oversize text
    ("prompt-4001-chars", js(**{**OK, "prompt": "x" * 4001}), JSON, 400, "prompt"),
    ("negative-prompt-5000-chars", js(**OK, negative_prompt="n" * 5000), JSON, 400, "negative_prompt"),
    # wrong types
    ("prompt-int", js(**{**OK, "prompt": 5}), JSON, 422, "prompt"),
    ("prompt-list", js(**{**OK, "prompt": ["a", "b"]}), JSON, 422, "prompt"),
    ("prompt-null", js(**{**OK, "prompt": None}), JSON, 422, "prompt"),
    ("prompt-object", js(**{**OK, "prompt": {"a": 1}}), JSON, 422, "prompt"),
    ("prompt-missing", js(size="32x32"), JSON, 422, "prompt"),
    ("prompt-blank", js(**{**OK, "prompt": " \t\n"}), JSON, 400, "prompt"),
    ("frames-fraction", js(**{**OK, "num_frames": 4.5}), JSON, 422, "num_frames"),
    ("frames-string", js(**{**OK, "num_frames": "five"}), JSON, 422, "num_frames"),
    ("guidance-string", js(**OK, guidance_scale="lots"), JSON, 422, "guidance_scale"),
    ("guidance-list", js(**OK, guidance_scale=[1]), JSON, 422, "guidance_scale"),
    ("unknown-field", js(**OK, num_step=4), JSON, 422, "num_step"),
    ("unknown-long-field", js(**OK, **{"k" * 3000: 1}), JSON, 422, None),
    # encodings
    ("lone-surrogate-prompt", raw_json('{"prompt": "\\ud800 cat", "size": "32x32"}'), JSON, 422, "prompt"),
    ("lone-surrogate-field-name", raw_json('{"prompt": "a", "\\udfff": 1}'), JSON, 422, None),
    ("invalid-utf8", b'{"prompt": "caf\xe9 \xff\xfe"}', JSON, 400, "body"),
    ("utf16-json", '{"prompt": "a"}'.encode("utf-16"), JSON, 400, "body"),
    # hostile structure
    ("nested-100000", raw_json('{"prompt": ' + "[" * 100000 + "]" * 100000 + "}"), JSON, 400, "body"),
    ("nested-500", raw_json('{"prompt": ' + "[" * 500 + "]" * 500 + "}"), JSON, 422, "prompt"),
    ("nested-object-100000", raw_json('{"a":' * 100000 + "1" + "}" * 100000), JSON, 400, "body"),
    ("not-json", b"{not json", JSON, 400, "body"),
    ("truncated-json", b'{"prompt": "a', JSON, 400, "body"),
    ("empty-body", b"", JSON, 400, "body"),
    ("json-array", b"[1, 2]", JSON, 400, "body"),
    ("json-string", b'"prompt"', JSON, 400, "body"),
    ("json-null", b"null", JSON, 400, "body"),
    ("no-content-type", js(**{**OK, "prompt": ""}), "", 422, "prompt"),
    # multipart and urlencoded
    ("multipart-unknown-charset", multipart({**OK, "_charset_": "x-klingon-8"}), FORM, 400, "prompt"),
    ("multipart-bad-utf8", multipart({**OK, "prompt": b"caf\xe9"}), FORM, 400, "prompt"),
    ("multipart-no-boundary", multipart(OK), "multipart/form-data", 400, "body"),
    ("multipart-garbage", b"this is not multipart at all", FORM, 400, "body"),
    ("multipart-wrong-boundary", multipart(OK, boundary="other"), FORM, 400, "body"),
    ("multipart-seed-5000-digits", multipart({**OK, "seed": BIG}), FORM, 422, "seed"),
    ("multipart-guidance-Infinity", multipart({**OK, "guidance_scale": "Infinity"}), FORM, 422, "guidance_scale"),
    ("multipart-steps-huge", multipart({**OK, "num_inference_steps": "100000"}), FORM, 400, "num_inference_steps"),
    (
        "multipart-file-upload",
        b'--B\r\nContent-Disposition: form-data; name="prompt"\r\n\r\na\r\n'
        b'--B\r\nContent-Disposition: form-data; name="input_reference"; filename="a.png"\r\n\r\nPNG\r\n--B--\r\n',
        "multipart/form-data; boundary=B",
        400,
        "input_reference",
    ),
    ("urlencoded-bad-utf8", b"prompt=caf\xe9", "application/x-www-form-urlencoded", 400, "body"),
    ("urlencoded-huge-size", b"prompt=a&size=99999x99999", "application/x-www-form-urlencoded", 400, "size"),
]

IMAGE_CASES = [
    ("n-1000000", js(prompt="a", size="32x32", n=1000000), JSON, 400, "n"),
    ("n-zero", js(prompt="a", n=0), JSON, 422, "n"),
    ("size-100000x100000", js(prompt="a", size="100000x100000"), JSON, 400, "size"),
    ("size-past-max-pixels", js(prompt="a", size="4096x4096"), JSON, 400, "size"),
    ("guidance-Infinity", raw_json('{"prompt": "a", "guidance_scale": Infinity}'), JSON, 422, "guidance_scale"),
    ("guidance-NaN", raw_json('{"prompt": "a", "guidance_scale": NaN}'), JSON, 422, "guidance_scale"),
    ("seed-5000-digits", raw_json('{"prompt": "a", "seed": ' + BIG + "}"), JSON, 422, "seed"),
    ("steps-huge", js(prompt="a", size="32x32", num_inference_steps=10**6), JSON, 400, "num_inference_steps"),
    ("prompt-oversize", js(prompt="p" * 5000, size="32x32"), JSON, 400, "prompt"),
    ("nested", raw_json('{"prompt": ' + "[" * 100000 + "]" * 100000 + "}"), JSON, 400, "body"),
    ("invalid-utf8", b'{"prompt": "\xff"}', JSON, 400, "body"),
    ("stream", js(prompt="a", stream=True), JSON, 400, "stream"),
    ("response-format-url", js(prompt="a", response_format="url"), JSON, 400, "response_format"),
    ("unknown-field", js(prompt="a", steps=2), JSON, 422, "steps"),
    ("multipart-unknown-charset", multipart({"prompt": "a", "_charset_": "nope"}), FORM, 400, "prompt"),
]


def check_cases(client: httpx.Client, path: str, cases: list) -> list[str]:
    """-> a line per case whose answer was not the expected 4xx JSON naming the field."""
    wrong = []
    for name, body, content_type, status, param in cases:
        headers = {"content-type": content_type} if content_type else {}
        r = client.post(path, content=body, headers=headers)
        try:
            err = assert_error(r, status, param)
            assert len(r.content) < 4096, "the error echoes the input back"
            assert err["type"] == "invalid_request_error"
        except (AssertionError, KeyError, ValueError) as e:
            wrong.append(f"{name}: {r.status_code} {r.text[:300]} ({e})")
    return wrong


def assert_healthy(s: LiveServer) -> None:
    assert s.client.get("/health").status_code == 200
    listing = s.client.get("/v1/videos")
    assert listing.status_code == 200 and listing.json()["object"] == "list"
    assert s.state.store.counters["failed"] == 0


@pytest.fixture(scope="module")
def wan_server(gen):  # noqa: F811
    with LiveServer(build_app(gen, model_id="tiny-wan", max_queue=64)) as s:
        yield s


def test_hostile_video_requests_get_4xx_json_naming_the_field(wan_server):
    s = wan_server
    wrong = check_cases(s.client, "/v1/videos", VIDEO_CASES)
    assert not wrong, "\n".join(wrong)
    assert s.state.store.counters["submitted"] == 0  # nothing was queued
    # the first case: Infinity used to be queued and break the job list for everyone
    assert_healthy(s)
    # what a browser sends: a multipart boundary with capital letters is read as sent
    r = s.client.post(
        "/v1/videos",
        content=multipart(OK, boundary="----WebKitFormBoundaryAbCdEf"),
        headers={"content-type": "multipart/form-data; boundary=----WebKitFormBoundaryAbCdEf"},
    )
    assert r.status_code == 200, r.text
    assert s.wait(r.json()["id"])["status"] == "completed"
    assert_healthy(s)


def test_oversize_bodies_get_413_without_being_read(gen):  # noqa: F811
    limits = ServeLimits(max_body_bytes=64 * 1024)
    with LiveServer(build_app(gen, model_id="tiny-wan", limits=limits)) as s:
        huge = js(prompt="x" * (10 << 20))  # a 10 MB prompt
        err = assert_error(s.client.post("/v1/videos", content=huge, headers={"content-type": JSON}), 413, "body")
        assert "--max-body-bytes" in err["message"]

        def chunks():  # no Content-Length: the cap is found while reading
            yield b'{"prompt": "'
            for _ in range(200):
                yield b"y" * 1024
            yield b'"}'

        assert_error(s.client.post("/v1/videos", content=chunks(), headers={"content-type": JSON}), 413, "body")
        form = multipart({"prompt": "z" * (1 << 20)})
        assert_error(s.client.post("/v1/videos", content=form, headers={"content-type": FORM}), 413, "body")
        assert_healthy(s)
        assert s.state.store.counters["submitted"] == 0


def test_limits_are_options_and_reported(gen):  # noqa: F811
    limits = ServeLimits(
        request=RequestLimits(max_pixels=32 * 48, max_frames=9, max_steps=3, max_prompt_chars=20, max_outputs=1),
        max_body_bytes=4096,
    )
    with LiveServer(build_app(gen, model_id="tiny-wan", limits=limits)) as s:
        reported = s.client.get("/health").json()["limits"]
        assert reported == s.client.get("/v1/models").json()["data"][0]["limits"]
        assert reported["max_pixels"] == 32 * 48 and reported["max_frames"] == 9 and reported["max_steps"] == 3
        assert reported["max_prompt_chars"] == 20 and reported["max_body_bytes"] == 4096
        c = s.client
        assert_error(c.post("/v1/videos", json={**OK, "size": "48x48"}), 400, "size")
        assert_error(c.post("/v1/videos", json={**OK, "num_frames": 13}), 400, "num_frames")
        assert_error(c.post("/v1/videos", json={**OK, "num_inference_steps": 4}), 400, "num_inference_steps")
        assert_error(c.post("/v1/videos", json={**OK, "prompt": "p" * 21}), 400, "prompt")
        assert_error(c.post("/v1/videos", json={**OK, "prompt": "p" * 5000}), 413, "body")
        # the model's defaults (832x480, 81 frames, 50 steps) are past these limits too: named, not run
        assert_error(c.post("/v1/videos", json={"prompt": "a"}), 400)
        r = c.post("/v1/videos", json={**OK, "size": "48x32", "num_frames": 9, "num_inference_steps": 3})
        assert r.status_code == 200, r.text
        assert s.wait(r.json()["id"])["status"] == "completed"


def test_hostile_image_requests_get_4xx_json_naming_the_field(flux):  # noqa: F811
    generator, root = flux
    with LiveServer(build_app(generator, model_id="tiny-flux", root=str(root))) as s:
        wrong = check_cases(s.client, "/v1/images/generations", IMAGE_CASES)
        assert not wrong, "\n".join(wrong)
        assert s.state.store.counters["submitted"] == 0
        assert s.client.get("/health").status_code == 200


def test_job_list_is_paginated_and_shows_prompt_previews(gen):  # noqa: F811
    with LiveServer(build_app(gen, model_id="tiny-wan", max_queue=16)) as s:
        long_prompt = "a very long prompt " * 200
        ids = [s.client.post("/v1/videos", json={**OK, "prompt": f"{i} {long_prompt}"}).json()["id"] for i in range(5)]
        for i in ids:
            s.wait(i)
        seen, after = [], None
        while True:
            page = s.client.get("/v1/videos", params={"limit": 2, **({"after": after} if after else {})}).json()
            assert len(page["data"]) <= 2
            seen += [j["id"] for j in page["data"]]
            assert all(len(j["prompt"]) <= 64 for j in page["data"])  # a preview, never the whole prompt
            if not page["has_more"]:
                break
            after = page["last_id"]
        assert seen == ids[::-1]  # newest first, each once
        asc = s.client.get("/v1/videos", params={"order": "asc", "limit": 100}).json()
        assert [j["id"] for j in asc["data"]] == ids and asc["has_more"] is False
        assert s.client.get(f"/v1/videos/{ids[0]}").json()["prompt"] == f"0 {long_prompt}"  # whole on its own GET
        for params, status, param in [
            ({"limit": 0}, 422, "limit"),
            ({"limit": 101}, 422, "limit"),
            ({"limit": "ten"}, 422, "limit"),
            ({"limit": BIG}, 422, "limit"),
            ({"after": "video_nope"}, 400, "after"),
            ({"order": "sideways"}, 422, "order"),
        ]:
            assert_error(s.client.get("/v1/videos", params=params), status, param)


# ------------------------------------------------------------------------------------- property-based

FIELDS = ["prompt", "negative_prompt", "size", "seconds", "num_frames", "num_inference_steps", "guidance_scale", "seed"]
numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, 2, 5, 9, 2**63, -1, 1e308, 1e-308]),
)
sizes = st.one_of(
    st.builds(lambda w, h: f"{w}x{h}", st.integers(-64, 10**7), st.integers(-64, 10**7)),
    st.sampled_from(["32x32", "48x32", "auto", "32X32", " 32 x 32 ", "x", ""]),
)
texts = st.text(max_size=40)
values = st.one_of(numbers, texts, sizes, st.booleans(), st.none(), st.lists(numbers, max_size=3))
anything = st.dictionaries(st.one_of(st.sampled_from(FIELDS), st.text(max_size=8)), values, max_size=6)
# near-valid requests: small in-range values mixed with hostile ones, so that some are accepted and run
# (the model's defaults are past the cheap server's limits, so size, frames and steps are always given)
near_valid = st.fixed_dictionaries(
    {
        "prompt": st.one_of(st.text(min_size=1, max_size=30), values),
        "size": st.one_of(st.sampled_from(["32x32", "16x32", "32x16"]), sizes),
        "num_frames": st.one_of(st.integers(-2, 12), numbers),
        "num_inference_steps": st.one_of(st.integers(-1, 3), numbers),
    },
    optional={
        "seconds": st.one_of(st.floats(0, 1), numbers, texts),
        "guidance_scale": st.one_of(st.floats(-1, 10), numbers),
        "seed": numbers,
        "negative_prompt": st.one_of(texts, values),
    },
)
valid = st.fixed_dictionaries(
    {
        "prompt": st.text(min_size=1, max_size=30).filter(str.strip),
        "size": st.sampled_from(["32x32", "16x32", "32x16", "16x16"]),
        "num_frames": st.sampled_from([1, 5]),
        "num_inference_steps": st.sampled_from([1, 2]),
    },
    optional={
        "guidance_scale": st.floats(0, 10),
        "seed": st.integers(0, 2**63 - 1),
        "negative_prompt": st.text(max_size=20),
    },
)
# 1 in 5 valid: the accepted ones run (1-4 s each on the loaded 2-core CPU), so they set the test's time
bodies = st.integers(0, 4).flatmap(lambda i: valid if i == 0 else near_valid if i % 2 else anything)


# reproducible (derandomized, no example database) and bounded by max_examples, not by wall time
BOUNDED = settings(
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.fixture(scope="module")
def cheap_server(gen):  # noqa: F811
    """Limits that keep every accepted job tiny (32x32 at most, 5 frames, 2 steps)."""
    limits = ServeLimits(request=RequestLimits(max_pixels=32 * 32, max_frames=5, max_steps=2))
    with LiveServer(build_app(gen, model_id="tiny-wan", max_queue=200, limits=limits)) as s:
        yield s
        assert_healthy(s)


def check_answer(s: LiveServer, r: httpx.Response) -> None:
    """A 4xx JSON error naming the field, or an accepted job that then completes."""
    assert r.status_code < 500, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    if r.status_code == 200:  # validation let it through: it must not fail for a validatable reason
        done = s.wait(r.json()["id"], timeout=60)
        assert done["status"] == "completed", done
        return
    err = r.json()["error"]
    assert r.status_code in (400, 413, 422) and err["message"] and err["param"], r.text


@settings(BOUNDED, max_examples=40)
@given(body=bodies, as_form=st.booleans())
def test_generated_requests_never_get_a_5xx(cheap_server, body, as_form):
    s = cheap_server
    if as_form:  # what the openai client sends: every value a string
        fields = {k: v if isinstance(v, str) else json.dumps(v) for k, v in body.items()}
        try:
            content = multipart(fields, boundary="HypoThesis42")
        except UnicodeEncodeError:  # a lone surrogate cannot be sent as form text at all
            return
        headers = {"content-type": "multipart/form-data; boundary=HypoThesis42"}
    else:
        content, headers = json.dumps(body).encode(), {"content-type": JSON}
    check_answer(s, s.client.post("/v1/videos", content=content, headers=headers))


@settings(BOUNDED, max_examples=40)
@given(
    raw=st.binary(max_size=300),
    content_type=st.sampled_from(
        [JSON, FORM, "multipart/form-data; boundary=B", "application/x-www-form-urlencoded", "text/plain", ""]
    ),
)
def test_generated_raw_bodies_never_get_a_5xx(cheap_server, raw, content_type):
    headers = {"content-type": content_type} if content_type else {}
    check_answer(cheap_server, cheap_server.client.post("/v1/videos", content=raw, headers=headers))


image_bodies = st.one_of(
    st.fixed_dictionaries(
        {
            "prompt": st.one_of(st.text(min_size=1, max_size=30), values),
            "size": st.one_of(st.sampled_from(["32x32", "16x32"]), sizes),
            "num_inference_steps": st.one_of(st.integers(-1, 2), numbers),
        },
        optional={
            "n": st.one_of(st.integers(-1, 3), numbers),
            "guidance_scale": st.one_of(st.floats(-1, 10), numbers),
            "seed": numbers,
            "response_format": st.one_of(st.sampled_from(["b64_json", "url"]), values),
            "negative_prompt": st.one_of(texts, values),
        },
    ),
    anything,
)


@pytest.fixture(scope="module")
def cheap_image_server(flux):  # noqa: F811
    generator, root = flux
    limits = ServeLimits(request=RequestLimits(max_pixels=32 * 32, max_steps=2, max_outputs=2))
    with LiveServer(build_app(generator, model_id="tiny-flux", root=str(root), limits=limits)) as s:
        yield s
        assert s.client.get("/health").status_code == 200
        assert s.state.store.counters["failed"] == 0


@settings(BOUNDED, max_examples=40)
@given(body=image_bodies)
def test_generated_image_requests_never_get_a_5xx(cheap_image_server, body):
    r = cheap_image_server.client.post(
        "/v1/images/generations", content=json.dumps(body).encode(), headers={"content-type": JSON}
    )
    assert r.status_code < 500, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    if r.status_code == 200:  # the image itself: validation let through only what runs
        assert 1 <= len(r.json()["data"]) <= 2
    else:
        err = r.json()["error"]
        assert r.status_code in (400, 422) and err["message"] and err["param"], r.text
