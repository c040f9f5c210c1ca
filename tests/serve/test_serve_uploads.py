"""Uploaded images decoded safely, as an operator probes a live server (real uvicorn on loopback, real
files): only PNG / JPEG / WEBP / BMP / GIF are ever opened (an EPS labelled as a PNG never reaches
Ghostscript: a fake `gs` on PATH records any run), the size is bounded off the header before a pixel is
decoded (a 16 KB 524288x8 PNG adds no memory), a too-wide input is a 400 naming `image` and the limit
for the family's own sizing too, a form of thousands of parts is refused at the first part over the
bound, and parsing and decoding run off the event loop (/health answers meanwhile)."""

from __future__ import annotations

import base64
import io
import os
import re
import subprocess
import threading
import zlib
from pathlib import Path

import pytest
from PIL import EpsImagePlugin, Image

from spindle.api import load_generator
from spindle.contracts import images as uploads
from spindle.serve import bodies, build_app
from spindle.serve.limits import MAX_FORM_FIELDS, MAX_FORM_FILES
from tests.serve.test_serve import LiveServer, assert_error
from tests.serve.test_serve_edits import KW, plus  # noqa: F401 - `plus`: the tiny Qwen-Image-Edit-Plus generator
from tests.serve.test_serve_i2v import form, png_bytes

EPS = (
    b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n%%EndComments\n"
    b"newpath 0 0 moveto 8 0 lineto 8 8 lineto closepath fill\nshowpage\n%%EOF\n"
)


@pytest.fixture(scope="module")
def edit_server(plus):  # noqa: F811
    gen, root = plus
    with LiveServer(build_app(gen, model_id="edit", root=str(root))) as s:
        yield s


@pytest.fixture(scope="module")
def i2v_server(tiny_wan_i2v):
    with LiveServer(build_app(load_generator(tiny_wan_i2v, device="cpu"), model_id="i2v")) as s:
        yield s


@pytest.fixture
def fake_gs(tmp_path, monkeypatch) -> Path:
    """A `gs` first on PATH that records each run in the returned log (and renders nothing); Pillow's
    cached answer to "is there a Ghostscript?" is cleared so that it looks again."""
    log = tmp_path / "gs-runs.log"
    (tmp_path / "bin").mkdir()
    gs = tmp_path / "bin" / "gs"
    gs.write_text(f'#!/bin/sh\necho "$@" >> {log}\n[ "$1" = --version ] && echo 10.0\n[ "$1" = --version ]\n')
    gs.chmod(0o755)
    monkeypatch.setenv("PATH", f"{gs.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(EpsImagePlugin, "gs_binary", None)
    return log


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64," + base64.b64encode(data).decode()


def saved(fmt: str, size: tuple[int, int] = (56, 40), mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, 120).save(buf, fmt)
    return buf.getvalue()


def test_an_eps_upload_is_refused_and_no_external_program_runs(fake_gs, edit_server, i2v_server):
    # the control: Pillow left to itself hands this file to the `gs` on PATH
    with (
        pytest.raises(subprocess.CalledProcessError),
        Image.open(io.BytesIO(EPS)) as unrestricted,
    ):  # (it renders nothing)
        unrestricted.load()
    assert fake_gs.read_text(), "the fake gs was not run by plain Pillow: the test proves nothing"
    fake_gs.unlink()

    s, submitted = edit_server, edit_server.state.store.counters["submitted"]
    as_png = s.client.post("/v1/images/edits", files=[*form(KW).items(), ("image", ("a.png", EPS, "image/png"))])
    err = assert_error(as_png, 400, "image", "invalid_image")
    assert "not a PNG, JPEG, WEBP, BMP, GIF image" in err["message"], err
    as_url = s.client.post("/v1/images/edits", json={**KW, "image": data_url(EPS)})
    assert_error(as_url, 400, "image", "invalid_image")
    eps_url = s.client.post("/v1/images/edits", json={**KW, "image": data_url(EPS, "application/postscript")})
    assert_error(eps_url, 400, "image", "invalid_image_type")
    video = i2v_server.client.post(
        "/v1/videos", json={"prompt": "a kite", "size": "32x32", "input_reference": data_url(EPS)}
    )
    assert_error(video, 400, "input_reference", "invalid_image")
    assert not fake_gs.exists(), f"an external program ran: {fake_gs.read_text()}"
    assert s.state.store.counters["submitted"] == submitted and i2v_server.state.store.counters["submitted"] == 0


@pytest.mark.parametrize("fmt", ["TIFF", "ICO", "PPM", "TGA", "SGI", "PCX", "IM", "DDS", "QOI"])
def test_formats_outside_the_list_are_not_decoded(edit_server, fmt):
    data = saved(fmt, mode="RGBA" if fmt == "DDS" else "RGB")
    assert Image.open(io.BytesIO(data)).format == fmt  # (plain Pillow reads it)
    r = edit_server.client.post("/v1/images/edits", json={**KW, "image": data_url(data)})
    assert "the image cannot be decoded (not a PNG" in assert_error(r, 400, "image", "invalid_image")["message"]


@pytest.mark.parametrize("fmt", ["JPEG", "WEBP", "BMP", "GIF"])
def test_listed_formats_are_edited(edit_server, fmt):
    r = edit_server.client.post("/v1/images/edits", json={**KW, "image": data_url(saved(fmt), f"image/{fmt.lower()}")})
    assert r.status_code == 200, r.text


def png_header_only(width: int, height: int) -> bytes:
    """A valid PNG of `width` x `height` black grey pixels, a few KB for any size (zlib of zeros)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return len(body).to_bytes(4, "big") + kind + body + zlib.crc32(kind + body).to_bytes(4, "big")

    rows = zlib.compress(b"\0" * ((width + 1) * height), 9)  # filter byte 0 + one grey byte a pixel
    head = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, 0, 0, 0, 0])
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", head) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")


def peak_rss_after(action) -> int:
    """Bytes the process's peak resident memory grew by while `action` ran (Linux: the peak is reset first)."""

    def status(key: str) -> int:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key))
        return int(line.split()[1]) * 1024

    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    before = status("VmRSS")
    action()
    return status("VmHWM") - before


def test_a_wide_strip_is_refused_off_its_header_without_decoding(i2v_server):
    strip = png_header_only(524288, 8)
    assert len(strip) < 16_000
    body = {"prompt": "a kite", "size": "32x32", "input_reference": data_url(strip)}
    answers = []
    grown = peak_rss_after(lambda: answers.append(i2v_server.client.post("/v1/videos", json=body)))
    err = assert_error(answers[0], 400, "input_reference", "image_aspect_too_large")
    assert "524288x8 pixels, 65536 times as wide as tall; this server takes at most 200" in err["message"]
    assert grown < 64 << 20, f"the refused request grew the peak memory by {grown >> 20} MB"
    # a square too large: the pixel bound, also off the header
    big = i2v_server.client.post(
        "/v1/videos", json={**body, "input_reference": data_url(png_header_only(12000, 12000))}
    )
    assert "(--max-pixels)" in assert_error(big, 400, "input_reference", "image_too_large")["message"]
    assert i2v_server.state.store.counters["submitted"] == 0


@pytest.mark.parametrize("size", [{"size": "64x32"}, {}], ids=["size", "no_size"])
def test_a_wide_edit_input_is_a_400_naming_image_and_the_limit(edit_server, size):
    """The family's sizing of an input (to `image_area`, sides multiples of 32; the vision encoder's
    aspect bound) refused before any job, naming `image`, whether or not `size` was given."""
    body = {k: v for k, v in KW.items() if k != "size"} | size
    submitted = edit_server.state.store.counters["submitted"]
    small_area = edit_server.client.post("/v1/images/edits", json={**body, "image": data_url(saved("PNG", (400, 8)))})
    err = assert_error(small_area, 400, "image")
    assert "400x8 pixels sized to image_area=4096 is 448x0" in err["message"], err
    # what the vision-language encoder sees (Plus: sized to condition_image_area): under 200 times as wide
    seen = {
        **body,
        "image_area": 1024 * 1024,
        "condition_image_area": 1024 * 1024,
        "image": data_url(saved("PNG", (1600, 8))),
    }
    err = assert_error(edit_server.client.post("/v1/images/edits", json=seen), 400, "image")
    assert re.search(r"condition_image_area=1048576 is 14496x64; .* less than 200 times", err["message"]), err
    past_bound = edit_server.client.post("/v1/images/edits", json={**body, "image": data_url(saved("PNG", (2010, 10)))})
    assert_error(past_bound, 400, "image", "image_aspect_too_large")
    assert edit_server.state.store.counters["submitted"] == submitted  # refused before any job


def many_parts(count: int, file: bool) -> tuple[bytes, str]:
    boundary = "many-parts-B"
    filename = '; filename="a.png"' if file else ""
    part = f'--{boundary}\r\nContent-Disposition: form-data; name="image"{filename}\r\n\r\nx\r\n'.encode()
    return part * count + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


@pytest.mark.parametrize("file", [True, False], ids=["file_parts", "text_parts"])
def test_a_form_of_thousands_of_parts_is_refused_at_the_bound(edit_server, file):
    body, content_type = many_parts(9000, file)
    assert len(body) < 1 << 20  # under --max-body-bytes: only the part bound refuses it
    r = edit_server.client.post("/v1/images/edits", content=body, headers={"content-type": content_type})
    err = assert_error(r, 400, "body", "invalid_body")
    bound = f"more than {MAX_FORM_FILES} file parts" if file else f"more than {MAX_FORM_FIELDS} fields"
    assert bound in err["message"], err
    assert edit_server.client.get("/health").status_code == 200


def blocking(monkeypatch, module, name: str) -> tuple[threading.Event, threading.Event]:
    """Make `module.name` wait (in whichever thread runs it) until released: -> (entered, release)."""
    entered, release, original = threading.Event(), threading.Event(), getattr(module, name)

    def wait_then_run(*args, **kwargs):
        entered.set()
        assert release.wait(60)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wait_then_run)
    return entered, release


@pytest.mark.parametrize("stage", ["multipart parsing", "image decoding"])
def test_health_answers_while_a_body_is_parsed_and_decoded(edit_server, monkeypatch, stage):
    """A request held inside form parsing or image decoding: the server still answers /health at
    once (on the event loop, either would hold every other request until it ended)."""
    module, name = (bodies, "_parse_multipart") if stage == "multipart parsing" else (uploads, "check_image_size")
    entered, release = blocking(monkeypatch, module, name)
    answer = []
    files = [*form(KW).items(), ("image", ("a.png", png_bytes(0), "image/png"))]
    post = threading.Thread(target=lambda: answer.append(edit_server.client.post("/v1/images/edits", files=files)))
    post.start()
    try:
        assert entered.wait(30), f"the request never reached {stage}"
        assert edit_server.client.get("/health", timeout=10).status_code == 200
    finally:
        release.set()
        post.join(60)
    assert answer and answer[0].status_code == 200, answer


def test_a_file_part_larger_than_the_form_spool_is_read_whole(plus):  # noqa: F811
    """Starlette spools a file part past 1 MB to disk: it is read back whole (a 1.5 MB PNG is edited)."""
    from spindle.serve import ServeLimits

    gen, root = plus
    big = png_bytes(3, (720, 720))
    assert len(big) > 1 << 20
    limits = ServeLimits(max_body_bytes=4 << 20)
    with LiveServer(build_app(gen, model_id="edit", root=str(root), limits=limits)) as s:
        files = [*form(KW).items(), ("image", ("big.png", big, "image/png"))]
        r = s.client.post("/v1/images/edits", files=files)
        assert r.status_code == 200, r.text
        truncated = [*form(KW).items(), ("image", ("big.png", big[: len(big) // 2], "image/png"))]
        assert_error(s.client.post("/v1/images/edits", files=truncated), 400, "image", "invalid_image")
