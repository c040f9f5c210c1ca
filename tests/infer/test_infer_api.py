"""Python API of the engine: registry lookup, validation errors, defaults, progress/cancel, save."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from spindle.api import load_generator

SMALL = dict(prompt="a lighthouse", height=32, width=32, num_frames=5, num_inference_steps=2, guidance_scale=3.0)


@pytest.fixture(scope="module")
def gen(tiny_wan):

    return load_generator(tiny_wan)


def test_import_spindle_is_light():
    code = (
        "import sys, spindle; assert 'torch' not in sys.modules and 'diffusers' not in sys.modules; "
        "print(spindle.DiffusionGenerator.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "DiffusionGenerator"


def test_infer_all_lists_exactly_the_public_names_and_each_resolves():
    import spindle.contracts.request as request
    import spindle.infer as infer

    eager = {"Cancelled", "Req", "RequestError", "SamplingParams"}
    assert all(getattr(request, n) is getattr(infer, n) for n in eager)
    assert sorted(infer.__all__) == sorted(eager | set(infer._LAZY))
    namespace: dict = {}
    exec("from spindle.infer import *", namespace)
    assert all(namespace[n] is getattr(infer, n) for n in infer.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        infer.nope  # noqa: B018 - the attribute access is what is tested


def test_family(gen):
    """(The defaults, WanPipeline's call defaults: tests/conformance/test_conformance.py::test_defaults_are_the_diffusers_pipeline_defaults.)"""
    assert gen.family == "wan"


def test_renamed_folder_is_detected_and_unknown_class_is_refused(tiny_wan, tmp_path):
    from spindle.registry import UnknownModelError

    renamed = tmp_path / "renamed"
    shutil.copytree(tiny_wan, renamed)
    index = json.loads((renamed / "model_index.json").read_text())
    index["_class_name"] = "MyLocalVideoPipeline"
    (renamed / "model_index.json").write_text(json.dumps(index))
    # the pipeline class is unknown: the family is found from the transformer's class
    out = load_generator(renamed).generate(**SMALL, seed=0)
    assert out.frames.shape == (1, 5, 32, 32, 3)

    alien = tmp_path / "alien"
    alien.mkdir()
    (alien / "model_index.json").write_text(json.dumps({"_class_name": "MyLocalAudioPipeline"}))
    with pytest.raises(UnknownModelError, match=r"known families: .*wan \(WanPipeline"):
        load_generator(alien)


@pytest.mark.parametrize(
    "text,problem", [('{"_class_name": "WanPipeline",', "is not valid JSON"), ("[1, 2]", "holds a JSON list")]
)
def test_a_damaged_model_index_is_named_whether_detected_or_forced(text, problem, tmp_path):
    """model_index.json is read in one place (spindle.model_index) for detection and for a forced family alike."""
    (tmp_path / "model_index.json").write_text(text)
    for family in (None, "wan"):
        with pytest.raises(ValueError, match=rf"{tmp_path}/model_index.json {problem}"):
            load_generator(tmp_path, family=family)


def test_unserved_diffusers_pipeline_is_refused_before_loading(tiny_wan, shapes_videos, tmp_path, spindle_cli):
    """A diffusers pipeline class no family serves is refused by generate, serve and train, naming the class
    and the supported ones, even though its transformer class is one a family serves (WanVideoToVideoPipeline
    wraps WanTransformer3DModel). The weights are removed: a refusal that loaded anything would fail otherwise."""
    from spindle.registry import UnknownModelError
    from tests.conftest import train_overrides

    v2v = tmp_path / "v2v"
    shutil.copytree(tiny_wan, v2v)
    index = json.loads((v2v / "model_index.json").read_text())
    index["_class_name"] = "WanVideoToVideoPipeline"
    (v2v / "model_index.json").write_text(json.dumps(index))
    for weights in v2v.glob("*/*.safetensors"):
        weights.unlink()
    match = r"'WanVideoToVideoPipeline' is not served by Spindle; supported pipeline classes: .*WanPipeline"
    with pytest.raises(UnknownModelError, match=match):
        load_generator(v2v)
    cfg = tmp_path / "job.yaml"
    cfg.write_text("{}\n")
    train = ("train", cfg, *train_overrides(v2v, shapes_videos, tmp_path / "run"))
    for args in (
        ("generate", "--model", v2v, "--prompt", "a fox", "--out", tmp_path / "o.mp4"),
        ("serve", "--model", v2v),
        train,
    ):
        result = spindle_cli(*args)
        assert result.returncode == 2, (args, result)
        assert "'WanVideoToVideoPipeline' is not served by Spindle" in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr


def test_request_error_is_a_value_error():
    """Bad requests (the shared table for every family, and Wan's own rows: sizes, 4k+1 frames) are
    tests/conformance/test_conformance.py::test_bad_requests_are_clear_errors; callers catch ValueError."""
    from spindle.infer import RequestError

    assert issubclass(RequestError, ValueError)


def test_request_error_needs_its_field():
    from spindle.infer import RequestError

    with pytest.raises(TypeError, match="field"):
        RequestError("width x height = 64x64 is too many pixels")  # type: ignore[call-arg]  # leaving field out is the point
    assert RequestError("width x height = 64x64 is too many pixels", field="width").field == "width"


def test_a_family_option_error_names_the_option(gen):
    from spindle.infer import RequestError

    with pytest.raises(RequestError, match="not an option of wan") as e:
        gen.generate(**SMALL, true_cfg_scale=2.0)
    assert e.value.field == "true_cfg_scale"


def test_unknown_engine_option_names_the_closest(tiny_wan):
    """A typo in a keyword engine option fails before anything loads, naming the option it resembles."""
    from spindle.config import ConfigError

    with pytest.raises(ConfigError, match=r"unknown engine option 'cahce'; did you mean 'cache'\?"):
        load_generator(tiny_wan, cahce="fbc")
    with pytest.raises(ConfigError, match=r"unknown engine option 'vae_dtpye'; did you mean 'vae_dtype'\?"):
        load_generator(tiny_wan, vae_dtpye="bfloat16")
    with pytest.raises(ConfigError, match=r"dtype must be one of 'float32', .*; got 'float33'"):
        load_generator(tiny_wan, dtype="float33")


def test_progress_seed_and_cancel(gen):
    from spindle.infer import Cancelled

    seen = []
    a = gen.generate(**SMALL, progress=lambda i, n: seen.append((i, n)))
    assert seen == [(1, 2), (2, 2)]
    assert isinstance(a.seed, int)
    b = gen.generate(**SMALL, seed=a.seed)  # the reported seed reproduces the output
    np.testing.assert_array_equal(a.frames, b.frames)

    steps = []
    with pytest.raises(Cancelled):
        gen.generate(**SMALL, seed=0, progress=lambda i, n: steps.append(i), should_stop=lambda: len(steps) >= 1)
    assert steps == [1]


def test_a_cancel_during_a_step_stops_at_the_next_block(gen):
    """A client that hangs up mid-step: the request stops inside that step (between the transformer's blocks),
    not after it; the hooks go with the request, so the next one runs as before."""
    from spindle.infer import Cancelled

    asked, steps = [], []

    def should_stop() -> bool:  # asked before step 1 (no), then by each block: yes from the second block on
        asked.append(1)
        return len(asked) > 2

    with pytest.raises(Cancelled):
        gen.generate(**SMALL, seed=0, progress=lambda i, n: steps.append(i), should_stop=should_stop)
    assert steps == [] and len(asked) == 3  # step 1 never finished: stopped at its second block
    a = gen.generate(**SMALL, seed=0)
    np.testing.assert_array_equal(a.frames, gen.generate(**SMALL, seed=0).frames)


def test_save_mp4_png_and_batches(gen, tmp_path):
    import av
    from PIL import Image

    res = gen.generate(**{**SMALL, "num_frames": 9, "width": 48}, seed=0)
    (path,) = res.save(tmp_path / "v.mp4")
    with av.open(str(path)) as c:
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    assert len(frames) == 9 and frames[0].shape == (32, 48, 3)
    # lossy codec, but the content is the generated video
    assert np.abs(frames[0] / 255.0 - res.frames[0, 0]).mean() < 0.1

    one = gen.generate(**{**SMALL, "num_frames": 1}, seed=0)
    (png,) = one.save(tmp_path / "f.png")
    img = np.asarray(Image.open(png))
    assert img.shape == (32, 32, 3)
    assert np.abs(img / 255.0 - one.frames[0, 0]).max() <= 1 / 255 + 1e-6

    two = gen.generate(**SMALL, num_outputs_per_prompt=2, seed=0)
    paths = two.save(tmp_path / "b.mp4")
    assert [p.name for p in paths] == ["b_0.mp4", "b_1.mp4"] and all(p.is_file() for p in paths)
