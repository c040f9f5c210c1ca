"""`spindle serve` as a real process: start-up (load, warm-up), graceful shutdown on SIGTERM (exit
0, running job cancelled after the grace period, waiting jobs cancelled), bad options, and
multi-process serving (--nproc 2 with --cfg-parallel / --sp 2) equal to the single process."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from spindle.api import load_generator
from tests.serve.test_serve import free_port

REQUEST = dict(
    prompt="a windmill at sunset",
    negative_prompt="blurry",
    size="48x32",
    num_frames=5,
    num_inference_steps=2,
    guidance_scale=4.5,
    seed=21,
)


class ServeProcess:
    def __init__(self, model, *extra: str, log_path=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [
            sys.executable,
            "-m",
            "spindle",
            "serve",
            "--model",
            str(model),
            "--port",
            str(self.port),
            "--device",
            "cpu",
            "--warmup-size",
            "48x32",
            "--log-level",
            "info",
            *extra,
        ]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )

    def wait_ready(self, timeout: float = 300) -> httpx.Client:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return httpx.Client(base_url=self.url, timeout=60)
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError("server not ready:\n" + self.output())

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return open(self.log_path).read()[-6000:]

    def stop(self, timeout: float = 120) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def wait_job(client: httpx.Client, job_id: str, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = client.get(f"/v1/videos/{job_id}").json()
        if body["status"] in ("completed", "failed", "cancelled"):
            return body
        time.sleep(0.05)
    raise AssertionError(f"{job_id} did not finish")


def test_bad_options_are_clear_errors(tiny_wan, tmp_path, spindle_cli):
    def serve(*args):
        return spindle_cli("serve", *args)  # each fails in its option checks, before any model load

    r = serve("--model", str(tmp_path))
    assert r.returncode == 2 and "model_index.json not found" in r.stderr
    r = serve("--model", str(tiny_wan), "--nproc", "2")
    assert r.returncode == 2 and "--nproc 2 does not match --sp 1" in r.stderr
    r = serve("--model", str(tiny_wan), "--max-queue", "0")
    assert r.returncode == 2 and "--max-queue must be >= 1" in r.stderr
    r = serve("--model", str(tiny_wan), "--warmup-size", "big")
    assert r.returncode == 2 and "--warmup-size" in r.stderr
    r = serve("--model", str(tiny_wan), "--max-steps", "-1")
    assert r.returncode == 2 and "--max-steps must be >= 0" in r.stderr
    r = serve("--model", str(tiny_wan), "--max-body-bytes", "10")
    assert r.returncode == 2 and "--max-body-bytes must be >= 1024" in r.stderr
    r = serve("--model", str(tiny_wan), "--max-results", "0")
    assert r.returncode == 2 and "--max-results must be >= 1; got 0" in r.stderr
    r = serve("--model", str(tiny_wan), "--max-connections", "100000000")
    assert r.returncode == 2 and "open-file limit" in r.stderr and "--max-connections" in r.stderr


def wait_until(predicate, timeout: float = 60, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def test_sigterm_drains_then_exits_0(tiny_wan, tmp_path):
    """SIGTERM: new work gets 503 JSON at once while pollers still read job status and see the final
    `cancelled` of the waiting job and (after --shutdown-grace) of the running one; then exit 0."""
    s = ServeProcess(
        tiny_wan,
        *("--shutdown-grace", "1", "--shutdown-linger", "3", "--max-queue", "4", "--max-steps", "1000"),
        log_path=tmp_path / "serve.log",
    )
    try:
        client = s.wait_ready()
        done = client.post("/v1/videos", json=REQUEST).json()
        assert wait_job(client, done["id"])["status"] == "completed"
        # a long job (running at SIGTERM) and one waiting behind it
        long = client.post("/v1/videos", json={**REQUEST, "num_inference_steps": 1000}).json()
        waiting = client.post("/v1/videos", json=REQUEST).json()
        wait_until(lambda: client.get(f"/v1/videos/{long['id']}").json()["progress"] >= 1, what="progress")
        assert client.get(f"/v1/videos/{waiting['id']}").json()["status"] == "queued"
        s.proc.send_signal(signal.SIGTERM)
        health = wait_until(lambda: (r := client.get("/health")).status_code == 503 and r, what="health 503")
        assert health.json()["status"] == "shutting_down"
        r = client.post("/v1/videos", json=REQUEST)  # new work: 503 JSON, not a refused connection
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
        # pollers still read status, and see the final statuses
        assert wait_job(client, waiting["id"], timeout=30)["status"] == "cancelled"
        assert wait_job(client, long["id"], timeout=30)["status"] == "cancelled"  # after the 1 s grace
        assert client.get("/v1/videos").status_code == 200
        assert client.get(f"/v1/videos/{done['id']}/content").status_code == 200
        client.close()
        rc = s.proc.wait(60)
        log = s.output()
        assert rc == 0, log
        assert "cancelling running job " + long["id"] in log
        assert "'completed': 1" in log and "'cancelled': 2" in log, log
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{s.url}/health", timeout=2)
    finally:
        s.kill()
        s.log.close()


def test_sigterm_answers_in_flight_image_requests_with_json(tiny_flux, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    root = tiny_flux
    s = ServeProcess(root, "--shutdown-grace", "1", "--max-steps", "1000", log_path=tmp_path / "serve.log")
    try:
        client = s.wait_ready()
        slow = {"prompt": "a boat", "size": "32x32", "num_inference_steps": 1000, "seed": 1}
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(httpx.post, f"{s.url}/v1/images/generations", json=slow, timeout=120)
            wait_until(lambda: client.get("/health").json()["queue"]["running"], what="the image job to start")
            queued = pool.submit(httpx.post, f"{s.url}/v1/images/generations", json=slow, timeout=120)
            wait_until(lambda: client.get("/health").json()["queue"]["waiting"] == 1, what="the second to queue")
            client.close()
            s.proc.send_signal(signal.SIGTERM)
            answers = [running.result(60), queued.result(60)]
        for r in answers:
            assert r.status_code == 503 and r.headers["content-type"] == "application/json", r.text
            assert r.json()["error"]["code"] == "cancelled", r.text
        assert s.proc.wait(60) == 0, s.output()
    finally:
        s.kill()
        s.log.close()


@pytest.fixture(scope="module")
def single_frames(tiny_wan):

    gen = load_generator(tiny_wan, device="cpu")
    kw = {k: v for k, v in REQUEST.items() if k != "size"}
    return gen.generate(**kw, width=48, height=32).frames


@pytest.fixture(scope="module")
def lora_folder(tiny_wan, tmp_path_factory):
    """An adapter folder (--lora-dir) with one LoRA, `a`, in diffusers' layout."""
    from spindle.registry import get_family
    from spindle.testing.lora import random_lora, write_lora

    folder = tmp_path_factory.mktemp("serve-loras")
    write_lora(get_family("wan"), random_lora(tiny_wan, seed=1, std=0.3), folder / "a")
    return folder


@pytest.fixture(scope="module")
def single_lora_frames(tiny_wan, lora_folder):
    """REQUEST on one process with the LoRA `a` at strength 0.5 (`spindle generate --lora`)."""
    gen = load_generator(tiny_wan, device="cpu", lora=str(lora_folder / "a"), lora_scale=0.5)
    kw = {k: v for k, v in REQUEST.items() if k != "size"}
    return gen.generate(**kw, width=48, height=32).frames


@pytest.mark.slow
@pytest.mark.parametrize("mode", [["--cfg-parallel"], ["--sp", "2"]], ids=["cfg_parallel", "sp2"])
def test_multiprocess_serving_equals_single_process(
    tiny_wan, tmp_path, single_frames, lora_folder, single_lora_frames, mode
):
    s = ServeProcess(
        tiny_wan,
        *("--nproc", "2", *mode, "--keep-frames", "--max-queue", "4", "--max-steps", "1000"),
        *("--lora-dir", str(lora_folder)),
        log_path=tmp_path / "serve.log",
    )
    try:
        client = s.wait_ready()
        # a running job cancelled on rank 0 must stop every rank at the same step (no hang) ...
        long = client.post("/v1/videos", json={**REQUEST, "num_inference_steps": 1000}).json()
        deadline = time.monotonic() + 120
        while client.get(f"/v1/videos/{long['id']}").json()["progress"] < 1:
            assert time.monotonic() < deadline, s.output()
            time.sleep(0.05)
        r = client.delete(f"/v1/videos/{long['id']}")
        assert r.status_code == 200 and wait_job(client, long["id"])["status"] == "cancelled"
        ran = 2  # warm-up + the cancelled job
        if "--sp" in mode:
            # 16x16, 1 frame = 1 token: not splittable over 2 SP ranks. Validation sees it before
            # queueing (a 400 naming the size), so it never becomes a failed job
            r = client.post("/v1/videos", json={**REQUEST, "size": "16x16", "num_frames": 1})
            assert r.status_code == 400 and r.json()["error"]["param"] == "size", r.text
            assert "not divisible by parallel.sp=2" in r.json()["error"]["message"]

        # ... and the next jobs run on all ranks and equal the single-process output, with a LoRA
        # adapter loaded on every rank at run time (and the model alone again once it is unloaded)
        def check(jobs: list[tuple[dict, np.ndarray]]) -> None:
            for job, ref in jobs:
                assert wait_job(client, job["id"])["status"] == "completed", s.output()
                frames = np.load(
                    io.BytesIO(client.get(f"/v1/videos/{job['id']}/content", params={"variant": "npy"}).content)
                )
                np.testing.assert_allclose(frames, ref, atol=1e-5, rtol=0)

        assert client.post("/v1/loras", json={"lora_name": "a"}).status_code == 200
        asked = [({}, single_frames), ({"lora": "a", "lora_scale": 0.5}, single_lora_frames), ({}, single_frames)]
        check([(client.post("/v1/videos", json={**REQUEST, **extra}).json(), ref) for extra, ref in asked])
        assert client.delete("/v1/loras/a").status_code == 200
        check([(client.post("/v1/videos", json=REQUEST).json(), single_frames)])
        client.close()
        rc = s.stop()
        log = s.output()
        assert rc == 0, log
        assert f"rank 1] spindle.serve: rank 1: stopped after {ran + 4} jobs" in log, log
        assert "lora_load" not in log and "lora_unload" not in log, log  # no follower failed to mirror them
    finally:
        s.kill()
