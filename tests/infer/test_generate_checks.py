"""`spindle generate` refuses what it cannot write or run before loading the model (an `--out` extension
the family does not write, a missing `--image` an image-conditioned family requires, an image file that is
not there), and prints the size it generates, defaults included, before it starts."""

from __future__ import annotations

import pytest


@pytest.fixture
def no_load(monkeypatch):
    """Loading the model fails the test: these refusals must come first."""
    import spindle.api

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(spindle.api, "load_generator", load)


@pytest.mark.parametrize(
    ("family", "extra", "message"),
    [
        ("wan", ["--out", "clip.gif"], "--out clip.gif: wan generates a video (or with --num-frames 1, an image); "
         "give a file ending in .mp4"),
        ("wan", ["--out", "frame.png"], "give a file ending in .mp4"),
        ("flux", ["--out", "x.mp4"], "--out x.mp4: flux generates an image; give a file ending in .jpeg / .jpg / .png"),
        ("wan_i2v", ["--out", "clip.mp4"], "--image is required for wan_i2v: give 1 conditioning image(s) "
         "(--image PATH)"),
        ("wan_i2v", ["--out", "clip.mp4", "--image", "absent.png"], "--image file 'absent.png' does not exist"),
    ],
)  # fmt: skip
def test_refused_before_loading(family, extra, message, tiny_checkpoint, spindle_cli, no_load, tmp_path):
    r = spindle_cli("generate", "--model", tiny_checkpoint(family), "--prompt", "x", *extra)
    assert r.returncode == 2, r
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_single_frame_video_may_be_written_as_an_image_and_the_size_is_printed(tiny_wan, spindle_cli, tmp_path):
    out = tmp_path / "frame.png"
    r = spindle_cli(
        "generate", "--model", tiny_wan, "--prompt", "a red ball", "--height", "32", "--num-frames", "1",
        "--steps", "2", "--seed", "1", "--out", out, "--quiet",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    # the width left to the family's default (832) is printed with the asked height
    assert "generating 832x32, 1 frames, 2 steps" in r.stderr, r.stderr
    assert out.is_file()
