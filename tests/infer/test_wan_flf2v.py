"""First-last-frame video (Wan FLF2V: stock WanImageToVideoPipeline's `last_image`): `generate(image=...,
last_image=...)` and `spindle generate --last-image` equal the stock pipeline, on a Wan2.1 FLF2V layout (CLIP
embeddings of both frames, folded per sample by the transformer's `pos_embed_seq_len`) and on Wan2.2 A14B I2V
(no image embeddings); a transformer that embeds one image refuses a last frame before any work."""

from __future__ import annotations

import numpy as np
import pytest

from spindle.api import load_generator
from spindle.contracts.request import RequestError
from spindle.testing import conformance as suite
from tests.infer.test_wan_i2v import CASES, first_frame


@pytest.fixture(scope="module")
def tiny_flf2v(tiny_wan_flf2v):
    return tiny_wan_flf2v


def frames(case: str) -> dict:
    return dict(CASES[case], image=first_frame(seed=1), last_image=first_frame(32, 32, seed=2))


@pytest.mark.parametrize("cfg_batch", [True, False], ids=["cfg_batch", "two_forwards"])
@pytest.mark.parametrize("case", ["cfg", "nocfg"])
def test_flf2v_equals_the_stock_pipeline(tiny_flf2v, case, cfg_batch):
    from spindle.registry import get_family

    suite.check_inference_parity(get_family("wan_i2v"), tiny_flf2v, frames(case), cfg_batch=cfg_batch)


def test_two_expert_i2v_takes_a_last_frame_as_stock(tiny_checkpoint):
    from spindle.registry import get_family

    family = get_family("wan22_i2v")
    suite.check_inference_parity(family, tiny_checkpoint("wan22_i2v"), {**frames("cfg"), "guidance_scale_2": 2.0})


def test_the_last_frame_conditions_the_video_and_is_required(tiny_flf2v):
    gen = load_generator(tiny_flf2v)
    kwargs = frames("nocfg")
    with_last = gen.generate(**kwargs).frames
    other_last = gen.generate(**{**kwargs, "last_image": first_frame(seed=5)}).frames
    assert np.abs(with_last - other_last).max() > 1e-3
    # the transformer folds two images' embeddings per sample (stock fails mid-run with one): refused first
    with pytest.raises(RequestError, match=r"last_image is required for this first-last-frame") as info:
        gen.generate(**{k: v for k, v in kwargs.items() if k != "last_image"})
    assert info.value.field == "last_image"


def test_a_one_image_transformer_refuses_a_last_frame(tiny_wan_i2v):
    gen = load_generator(tiny_wan_i2v)
    with pytest.raises(RequestError, match=r"last_image needs a first-last-frame \(FLF2V\) checkpoint") as info:
        gen.generate(**frames("nocfg"))
    assert info.value.field == "last_image"
    with pytest.raises(RequestError, match="last_image goes with exactly one image"):
        gen.generate(**{**frames("nocfg"), "image": None})


def test_generate_cli_last_image(tiny_flf2v, tmp_path, spindle_cli, monkeypatch):
    from spindle.infer.generator import DiffusionGenerator

    seen = []
    run = DiffusionGenerator.run
    monkeypatch.setattr(
        DiffusionGenerator, "run", lambda self, params, **kw: seen.append(params) or run(self, params, **kw)
    )
    first, last = tmp_path / "first.png", tmp_path / "last.png"
    kwargs = frames("nocfg")
    kwargs["image"].save(first)
    kwargs["last_image"].save(last)
    out = tmp_path / "v.mp4"
    args = ["--height", "32", "--width", "32", "--num-frames", "9", "--steps", "2", "--guidance", "1", "--seed", "3"]
    r = spindle_cli("generate", "--model", tiny_flf2v, "--prompt", "a red fox", *args, "--image", first,
                    "--last-image", last, "--out", out, "--quiet")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert out.is_file()
    # the request carried both frames, in order (generate(image=first, last_image=last)), read by the schema
    images = seen[-1].params.image
    assert [np.asarray(image).tolist() for image in images] == [
        np.asarray(kwargs[k]).tolist() for k in ("image", "last_image")
    ]
    r = spindle_cli("generate", "--model", tiny_flf2v, "--prompt", "a red fox", "--last-image", last, "--out", out)
    assert r.returncode == 2 and "--last-image goes with exactly one --image" in r.stderr
