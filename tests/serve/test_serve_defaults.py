"""`spindle serve --model DIR` as a user starts it, with no other flag, for every registered DiT family
(parametrised over the registry: a new family is covered with no test edited): the default warm-up
builds a request the family accepts (generated conditioning images where it needs them, the fewest steps
its scheduler takes, a small size where the output follows the input image) and the server is healthy
within 120 s on the tiny checkpoint. Then OpenAI's semantics through the official `openai` client against
a real loopback server: `size` is the output size of an edit (FLUX.1 Kontext maps it to its `max_area`),
and a size the model cannot make is a 400 naming the nearest sizes it makes."""

from __future__ import annotations

import base64
import io
import signal
import time

import httpx
import pytest
from PIL import Image

from spindle.contracts.family import DiTFamily
from spindle.registry import all_families
from spindle.testing.multiprocess import SpindleProcess
from tests.serve.test_serve import free_port

DIT_FAMILIES = [f.name for f in all_families() if isinstance(f, DiTFamily)]
HEALTHY_WITHIN = 120.0  # seconds, load + warm-up on the tiny checkpoint


class DefaultServe:
    """`spindle serve --model DIR --port P`: only the port is chosen (a free loopback one). A process of its own
    (`SpindleProcess`: forked warm, `spindle.cli.main` as the console script calls it; the fresh-interpreter
    server is tests/serve/test_serve_cli.py's)."""

    def __init__(self, model, log_path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = SpindleProcess("serve", "--model", model, "--port", self.port, log=log_path)

    def output(self) -> str:
        out, err = self.proc.output()
        return (out + err)[-4000:]

    def wait_healthy(self, timeout: float = HEALTHY_WITHIN) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            assert self.proc.poll() is None, f"spindle serve exited {self.proc.returncode}:\n{self.output()}"
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.monotonic() - start
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise AssertionError(f"not healthy within {timeout:.0f} s:\n{self.output()}")

    def stop(self) -> int:
        try:
            self.proc.send_signal(signal.SIGTERM)
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


@pytest.mark.parametrize("family", DIT_FAMILIES)
def test_serve_with_default_flags_is_healthy(family, tiny_checkpoint, tmp_path):
    server = DefaultServe(tiny_checkpoint(family), tmp_path / "serve.log")
    try:
        server.wait_healthy()
        log = server.output()
        assert "warm-up: one generation" in log and "warm-up done" in log, log
        assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"] == family
    finally:
        code = server.stop()
    assert code == 0, server.output()
    # no job was stored (the warm-up is no job), so the drain does not linger for pollers
    assert "worker stopped" in server.output() and "answering status for" not in server.output()


@pytest.fixture(scope="module")
def kontext_server(tiny_checkpoint, tmp_path_factory):
    server = DefaultServe(tiny_checkpoint("flux_kontext"), tmp_path_factory.mktemp("kontext") / "serve.log")
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 40, 90)).save(buffer, format="PNG")
    return buffer.getvalue()


def openai_client(server: DefaultServe):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_openai_edit_size_is_the_output_size_on_kontext(kontext_server):
    """FluxKontextPipeline sizes its output to `max_area` (1 megapixel by default); over HTTP `size` is the
    output, so the official client's `images.edit(size="48x48")` gets a 48x48 image; the source is sized to that
    area (its aspect kept) instead of the pipeline's preferred ~1 megapixel."""
    result = openai_client(kontext_server).images.edit(
        model="flux_kontext",
        # a 640x480 upload: sized to the output's area (not auto-resized to 1 megapixel), so the edit stays cheap
        image=("source.png", png(640, 480), "image/png"),
        prompt="make it blue",
        size="48x48",
        extra_body={"num_inference_steps": 2, "seed": 3},
    )
    image = Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json)))
    assert image.size == (48, 48)


def test_openai_generation_size_is_the_output_size_on_kontext(kontext_server):
    result = openai_client(kontext_server).images.generate(
        model="flux_kontext", prompt="a red door", size="64x32", extra_body={"num_inference_steps": 2}
    )
    assert Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))).size == (64, 32)


def test_openai_impossible_size_names_the_nearest_sizes(kontext_server):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        openai_client(kontext_server).images.edit(
            model="flux_kontext", image=("source.png", png(48, 48), "image/png"), prompt="x", size="50x50"
        )
    body = info.value.body
    assert body["param"] == "size", body
    # the tiny Kontext makes multiples of 4 (VAE x2 x 2x2 packing): the nearest, 4 pixels away in all
    assert "nearest sizes it makes: 48x48, 48x52, 52x48" in body["message"], body


def test_a_refused_warm_up_names_the_warm_up_and_its_flags(tiny_checkpoint):
    """Qwen-Image's scheduler (shift_terminal) takes no 1-step run: the default warm-up takes 2 steps (above);
    asked for 1 explicitly, the refusal is one line saying it is the warm-up and which flags change it."""
    from spindle.testing.multiprocess import run_spindle

    r = run_spindle("serve", "--model", tiny_checkpoint("qwenimage"), "--port", free_port(), "--warmup-steps", 1)
    assert r.returncode == 2, r.stderr[-3000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("spindle serve: error: the warm-up request was refused (num_inference_steps must be >= 2")
    assert "--warmup-steps" in line and "--no-warmup" in line, line


def test_ltx2_video_over_http_carries_its_audio_track(tiny_checkpoint, tmp_path):
    """`spindle serve` with default flags on LTX-2 answers `/v1/videos` with an mp4 whose AAC audio stream is the
    soundtrack the engine makes for the same request (its sample rate, channels and length)."""
    import av

    from spindle.api import load_generator

    request = dict(prompt="waves on a beach", num_frames=9, num_inference_steps=2, seed=3)
    server = DefaultServe(tiny_checkpoint("ltx2"), tmp_path / "serve.log")
    try:
        server.wait_healthy()
        job = httpx.post(f"{server.url}/v1/videos", json={**request, "size": "64x64"}, timeout=30).json()
        deadline = time.monotonic() + 120
        while (status := httpx.get(f"{server.url}/v1/videos/{job['id']}").json())["status"] != "completed":
            assert status["status"] in ("queued", "in_progress") and time.monotonic() < deadline, status
            time.sleep(0.25)
        content = httpx.get(f"{server.url}/v1/videos/{job['id']}/content", timeout=30).content
    finally:
        server.stop()
    audio = load_generator(tiny_checkpoint("ltx2")).generate(**request, height=64, width=64)
    with av.open(io.BytesIO(content)) as container:
        (video,), (sound,) = container.streams.video, container.streams.audio
        assert video.frames == 9 and (sound.rate, sound.channels) == (audio.sample_rate, audio.audio.shape[1])
        seconds = audio.audio.shape[-1] / audio.sample_rate
        assert float(sound.duration * sound.time_base) == pytest.approx(seconds, abs=1e-3)
