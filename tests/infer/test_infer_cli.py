"""`spindle generate` writes an mp4 that PyAV reads back; bad requests are one clear error line."""

from __future__ import annotations

import pytest

from spindle.contracts.family import DiTFamily
from spindle.registry import all_families, get_family
from tests.conftest import run_spindle

DIT_FAMILIES = [f.name for f in all_families() if isinstance(f, DiTFamily)]


def test_generate_writes_mp4(tiny_wan, tmp_path):
    import av

    out = tmp_path / "out.mp4"
    r = run_spindle(
        "generate",
        "--model",
        tiny_wan,
        "--prompt",
        "a cat on a skateboard",
        "--negative-prompt",
        "blurry",
        "--height",
        32,
        "--width",
        48,
        "--num-frames",
        9,
        "--steps",
        3,
        "--guidance",
        4,
        "--seed",
        0,
        "--out",
        out,
        fresh=True,  # `python -m spindle` in a new interpreter, as a shell starts it (the others fork a warm one)
    )
    assert r.returncode == 0, r.stderr
    assert "denoising" in r.stderr and "3/3" in r.stderr  # progress bar over denoising steps
    last = r.stdout.strip().splitlines()[-1]
    assert "before_denoising" in last and "denoising" in last and "decoding" in last and "total" in last
    with av.open(str(out)) as c:
        frames = list(c.decode(video=0))
    assert len(frames) == 9
    assert (frames[0].height, frames[0].width) == (32, 48)


def test_generate_bad_request(tiny_wan, tmp_path, spindle_cli):
    r = spindle_cli(
        "generate",
        "--model",
        tiny_wan,
        "--prompt",
        "x",
        "--height",
        30,
        "--width",
        32,
        "--num-frames",
        5,
        "--steps",
        2,
        "--out",
        tmp_path / "o.mp4",
    )
    assert r.returncode == 2
    assert "height must be a positive multiple of 16" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("name", DIT_FAMILIES)
def test_out_takes_mp4_exactly_for_the_families_whose_pipeline_makes_videos(name):
    """`--out clip.mp4` is accepted for every family whose stock diffusers pipeline takes `num_frames` (it makes
    videos; LTX-2's was refused as "generates an image"), and an image file with `--num-frames 1`; an image family
    takes image files only."""
    import inspect

    import diffusers

    from spindle.commands.generate import output_suffixes

    family = get_family(name)
    pipeline = getattr(diffusers, family.checkpoint.pipeline)
    makes_videos = "num_frames" in inspect.signature(pipeline.__call__).parameters
    assert (".mp4" in output_suffixes(family.options, 9)) == makes_videos, name
    assert ".png" in output_suffixes(family.options, 1)
    assert (".png" in output_suffixes(family.options, 9)) == (not makes_videos), name
