"""LoRA adapters loaded at run time and chosen per request (`spindle serve --lora-dir DIR --max-loras N`),
over real HTTP: a video family (tiny Wan) and an image family (tiny Flux). Requests with different
adapters, interleaved on one server, each equal the same request run alone (a generator loaded with
that LoRA, as `spindle generate --lora` does, or without one); load / list / unload; the bounded
cache (LRU eviction that frees the weights, never under a waiting request); paths outside the
adapter folder refused; bad fields answered 4xx naming them."""

from __future__ import annotations

import gc
import io
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from spindle.api import load_generator
from spindle.contracts.request import SamplingParams, ValidRequest
from spindle.models.wan.lora import to_original
from spindle.registry import get_family
from spindle.serve import build_app
from spindle.testing.lora import random_lora, random_lora_model, write_lora, write_peft_folder
from tests.serve.test_serve import LiveServer, assert_error

VIDEO = dict(prompt="a red circle moves left", size="32x32", num_frames=1, num_inference_steps=2, seed=5)
IMAGE = dict(prompt="a lighthouse on a cliff", size="32x32", num_inference_steps=2, seed=4)
STD = 0.3  # random adapters this strong move the tiny models' outputs by ~0.1-0.3


def engine_kwargs(request: dict) -> dict:
    kw = {k: v for k, v in request.items() if k != "size"}
    kw["width"], kw["height"] = map(int, request["size"].split("x"))
    return kw


def unload_all(server: LiveServer) -> None:
    for card in server.client.get("/v1/loras").json()["data"]:
        assert server.client.delete(f"/v1/loras/{card['name']}").status_code == 200


def lora_params(server: LiveServer, name: str) -> list[weakref.ref]:
    """Weak references to the adapter's tensors in the served transformer."""
    transformer = server.state.engine.generator.transformer
    return [weakref.ref(p) for n, p in transformer.named_parameters() if f".{name}." in n]


# ---------------------------------------------------------------- Wan (video)


@pytest.fixture(scope="module")
def wan_loras(tiny_wan, tmp_path_factory):
    """The adapter folder: `a/` (diffusers' layout, written by WanPipeline.save_lora_weights),
    `b.safetensors` (the original Wan layout, read through diffusers' converter), `c/` (a PEFT adapter
    folder), and a file outside it."""
    family = get_family("wan")
    root = tmp_path_factory.mktemp("wan-loras")
    folder = root / "loras"
    write_lora(family, random_lora(tiny_wan, seed=1, std=STD), folder / "a")
    save_file(to_original(random_lora(tiny_wan, seed=2, std=STD)), str(folder / "b.safetensors"))
    write_peft_folder(random_lora_model(tiny_wan, seed=3, alpha=3.0, std=STD), folder / "c")
    save_file(to_original(random_lora(tiny_wan, seed=4, std=STD)), str(root / "outside.safetensors"))
    return folder


@pytest.fixture(scope="module")
def wan_server(tiny_wan, wan_loras):
    gen = load_generator(tiny_wan, device="cpu")
    gen.enable_adapters(wan_loras, max_loras=2)
    with LiveServer(build_app(gen, model_id="tiny-wan", root=str(tiny_wan), keep_frames=True)) as s:
        yield s


def video_frames(s: LiveServer, job_id: str) -> np.ndarray:
    r = s.client.get(f"/v1/videos/{job_id}/content", params={"variant": "npy"})
    assert r.status_code == 200, r.text
    return np.load(io.BytesIO(r.content))


def test_interleaved_video_requests_with_different_adapters_equal_each_run_alone(wan_server, tiny_wan, wan_loras):
    s = wan_server
    unload_all(s)
    for name in ("a", "b"):
        r = s.client.post("/v1/loras", json={"lora_name": name})
        assert r.status_code == 200, r.text
    # queued back to back, run in this order by the one worker: a, none, b (half strength), a again
    asked = [("a", None), (None, None), ("b", 0.5), ("a", None)]
    jobs = []
    for name, scale in asked:
        extra = {"lora": name} if name else {}
        if scale is not None:
            extra["lora_scale"] = scale
        r = s.client.post("/v1/videos", json={**VIDEO, **extra})
        assert r.status_code == 200, r.text
        jobs.append(r.json())
    assert [j["lora"] for j in jobs] == [
        {"name": "a", "scale": 1.0},
        None,
        {"name": "b", "scale": 0.5},
        {"name": "a", "scale": 1.0},
    ]
    served = []
    for job in jobs:
        done = s.wait(job["id"])
        assert done["status"] == "completed", done
        served.append(video_frames(s, job["id"]))

    kw = engine_kwargs(VIDEO)
    alone = {
        "a": load_generator(tiny_wan, device="cpu", lora=str(wan_loras / "a")).generate(**kw).frames,
        None: load_generator(tiny_wan, device="cpu").generate(**kw).frames,
        "b": load_generator(tiny_wan, device="cpu", lora=str(wan_loras / "b.safetensors"), lora_scale=0.5)
        .generate(**kw)
        .frames,
    }
    for (name, _), frames in zip(asked, served, strict=True):
        np.testing.assert_allclose(frames, alone[name], rtol=0, atol=1e-5, err_msg=f"adapter {name}")
    # the adapters change the output (the comparison above can tell them apart)
    assert np.abs(alone["a"] - alone[None]).max() > 1e-2 and np.abs(alone["b"] - alone[None]).max() > 1e-2
    # never merged: every LoRA layer still holds the base weights apart from the adapters
    from peft.tuners.lora import LoraLayer

    layers = [m for m in s.state.engine.generator.transformer.modules() if isinstance(m, LoraLayer)]
    assert layers and not any(m.merged for m in layers)


def test_load_list_get_and_unload(wan_server):
    c = wan_server.client
    unload_all(wan_server)
    listing = c.get("/v1/loras").json()
    assert listing["available"] == ["a", "b.safetensors", "c"] and listing["max_loras"] == 2
    # SGLang-diffusion's names: set_lora (lora_nickname) loads, list_loras lists
    r = c.post("/v1/set_lora", json={"lora_nickname": "b", "lora_path": "b.safetensors"})
    assert r.status_code == 200, r.text
    assert r.json()["name"] == "b" and r.json()["path"] == "b.safetensors" and r.json()["parameters"] > 0
    assert "b" in [card["name"] for card in c.get("/v1/list_loras").json()["data"]]
    again = c.post("/v1/loras", json={"lora_name": "b", "lora_path": "b.safetensors"})
    assert again.status_code == 200 and again.json()["evicted"] == []  # the same file: nothing to do
    assert_error(c.post("/v1/loras", json={"lora_name": "b", "lora_path": "c"}), 409, "lora_name")
    card = c.get("/v1/loras/b").json()
    assert card["object"] == "lora" and card["in_use"] == 0
    tensors = lora_params(wan_server, "b")
    assert tensors
    r = c.delete("/v1/loras/b")
    assert r.status_code == 200 and r.json() == {"name": "b", "object": "lora", "deleted": True}
    gc.collect()
    assert all(ref() is None for ref in tensors), "the unloaded adapter's weights are still held"
    assert_error(c.get("/v1/loras/b"), 404, code="lora_not_found")
    assert_error(c.delete("/v1/loras/b"), 404, code="lora_not_found")
    err = assert_error(c.post("/v1/videos", json={**VIDEO, "lora": "b"}), 400, "lora")
    assert "'b'" in err["message"] and "loaded:" in err["message"]


def test_cache_evicts_the_least_recently_used_and_never_a_held_adapter(wan_server):
    s, c = wan_server, wan_server.client
    unload_all(s)
    for name in ("a", "b"):
        assert c.post("/v1/loras", json={"lora_name": name}).status_code == 200
    r = c.post("/v1/videos", json={**VIDEO, "lora": "a"})  # a: used last
    assert r.status_code == 200 and s.wait(r.json()["id"])["status"] == "completed"
    a_tensors, b_tensors = lora_params(s, "a"), lora_params(s, "b")
    r = c.post("/v1/loras", json={"lora_name": "c"})
    assert r.status_code == 200 and r.json()["evicted"] == ["b"], r.text
    assert sorted(card["name"] for card in c.get("/v1/loras").json()["data"]) == ["a", "c"]
    gc.collect()
    assert all(ref() is None for ref in b_tensors) and all(ref() is not None for ref in a_tensors)
    # a request that waits holds its adapter: neither evicted nor unloaded under it
    release_a = s.state.engine.hold(SamplingParams(lora="a"))
    release_c = s.state.engine.hold(SamplingParams(lora="c"))
    try:
        assert_error(c.post("/v1/loras", json={"lora_name": "b"}), 409, code="lora_cache_full")
        err = assert_error(c.delete("/v1/loras/a"), 409, code="lora_in_use")
        assert "1 waiting or running" in err["message"]
        assert c.get("/v1/loras/a").json()["in_use"] == 1
    finally:
        release_a()
        release_c()
    r = c.post("/v1/loras", json={"lora_name": "b"})
    assert r.status_code == 200 and r.json()["evicted"] == ["a"]


def test_paths_outside_the_adapter_folder_are_refused(wan_server, wan_loras):
    c = wan_server.client
    before = c.get("/v1/loras").json()["data"]
    for path in ("../outside.safetensors", str(wan_loras.parent / "outside.safetensors"), "/etc/passwd"):
        err = assert_error(c.post("/v1/loras", json={"lora_name": "x", "lora_path": path}), 403, "lora_path")
        assert str(wan_loras.resolve()) in err["message"] and "--lora-dir" in err["message"]
    link = wan_loras / "escape.safetensors"
    link.symlink_to(wan_loras.parent / "outside.safetensors")
    try:
        assert_error(c.post("/v1/loras", json={"lora_name": "x", "lora_path": "escape.safetensors"}), 403)
    finally:
        link.unlink()
    err = assert_error(c.post("/v1/loras", json={"lora_name": "x", "lora_path": "nope.safetensors"}), 404)
    assert "available: a, b.safetensors, c" in err["message"]
    assert_error(c.post("/v1/loras", json={"lora_name": "no/slash", "lora_path": "a"}), 400, "lora_name")
    assert_error(c.post("/v1/loras", json={"lora_name": "a.b", "lora_path": "a"}), 400, "lora_name")
    assert_error(c.post("/v1/loras", json={"lora_path": "a"}), 422, "lora_name")
    assert_error(c.post("/v1/loras", json={"lora_name": "x", "target": "all"}), 422, "target")
    assert c.get("/v1/loras").json()["data"] == before


def test_a_file_that_does_not_fit_is_refused_and_leaves_nothing(wan_server, wan_loras):
    c = wan_server.client
    flux_lora = wan_loras / "flux_style.safetensors"
    save_file(
        {
            "transformer.single_transformer_blocks.0.proj_mlp.lora_A.weight": torch.zeros(4, 32),
            "transformer.single_transformer_blocks.0.proj_mlp.lora_B.weight": torch.zeros(64, 4),
        },
        str(flux_lora),
    )
    try:
        err = assert_error(c.post("/v1/loras", json={"lora_name": "fx", "lora_path": "flux_style.safetensors"}), 400)
        assert "does not fit this wan checkpoint" in err["message"] or "no key for any module" in err["message"]
    finally:
        flux_lora.unlink()
    assert "fx" not in [card["name"] for card in c.get("/v1/loras").json()["data"]]
    assert not lora_params(wan_server, "fx")


@pytest.mark.parametrize(
    "extra, status, param",
    [
        ({"lora": "unknown"}, 400, "lora"),
        ({"lora_scale": 0.5}, 400, "lora_scale"),  # a scale with no adapter to scale
        ({"lora": "a", "lora_scale": "0.5"}, 422, "lora_scale"),  # JSON numbers are strict
        ({"lora": "a", "lora_scale": True}, 422, "lora_scale"),
        ({"lora": 3}, 422, "lora"),
        ({"lora": ""}, 422, "lora"),
    ],
)
def test_bad_adapter_fields_are_4xx_naming_them(wan_server, extra, status, param):
    c = wan_server.client
    if c.get("/v1/loras/a").status_code == 404:
        assert c.post("/v1/loras", json={"lora_name": "a"}).status_code == 200
    err = assert_error(c.post("/v1/videos", json={**VIDEO, **extra}), status, param)
    if param == "lora" and status == 400:
        assert "no loaded LoRA adapter named 'unknown'" in err["message"] and "a" in err["message"].split("loaded:")[1]


def test_multipart_requests_name_the_adapter(wan_server):
    """The openai client sends /v1/videos as multipart: `lora` / `lora_scale` arrive as form text."""
    s = wan_server
    if s.client.get("/v1/loras/a").status_code == 404:
        assert s.client.post("/v1/loras", json={"lora_name": "a"}).status_code == 200
    fields = {**{k: str(v) for k, v in VIDEO.items()}, "lora": "a", "lora_scale": "0.25"}
    r = s.client.post("/v1/videos", files=[(k, (None, v)) for k, v in fields.items()])
    assert r.status_code == 200, r.text
    assert r.json()["lora"] == {"name": "a", "scale": 0.25}
    assert s.wait(r.json()["id"])["status"] == "completed"
    bad = {**fields, "lora_scale": "strong"}
    assert_error(s.client.post("/v1/videos", files=[(k, (None, v)) for k, v in bad.items()]), 422, "lora_scale")


def test_a_server_without_an_adapter_folder_loads_none(tiny_wan):
    with LiveServer(build_app(load_generator(tiny_wan, device="cpu"), model_id="tiny-wan")) as s:
        err = assert_error(s.client.post("/v1/loras", json={"lora_name": "a"}), 403, code="lora_loading_disabled")
        assert "--lora-dir" in err["message"]
        assert s.client.get("/v1/loras").json() == {
            "object": "list",
            "data": [],
            "available": [],
            "lora_dir": None,
            "max_loras": None,
        }
        err = assert_error(s.client.post("/v1/videos", json={**VIDEO, "lora": "a"}), 400, "lora")
        assert "--lora-dir" in err["message"]


def test_jobs_of_a_server_started_with_a_lora_name_it(tiny_wan, wan_loras):
    """`spindle serve --lora FILE --lora-scale S`: the model runs with that adapter, and every job's response
    says so (it said "lora": null)."""
    gen = load_generator(tiny_wan, device="cpu", lora=str(wan_loras / "b.safetensors"), lora_scale=0.5)
    with LiveServer(build_app(gen, model_id="tiny-wan")) as s:
        r = s.client.post("/v1/videos", json=VIDEO)
        assert r.status_code == 200, r.text
        assert r.json()["lora"] == {"name": "b", "scale": 0.5}
        assert s.wait(r.json()["id"])["lora"] == {"name": "b", "scale": 0.5}


def test_a_peft_adapter_folder_equals_the_same_adapter_in_diffusers_layout(tiny_wan, tmp_path):
    """PEFT's own folder (alpha / r applied at run time) and Spindle's diffusers-layout export of the
    same adapter (alpha / r folded into lora_B, read by diffusers) give the same output."""
    from spindle.train.lora import adapter_state_dict, lora_scale

    model = random_lora_model(tiny_wan, seed=6, alpha=3.0, std=STD)
    write_peft_folder(model, tmp_path / "peft")
    write_lora(get_family("wan"), adapter_state_dict(model.state_dict(), lora_scale(model)), tmp_path / "diffusers")
    kw = engine_kwargs(VIDEO)
    peft = load_generator(tiny_wan, device="cpu", lora=str(tmp_path / "peft")).generate(**kw).frames
    ours = load_generator(tiny_wan, device="cpu", lora=str(tmp_path / "diffusers")).generate(**kw).frames
    base = load_generator(tiny_wan, device="cpu").generate(**kw).frames
    np.testing.assert_allclose(peft, ours, rtol=0, atol=1e-5)
    assert np.abs(peft - base).max() > 1e-2


def test_adapter_flags_are_checked_before_loading(spindle_cli, tiny_wan, tmp_path):
    r = spindle_cli("serve", "--model", str(tiny_wan), "--lora-dir", str(tmp_path / "absent"))
    assert r.returncode == 2 and "--lora-dir must be a directory" in r.stderr and "Traceback" not in r.stderr
    r = spindle_cli("serve", "--model", str(tiny_wan), "--lora-dir", str(tmp_path), "--max-loras", "0")
    assert r.returncode == 2 and "--max-loras must be >= 1; got 0" in r.stderr
    r = spindle_cli("serve", "--model", str(tiny_wan), "--lora-dir", str(tmp_path), "--lora", str(tmp_path / "x"))
    assert r.returncode == 2 and "--lora-dir cannot be combined with --lora" in r.stderr


# ---------------------------------------------------------------- Flux (image)


@pytest.fixture(scope="module")
def flux_loras(tiny_flux, tmp_path_factory):
    family = get_family("flux")
    folder = tmp_path_factory.mktemp("flux-loras")
    write_lora(family, random_lora(tiny_flux, seed=1, std=STD), folder / "ink")
    write_lora(family, random_lora(tiny_flux, seed=2, std=STD), folder / "neon")
    return folder


def test_interleaved_image_requests_with_different_adapters_equal_each_run_alone(tiny_flux, flux_loras):
    gen = load_generator(tiny_flux, device="cpu")
    gen.enable_adapters(flux_loras, max_loras=4)
    with LiveServer(build_app(gen, model_id="tiny-flux", root=str(tiny_flux), keep_frames=True)) as s:
        for name in ("ink", "neon"):
            assert s.client.post("/v1/loras", json={"lora_name": name}).status_code == 200
        jobs = []  # the jobs the server ran, for their exact float32 frames (PNGs are 8-bit)
        submit = s.state.submit
        s.state.submit = lambda job: jobs.append(submit(job)) or job
        asked = [("ink", 1.0), (None, None), ("neon", 0.7), ("ink", 1.0)]

        def post(choice):
            name, scale = choice
            extra = {"lora": name, "lora_scale": scale} if name else {}
            return s.client.post("/v1/images/generations", json={**IMAGE, **extra})

        with ThreadPoolExecutor(4) as pool:  # all four wait in the queue together
            answers = list(pool.map(post, asked))
        assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
        assert [r.json()["lora"] for r in answers] == [
            {"name": "ink", "scale": 1.0},
            None,
            {"name": "neon", "scale": 0.7},
            {"name": "ink", "scale": 1.0},
        ]
        by_choice = {(j.params.lora, j.params.lora_scale): j.frames for j in jobs}
    kw = engine_kwargs(IMAGE)
    alone = {
        ("ink", 1.0): load_generator(tiny_flux, device="cpu", lora=str(flux_loras / "ink")).generate(**kw).frames,
        (None, None): load_generator(tiny_flux, device="cpu").generate(**kw).frames,
        ("neon", 0.7): load_generator(tiny_flux, device="cpu", lora=str(flux_loras / "neon"), lora_scale=0.7)
        .generate(**kw)
        .frames,
    }
    assert len(jobs) == 4
    for job in jobs:
        key = (job.params.lora, job.params.lora_scale)
        np.testing.assert_allclose(job.frames, alone[key], rtol=0, atol=1e-5, err_msg=str(key))
    assert np.abs(alone[("ink", 1.0)] - alone[(None, None)]).max() > 1e-2
    assert np.abs(alone[("neon", 0.7)] - alone[(None, None)]).max() > 1e-2
    assert set(by_choice) == set(alone)


def test_an_adapter_trained_with_a_text_length_makes_it_its_requests_default(tiny_flux, tmp_path):
    """As with `lora=PATH` at load: the export's recorded text length is the default max_sequence_length
    of the requests that name the adapter (and of no other)."""
    from spindle.export.record import write_export_record

    write_lora(get_family("flux"), random_lora(tiny_flux, seed=5), tmp_path / "short")
    write_export_record(tmp_path / "short", family="flux", max_text_length=8)
    gen = load_generator(tiny_flux, device="cpu")
    adapters = gen.enable_adapters(tmp_path)
    assert adapters.load("short", adapters.resolve(None, "short")).max_text_length == 8
    assert gen.validate(SamplingParams(prompt="x", lora="short")).params.max_sequence_length == 8
    assert (
        gen.validate(SamplingParams(prompt="x", lora="short", max_sequence_length=16)).params.max_sequence_length == 16
    )
    assert gen.validate(SamplingParams(prompt="x")).params.max_sequence_length == gen.defaults.max_sequence_length != 8
    alone = load_generator(tiny_flux, device="cpu", lora=str(tmp_path / "short"))
    assert alone.defaults.max_sequence_length == 8


def test_a_request_whose_adapter_went_away_before_queueing_is_a_400(wan_server):
    """Validated, then its adapter unloaded before the job is queued: refused naming `lora`, never a 5xx."""
    from spindle.serve.errors import APIError
    from spindle.serve.jobs import Job

    s = wan_server
    before = s.state.store.stats().get("submitted", 0)
    with pytest.raises(APIError) as e:
        s.state.submit(
            Job(kind="video", request=ValidRequest("wan", SamplingParams(prompt="x", lora="gone")), model="tiny-wan")
        )
    assert e.value.status == 400 and e.value.param == "lora" and "'gone'" in e.value.message
    assert s.state.store.stats().get("submitted", 0) == before
