"""Run-time adapters confined to `--lora-dir` and their files checked, as an operator probes a live
server (real uvicorn on loopback, real files in the adapter folder): a weights file or export record
that links out of the folder is refused and not loaded; a text file or a damaged header is a 400
`invalid_lora` that shows none of the file's bytes; a refused load evicts nothing; a NUL in a path is a
400; unloading an adapter a running job uses answers 409 at once."""

from __future__ import annotations

import json
import shutil
import struct
import time

import pytest

from tests.serve.test_serve import assert_error
from tests.serve.test_serve_adapters import VIDEO, lora_params, unload_all, wan_loras, wan_server  # noqa: F401


def loaded(server) -> list[str]:
    return sorted(card["name"] for card in server.client.get("/v1/loras").json()["data"])


@pytest.fixture
def adapter_dir(wan_loras):  # noqa: F811
    """A folder made inside the adapter folder for one test (removed after)."""
    made = []

    def make(name: str):
        folder = wan_loras / name
        folder.mkdir()
        made.append(folder)
        return folder

    yield make
    for folder in made:
        shutil.rmtree(folder)


def test_a_weights_file_linking_out_of_the_folder_is_refused_and_not_loaded(wan_server, wan_loras, adapter_dir):  # noqa: F811
    c, outside = wan_server.client, wan_loras.parent / "outside.safetensors"
    unload_all(wan_server)
    linked = adapter_dir("linked")
    (linked / "pytorch_lora_weights.safetensors").symlink_to(outside)
    err = assert_error(c.post("/v1/loras", json={"lora_name": "x", "lora_path": "linked"}), 403, "lora_path")
    assert "pytorch_lora_weights.safetensors leads out" in err["message"] and "--lora-dir" in err["message"], err
    assert loaded(wan_server) == [] and not lora_params(wan_server, "x")
    # its export record linking out too (a file that loading reads)
    record = adapter_dir("record")
    shutil.copy(outside, record / "pytorch_lora_weights.safetensors")
    (record / "spindle.json").symlink_to(wan_loras.parent / "outside.json")
    (wan_loras.parent / "outside.json").write_text(json.dumps({"max_text_length": 8}))
    err = assert_error(c.post("/v1/loras", json={"lora_name": "x", "lora_path": "record"}), 403, "lora_path")
    assert "spindle.json leads out" in err["message"], err
    # the control: the same weights copied into the folder load
    (record / "spindle.json").unlink()
    assert c.post("/v1/loras", json={"lora_name": "x", "lora_path": "record"}).status_code == 200
    assert loaded(wan_server) == ["x"]


def safetensors_bytes(header: dict, data: bytes = b"\0" * 16) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.mark.parametrize(
    "content",
    [
        b"hello world, the operator's secret text\n",  # its first 8 bytes once came back as a "header length"
        safetensors_bytes({"w": {"dtype": "F32", "shape": [4]}}),  # no data_offsets (once a 500)
        safetensors_bytes({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, "x"]}}),
        safetensors_bytes({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 4096]}}),  # truncated
        safetensors_bytes({"w": {"dtype": "NOPE", "shape": [4], "data_offsets": [0, 16]}}),  # safetensors refuses
        b"",
    ],
    ids=["text", "no_offsets", "text_offsets", "truncated", "bad_dtype", "empty"],
)
def test_a_damaged_file_is_a_400_showing_none_of_it_and_evicts_nothing(wan_server, wan_loras, content):  # noqa: F811
    s, c = wan_server, wan_server.client
    unload_all(s)
    for name in ("a", "b"):  # the cache is full (--max-loras 2): loading one more would evict one
        assert c.post("/v1/loras", json={"lora_name": name}).status_code == 200
    tensors = lora_params(s, "a") + lora_params(s, "b")
    bad = wan_loras / "damaged.safetensors"
    bad.write_bytes(content)
    try:
        r = c.post("/v1/loras", json={"lora_name": "d", "lora_path": "damaged.safetensors"})
    finally:
        bad.unlink()
    err = assert_error(r, 400, "lora_path", "invalid_lora")
    assert "damaged.safetensors is not a readable safetensors file" in err["message"], err
    first8 = struct.unpack("<Q", (content + b"\0" * 8)[:8])[0]
    assert str(first8) not in err["message"] and "secret" not in err["message"], err
    assert loaded(s) == ["a", "b"] and all(ref() is not None for ref in tensors)


def test_a_nul_or_an_overlong_path_is_a_400(wan_server):  # noqa: F811
    c = wan_server.client
    err = assert_error(c.post("/v1/loras", json={"lora_name": "x", "lora_path": "a\0b"}), 400, "lora_path")
    assert err["code"] == "invalid_lora_path" and "NUL" in err["message"]
    assert_error(c.post("/v1/loras", json={"lora_name": "x", "lora_path": "n" * 5000}), 400, "lora_path")


def test_unloading_an_adapter_a_running_job_uses_is_409_at_once(wan_server):  # noqa: F811
    s, c = wan_server, wan_server.client
    unload_all(s)
    assert c.post("/v1/loras", json={"lora_name": "a"}).status_code == 200
    job = c.post("/v1/videos", json={**VIDEO, "lora": "a", "num_inference_steps": 200}).json()
    deadline = time.monotonic() + 60
    while c.get(f"/v1/videos/{job['id']}").json()["status"] == "queued":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        err = assert_error(c.delete("/v1/loras/a"), 409, code="lora_in_use")
        assert "1 waiting or running" in err["message"]
        # answered while the job still runs (it did not wait for the job to end)
        assert c.get(f"/v1/videos/{job['id']}").json()["status"] == "in_progress"
        assert_error(c.delete("/v1/loras/nope"), 404, code="lora_not_found")
    finally:
        c.delete(f"/v1/videos/{job['id']}")  # cancel it
    assert s.wait(job["id"])["status"] in ("cancelled", "completed")
    assert c.delete("/v1/loras/a").status_code == 200


def test_an_adapter_for_another_model_evicts_nothing(wan_server, wan_loras):  # noqa: F811
    """Readable, but no fit for this checkpoint (found only while loading): the full cache keeps both."""
    import torch
    from safetensors.torch import save_file

    s, c = wan_server, wan_server.client
    unload_all(s)
    for name in ("a", "b"):
        assert c.post("/v1/loras", json={"lora_name": name}).status_code == 200
    other = wan_loras / "other_model.safetensors"
    key = "transformer.single_transformer_blocks.0.proj_mlp"
    save_file({f"{key}.lora_A.weight": torch.zeros(4, 32), f"{key}.lora_B.weight": torch.zeros(64, 4)}, str(other))
    try:
        r = c.post("/v1/loras", json={"lora_name": "o", "lora_path": "other_model.safetensors"})
    finally:
        other.unlink()
    assert_error(r, 400, "lora_path", "invalid_lora")
    assert loaded(s) == ["a", "b"] and lora_params(s, "a") and lora_params(s, "b")
    # and a load that fits still evicts the least recently used one, after loading
    r = c.post("/v1/loras", json={"lora_name": "c"})
    assert r.status_code == 200 and r.json()["evicted"] == ["a"], r.text
