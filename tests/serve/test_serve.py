"""`spindle serve` app against a real uvicorn server on a loopback port, real HTTP (httpx and the
official openai client), real engine (the tiny Wan checkpoint, 32x32, 5 frames, 2 steps).

To hold a job in progress deterministically (queue overload, cancelling a running job) a test
blocks the transformer's forward with a pre-hook on a threading.Event; to make one job fail it
arms a hook that raises once inside the engine. Both act on the real engine's transformer.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from spindle.api import load_generator
from spindle.serve import build_app
from spindle.serve.server import make_server
from spindle.testing.multiprocess import free_port
from tests.conftest import failing_next_forward

KW = dict(prompt="a red kite over the sea", size="32x32", num_frames=5, num_inference_steps=2, guidance_scale=4.0)


class LiveServer:
    """The server `spindle serve` runs (uvicorn with Spindle's connection guard), in a background
    thread on a free loopback port."""

    def __init__(self, app):
        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = make_server(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        self.client = httpx.Client(base_url=self.url, timeout=60)
        return self

    def __exit__(self, *exc) -> None:
        self.client.close()
        self.server.should_exit = True
        self.thread.join(60)
        assert not self.thread.is_alive()

    @property
    def state(self):
        return self.app.state.serve

    def openai_client(self):
        """The official OpenAI client pointed at this server (no retries: a refusal shows at once)."""
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def wait(self, job_id: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            r = self.client.get(f"/v1/videos/{job_id}")
            assert r.status_code == 200, r.text
            body = r.json()
            if body["status"] in ("completed", "failed", "cancelled"):
                return body
            assert time.monotonic() < deadline, f"job {job_id} still {body['status']}"
            time.sleep(0.02)


@pytest.fixture(scope="module")
def gen(tiny_wan):

    return load_generator(tiny_wan, device="cpu")


@contextlib.contextmanager
def live_servers(gen, root, model_id: str):
    """`start(**options)` -> a started LiveServer serving `gen` (the checkpoint at `root`, as `model_id` unless the
    options name one); every server started is stopped on exit."""
    with contextlib.ExitStack() as stack:

        def start(**options) -> LiveServer:
            options.setdefault("model_id", model_id)
            return stack.enter_context(LiveServer(build_app(gen, root=str(root), **options)))

        yield start


@pytest.fixture
def serve(gen, tiny_wan):
    """`serve(**options)` -> a started LiveServer over the module's generator (stopped after the test)."""
    with live_servers(gen, tiny_wan, "tiny-wan") as start:
        yield start


@contextlib.contextmanager
def gate(gen):
    """Blocks every transformer forward until `release` is set; `entered` tells a job is inside."""
    entered, release = threading.Event(), threading.Event()

    def hook(module, args, kwargs):
        entered.set()
        assert release.wait(60), "gate never released"

    handle = gen.transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield entered, release
    finally:
        release.set()
        handle.remove()


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def decode_mp4(data: bytes) -> np.ndarray:
    import av

    with av.open(io.BytesIO(data)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])


# ---------------------------------------------------------------------------------------------


def test_health_models_and_unknown_routes(serve):
    s = serve()
    r = s.client.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["media"] == "video"
    models = s.client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny-wan"]
    card = models["data"][0]
    assert card["object"] == "model" and card["owned_by"] == "spindle" and card["family"] == "wan"
    assert isinstance(card["created"], int)
    assert s.client.get("/v1/models/tiny-wan").json()["id"] == "tiny-wan"
    assert_error(s.client.get("/v1/models/other"), 404, "model", "model_not_found")
    assert_error(s.client.get("/v1/nothing"), 404)
    for path in ("/v1/videos/video_nope", "/v1/videos/video_nope/content"):
        assert_error(s.client.get(path), 404, "video_id", "not_found")
    assert_error(s.client.delete("/v1/videos/video_nope"), 404, "video_id", "not_found")


def test_video_job_end_to_end_equals_the_engine(serve, gen):
    s = serve(keep_frames=True)
    r = s.client.post("/v1/videos", json={**KW, "seed": 7, "negative_prompt": "blurry"})
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["object"] == "video" and job["id"].startswith("video_") and job["status"] in ("queued", "in_progress")
    assert (job["size"], job["num_frames"], job["seed"], job["model"]) == ("32x32", 5, 7, "tiny-wan")
    done = s.wait(job["id"])
    assert done["status"] == "completed" and done["progress"] == 100 and done["error"] is None
    assert done["completed_at"] >= done["created_at"] and done["expires_at"] > done["completed_at"]
    assert {"before_denoising", "denoising", "decoding", "encode"} <= set(done["timings"])

    content = s.client.get(f"/v1/videos/{job['id']}/content")
    assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
    video = decode_mp4(content.content)
    assert video.shape == (5, 32, 32, 3)
    # exactly what the engine makes for the same request
    ref = gen.generate(
        prompt=KW["prompt"],
        negative_prompt="blurry",
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=2,
        guidance_scale=4.0,
        seed=7,
    ).frames
    exact = np.load(io.BytesIO(s.client.get(f"/v1/videos/{job['id']}/content", params={"variant": "npy"}).content))
    np.testing.assert_array_equal(exact, ref)
    assert np.abs(video.astype(np.float32) / 255 - ref[0]).mean() < 0.05  # the mp4 is that video (lossy)
    thumb = s.client.get(f"/v1/videos/{job['id']}/content", params={"variant": "thumbnail"})
    assert thumb.status_code == 200 and thumb.content[:8] == b"\x89PNG\r\n\x1a\n"
    assert_error(s.client.get(f"/v1/videos/{job['id']}/content", params={"variant": "spritesheet"}), 400, "variant")
    assert [j["id"] for j in s.client.get("/v1/videos").json()["data"]] == [job["id"]]


def test_seconds_become_valid_frame_counts(serve):
    s = serve()
    r = s.client.post(
        "/v1/videos", json={"prompt": "waves", "size": "32x32", "seconds": "0.5", "num_inference_steps": 2}
    )
    job = r.json()
    # 0.5 s x 16 fps = 8 frames; Wan takes 4k+1 -> 9, and the response says so
    assert r.status_code == 200 and job["num_frames"] == 9 and job["fps"] == 16 and job["seconds"] == "0.5625"
    assert "num_frames=9" in job["notes"][0]
    exact = s.client.post(
        "/v1/videos", json={"prompt": "waves", "size": "32x32", "seconds": 0.3125, "num_inference_steps": 2}
    ).json()
    assert exact["num_frames"] == 5 and exact["notes"] == []
    for jid in (job["id"], exact["id"]):
        assert s.wait(jid)["status"] == "completed"
    assert decode_mp4(s.client.get(f"/v1/videos/{job['id']}/content").content).shape[0] == 9


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({**KW, "size": "32"}, 400, "size"),
        ({**KW, "size": "thirty-twoxforty"}, 400, "size"),
        ({**KW, "size": "30x32"}, 400, "size"),  # width not a multiple of 16 (engine check)
        ({**KW, "num_frames": 6}, 400, "num_frames"),  # not 4k+1
        ({**{k: v for k, v in KW.items() if k != "num_frames"}, "seconds": 1, "num_frames": 5}, 400, "seconds"),
        ({**KW, "prompt": "   "}, 400, "prompt"),
        ({k: v for k, v in KW.items() if k != "prompt"}, 422, "prompt"),
        ({**KW, "num_inference_steps": 0}, 422, "num_inference_steps"),
        ({**KW, "seed": -1}, 422, "seed"),
        ({**KW, "guidance_scale": "lots"}, 422, "guidance_scale"),
        ({**KW, "seconds": -2, "num_frames": None}, 422, "seconds"),
        ({**KW, "num_step": 4}, 422, "num_step"),  # a typo is named, not ignored
    ],
    ids=[
        "size-format",
        "size-words",
        "size-multiple",
        "frames-4k+1",
        "frames-and-seconds",
        "blank-prompt",
        "no-prompt",
        "steps-0",
        "seed-negative",
        "guidance-type",
        "seconds-negative",
        "unknown-field",
    ],
)
def test_invalid_video_requests_are_refused_at_once(serve, body, status, param):
    s = serve()
    err = assert_error(s.client.post("/v1/videos", json=body), status, param)
    assert err["type"] == "invalid_request_error"
    assert s.state.store.stats()["stored"] == 0 and s.state.store.counters["submitted"] == 0  # nothing queued


def test_malformed_bodies(serve):
    s = serve()
    assert_error(s.client.post("/v1/videos", content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert_error(s.client.post("/v1/videos", json=[1, 2]), 400)
    assert_error(s.client.post("/v1/images/generations", json={"n": 1}), 422, "prompt")


def test_images_endpoint_on_a_video_model_points_to_videos(serve):
    import openai

    s = serve()
    err = assert_error(
        s.client.post("/v1/images/generations", json={"prompt": "a cat", "size": "32x32"}),
        400,
        "model",
        "use_videos_endpoint",
    )
    assert "/v1/videos" in err["message"]
    client = s.openai_client()
    with pytest.raises(openai.BadRequestError) as info:
        client.images.generate(prompt="a cat", size="256x256", response_format="b64_json")
    assert info.value.status_code == 400 and "/v1/videos" in info.value.message


def test_openai_client_videos_create_retrieve_download(serve):
    """The official client sends /videos as multipart/form-data; extras go through extra_body."""
    import warnings

    s = serve()
    client = s.openai_client()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        video = client.videos.create(
            prompt="a lighthouse", size="32x32", seconds="4", extra_body={"num_inference_steps": 2, "seed": 3}
        )
        assert video.status in ("queued", "in_progress") and video.size == "32x32"
        s.wait(video.id)
        video = client.videos.retrieve(video.id)
        assert video.status == "completed" and video.progress == 100
        data = client.videos.download_content(video.id).read()
    frames = decode_mp4(data)
    assert frames.shape == (65, 32, 32, 3)  # 4 s x 16 fps = 64 -> 65 (4k+1)


def test_text_to_video_model_refuses_an_input_reference(serve):
    import base64

    from PIL import Image

    s = serve()

    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, "PNG")
    for r in (
        s.client.post(
            "/v1/videos", files={"prompt": (None, "a"), "input_reference": ("a.png", buf.getvalue(), "image/png")}
        ),
        s.client.post(
            "/v1/videos",
            json={**KW, "input_reference": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()},
        ),
    ):
        err = assert_error(r, 400, "input_reference", "invalid_request")
        assert "input_reference is not taken by wan" in err["message"], err


def test_cancel_queued_and_running_jobs(serve, gen):
    s = serve()
    with gate(gen) as (entered, release):
        running = s.client.post("/v1/videos", json={**KW, "seed": 1}).json()
        assert entered.wait(30)
        queued = s.client.post("/v1/videos", json={**KW, "seed": 2}).json()
        assert s.client.get(f"/v1/videos/{running['id']}").json()["status"] == "in_progress"
        assert s.client.get(f"/v1/videos/{queued['id']}").json()["queue_position"] == 0
        # queued: removed from the queue at once
        r = s.client.delete(f"/v1/videos/{queued['id']}")
        assert r.status_code == 200 and r.json()["status"] == "cancelled"
        assert_error(s.client.get(f"/v1/videos/{queued['id']}/content"), 409, "video_id", "video_cancelled")
        # running: not done while the forward is held; the engine stops before its next step
        assert_error(s.client.get(f"/v1/videos/{running['id']}/content"), 409, "video_id", "video_not_ready")
        with ThreadPoolExecutor(1) as pool:
            deleting = pool.submit(s.client.delete, f"/v1/videos/{running['id']}")
            time.sleep(0.3)
            release.set()
            r = deleting.result(30)
    assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
    assert s.client.get(f"/v1/videos/{running['id']}").json()["status"] == "cancelled"
    # and the server goes on serving
    after = s.client.post("/v1/videos", json={**KW, "seed": 3}).json()
    assert s.wait(after["id"])["status"] == "completed"
    counts = s.state.store.counters
    assert (counts["cancelled"], counts["completed"]) == (2, 1)


def test_overload_gets_429_with_retry_after_and_jobs_run_in_order(serve, gen):
    s = serve(max_queue=2)
    with gate(gen) as (entered, release):
        first = s.client.post("/v1/videos", json={**KW, "seed": 10}).json()
        assert entered.wait(30)
        waiting = [s.client.post("/v1/videos", json={**KW, "seed": 11 + i}) for i in range(2)]
        assert all(r.status_code == 200 for r in waiting)
        r = s.client.post("/v1/videos", json={**KW, "seed": 13})
        err = assert_error(r, 429, code="queue_full")
        assert err["type"] == "rate_limit_error" and int(r.headers["Retry-After"]) >= 1
        assert s.client.get("/health").json()["queue"]["waiting"] == 2
        release.set()
    ids = [first["id"]] + [r.json()["id"] for r in waiting]
    assert [s.wait(i)["status"] for i in ids] == ["completed"] * 3
    jobs = [s.state.store.get(i) for i in ids]
    starts = [j.started_at for j in jobs]
    assert starts == sorted(starts) and all(a.completed_at <= b.started_at for a, b in itertools.pairwise(jobs))
    assert s.client.post("/v1/videos", json={**KW, "seed": 14}).status_code == 200  # room again


def test_a_failing_job_fails_alone(serve, gen):
    s = serve()
    with failing_next_forward(gen.transformer, "injected fault in the transformer"):
        bad = s.client.post("/v1/videos", json={**KW, "seed": 5}).json()
        good = s.client.post("/v1/videos", json={**KW, "seed": 6}).json()
        failed = s.wait(bad["id"])
        assert failed["status"] == "failed" and "injected fault" in failed["error"]["message"]
        assert failed["error"]["code"] == "generation_failed"
        err = assert_error(s.client.get(f"/v1/videos/{bad['id']}/content"), 500, code="generation_failed")
        assert "injected fault" in err["message"] and err["type"] == "server_error"
        assert s.wait(good["id"])["status"] == "completed"
        assert s.client.get(f"/v1/videos/{good['id']}/content").status_code == 200
        assert s.client.get("/health").status_code == 200


def test_a_failing_done_callback_is_logged_and_the_others_still_run(caplog):
    from spindle.contracts.request import SamplingParams, ValidRequest
    from spindle.serve import Job, JobStore

    store = JobStore(max_queue=2)
    job = store.submit(Job(kind="video", request=ValidRequest("wan", SamplingParams(prompt="x")), model="m"))
    seen = []

    def gone_client(j):
        raise ConnectionResetError("client went away")

    job.add_done_callback(gone_client)
    job.add_done_callback(seen.append)
    with caplog.at_level("ERROR", logger="spindle.serve"):
        store.finish(job, "cancelled")
    assert seen == [job] and job.status == "cancelled"
    assert f"job {job.id}: a done callback failed" in caplog.text and "client went away" in caplog.text


def test_finished_results_expire_and_delete(serve):
    s = serve(result_ttl=2.0)
    a = s.client.post("/v1/videos", json={**KW, "seed": 1}).json()
    done = s.wait(a["id"])
    assert done["status"] == "completed" and done["expires_at"] - done["completed_at"] in (1, 2, 3)
    finished = s.state.store.get(a["id"]).completed_at  # read now: under load job b may outlast a's 2 s
    assert s.client.get(f"/v1/videos/{a['id']}/content").status_code == 200
    b = s.client.post("/v1/videos", json={**KW, "seed": 2}).json()
    assert s.wait(b["id"])["status"] == "completed"
    r = s.client.delete(f"/v1/videos/{b['id']}")  # DELETE of a finished job deletes it
    assert r.status_code == 200 and r.json()["deleted"] is True
    assert_error(s.client.get(f"/v1/videos/{b['id']}"), 410, code="deleted")
    time.sleep(max(0.0, finished + 2.2 - time.time()))
    assert_error(s.client.get(f"/v1/videos/{a['id']}"), 410, "video_id", "expired")
    err = assert_error(s.client.get(f"/v1/videos/{a['id']}/content"), 410, "video_id", "expired")
    assert "--result-ttl" in err["message"]
    assert s.state.store.stats()["stored"] == 0


def test_finished_results_past_max_results_drop_the_oldest_first(serve, gen):
    from spindle.serve import ServeLimits

    s = serve(limits=ServeLimits(max_results=2))
    assert s.client.get("/health").json()["limits"]["max_results"] == 2
    assert s.client.get("/v1/models").json()["data"][0]["limits"]["max_results"] == 2

    def create(seed: int) -> str:
        r = s.client.post("/v1/videos", json={**KW, "seed": seed})
        assert r.status_code == 200, r.text
        return r.json()["id"]

    def status(job_id: str) -> int:
        return s.client.get(f"/v1/videos/{job_id}").status_code

    a = create(1)
    assert s.wait(a)["status"] == "completed"
    b = create(2)
    assert s.wait(b)["status"] == "completed"
    with gate(gen) as (entered, release):
        c = create(3)
        assert entered.wait(60)
        d, e = create(4), create(5)  # c runs, d and e wait
        assert s.client.delete(f"/v1/videos/{d}").json()["status"] == "cancelled"  # a third finished job
        # a (the oldest finished) is dropped; the running and the waiting jobs are not, whatever their age
        for path in (f"/v1/videos/{a}", f"/v1/videos/{a}/content"):
            err = assert_error(s.client.get(path), 410, "video_id", "expired")
            assert "--max-results" in err["message"] and "at most 2 finished results" in err["message"]
        assert [status(x) for x in (b, c, d, e)] == [200, 200, 200, 200]
        assert s.client.get(f"/v1/videos/{c}").json()["status"] == "in_progress"
        assert s.client.get(f"/v1/videos/{e}").json()["status"] == "queued"
        release.set()
        assert s.wait(c)["status"] == "completed" and s.wait(e)["status"] == "completed"
    # finish order b, d, c, e: the two newest stay
    assert [status(x) for x in (a, b, d, c, e)] == [410, 410, 410, 200, 200]
    assert s.client.get(f"/v1/videos/{e}/content").status_code == 200
    queue = s.client.get("/health").json()["queue"]
    assert queue["finished_stored"] == 2 and queue["dropped"] == 3
    listed = s.client.get("/v1/videos").json()["data"]
    assert [j["id"] for j in listed] == [e, c]


def test_burst_of_concurrent_requests_loses_and_duplicates_nothing(serve, gen):
    s = serve(max_queue=64)
    forwards = []
    handle = gen.transformer.register_forward_pre_hook(lambda m, a, k: forwards.append(1), with_kwargs=True)
    n = 12
    try:

        def submit(i: int) -> dict:
            with httpx.Client(base_url=s.url, timeout=60) as c:
                r = c.post("/v1/videos", json={**KW, "prompt": f"scene number {i}", "seed": 100 + i})
                assert r.status_code == 200, r.text
                return r.json()

        with ThreadPoolExecutor(n) as pool:
            created = list(pool.map(submit, range(n)))
        ids = [j["id"] for j in created]
        assert len(set(ids)) == n
        done = [s.wait(i) for i in ids]
    finally:
        handle.remove()
    assert all(d["status"] == "completed" for d in done)
    assert sorted(d["seed"] for d in done) == [100 + i for i in range(n)]
    assert {d["prompt"] for d in done} == {f"scene number {i}" for i in range(n)}
    listed = {j["id"] for j in s.client.get("/v1/videos").json()["data"]}
    assert listed == set(ids)
    counts = s.state.store.counters
    assert (counts["submitted"], counts["completed"]) == (n, n)
    assert len(forwards) == n * 2  # 2 steps x 1 batched-CFG forward each: every job ran exactly once
    contents = {s.client.get(f"/v1/videos/{i}/content").content for i in ids}
    assert len(contents) == n  # distinct seeds/prompts -> distinct videos, none swapped or dropped


def test_retry_after_is_the_queue_ahead_times_recent_completed_job_times():
    """The issue's case: a long cancelled job must not inflate the estimate (7 s while jobs took 0.1 s)."""
    from spindle.contracts.request import SamplingParams, ValidRequest
    from spindle.serve.jobs import Job, JobStore, QueueFull

    now = [1000.0]
    store = JobStore(max_queue=3, clock=lambda: now[0])

    def run(seconds: float, status: str) -> None:
        job = store.submit(Job(kind="video", request=ValidRequest("wan", SamplingParams(prompt="p")), model="m"))
        assert store.next_job(timeout=0) is job
        now[0] += seconds
        store.finish(job, status)

    assert store.retry_after() == 1  # nothing known, nothing ahead
    for _ in range(4):
        run(0.5, "completed")
    run(70.0, "cancelled")  # given up on after 70 s: says nothing about how long jobs take
    run(0.01, "failed")  # failed at once: neither
    running = store.submit(Job(kind="video", request=ValidRequest("wan", SamplingParams(prompt="p")), model="m"))
    assert store.next_job(timeout=0) is running
    for _ in range(3):
        store.submit(Job(kind="video", request=ValidRequest("wan", SamplingParams(prompt="p")), model="m"))
    # 3 waiting x 0.5 s + what is left of the running one (0.5 s, just started) = 2 s
    with pytest.raises(QueueFull) as info:
        store.submit(Job(kind="video", request=ValidRequest("wan", SamplingParams(prompt="p")), model="m"))
    assert info.value.status == 429 and info.value.headers["Retry-After"] == "2"
    now[0] += 0.4  # the running job is nearly done: 1.5 + 0.1 -> 2 (rounded up)
    assert store.retry_after() == 2
    now[0] += 10.0  # running past the mean: only the waiting ones count
    assert store.retry_after() == 2
    # jobs get slower: the estimate follows the recent ones (the last 20 completed)
    store.finish(running, "completed")
    while (job := store.next_job(timeout=0)) is not None:  # the three that waited
        now[0] += 4.0
        store.finish(job, "completed")
    for _ in range(17):
        run(4.0, "completed")
    for _ in range(2):
        store.submit(Job(kind="video", request=ValidRequest("wan", SamplingParams(prompt="p")), model="m"))
    assert store.retry_after() == 8  # 2 waiting x 4 s, nothing running


def test_video_requests_name_the_served_model_and_refuse_booleans(serve):
    s = serve()
    r = s.client.post("/v1/videos", json={**KW, "model": "sora-2"})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "tiny-wan"
    err = assert_error(s.client.post("/v1/videos", json={**KW, "model": "dall-e-3"}), 404, "model", "model_not_found")
    assert "'tiny-wan'" in err["message"] and "'sora-2'" in err["message"]
    for name, value in [("num_frames", True), ("num_frames", "5"), ("num_inference_steps", "2"), ("seed", True)]:
        assert_error(s.client.post("/v1/videos", json={**KW, name: value}), 422, name)
    no_frames = {k: v for k, v in KW.items() if k != "num_frames"}
    assert_error(s.client.post("/v1/videos", json={**no_frames, "seconds": True}), 422, "seconds")
    err = assert_error(s.client.post("/v1/videos", json={**no_frames, "seconds": 20}), 400, "seconds")
    assert err["message"].startswith("seconds: num_frames is 321;")  # the frames `seconds` asked for, named as sent
    assert s.state.store.counters["submitted"] == 1
    assert s.wait(r.json()["id"])["status"] == "completed"


def test_the_engine_runs_only_validated_requests(gen):
    """A job is validated once, when it is submitted: the engine runs the frozen `ValidRequest` that validation
    returns, as it is, and takes nothing else (plain params are a TypeError, not validated a second time)."""
    import dataclasses

    from spindle.contracts.request import SamplingParams, ValidRequest
    from spindle.serve.engine import Engine

    engine = Engine(gen, "tiny-wan")
    asked = SamplingParams(prompt="x", height=32, width=32, num_frames=5, num_inference_steps=1, seed=3)
    with pytest.raises(TypeError, match=r"Engine\.run takes a ValidRequest"):
        engine.run(asked)
    valid = engine.validate(asked)
    assert isinstance(valid, ValidRequest) and valid.family == "wan"
    with pytest.raises(dataclasses.FrozenInstanceError):
        valid.family = "flux"  # type: ignore[misc]
    valid.params.height = 64  # a reader gets a copy: the request itself never changes
    assert valid.params.height == 32 and valid.params.guidance_scale == gen.defaults.guidance_scale
    result = engine.run(valid)
    assert result.seed == 3 and result.frames.shape == (1, 5, 32, 32, 3)
    np.testing.assert_array_equal(result.frames, gen.run(asked).frames)  # what the Python API makes of the same


def test_an_unknown_body_field_names_the_closest_valid_one(serve):
    s = serve()
    err = assert_error(s.client.post("/v1/videos", json={**KW, "guidance_scal": 3.0}), 422, "guidance_scal")
    assert "did you mean 'guidance_scale'?" in err["message"], err
    err = assert_error(s.client.post("/v1/videos", json={**KW, "strength": 0.5}), 422, "strength")
    assert "did you mean" not in err["message"], err  # nothing close: no guess
