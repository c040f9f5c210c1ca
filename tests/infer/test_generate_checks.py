"""`spindle generate` refuses what it cannot write or run before loading the model (an `--out` extension
the family does not write, an `--image` count the family's rule refuses, as the server does, an image file that is
not there or no image), and prints the size it generates, defaults included, before it starts."""

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
        ("wan_i2v", ["--out", "clip.mp4", "--image", "NOTES"], "--image file 'notes.png' cannot be read as an image"),
        ("wan_i2v", ["--out", "clip.mp4", *["--image", "a.png"] * 3],
         "--image: wan_i2v takes 1 to 2 conditioning image(s); got 3"),
        ("wan", ["--out", "clip.mp4", "--image", "a.png"],
         "--image is not taken by wan (it generates from text alone); drop it"),
    ],
)  # fmt: skip
def test_refused_before_loading(family, extra, message, tiny_checkpoint, spindle_cli, no_load, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.png").write_text("a text file named .png")  # (NOTES: a file that is no image)
    extra = ["notes.png" if a == "NOTES" else a for a in extra]
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


@pytest.mark.parametrize(
    ("family", "route", "images", "server_param"),
    [
        ("wan_i2v", "/v1/videos", 0, "input_reference"),  # one required, none given
        ("qwenimage_edit", "/v1/images/edits", 2, "image"),  # one taken, two given
    ],
)
def test_cli_and_server_refuse_the_same_image_count(
    family, route, images, server_param, tiny_checkpoint, spindle_cli, tmp_path, monkeypatch
):
    """The one count rule (the family's `FamilyOptions.images`, `contracts/images`): `spindle generate` refuses
    before loading, the server with a 400 naming its field, at the same bound and count."""

    import spindle.api
    from spindle.api import load_generator
    from spindle.serve import build_app
    from tests.serve.test_serve import LiveServer, assert_error
    from tests.serve.test_serve_i2v import form, png_bytes

    root = tiny_checkpoint(family)
    gen = load_generator(root, device="cpu")
    kw = {"prompt": "a kite", "size": "32x32", "num_inference_steps": 2}
    with LiveServer(build_app(gen, model_id="tiny", root=str(root))) as s:
        if images:
            parts = [(server_param, (f"in{i}.png", png_bytes(i), "image/png")) for i in range(images)]
            r = s.client.post(route, files=[*form(kw).items(), *parts])
        else:
            r = s.client.post(route, json=kw)
        served = assert_error(r, 400, server_param)["message"]
        assert s.state.store.counters["submitted"] == 0

    paths = []
    for i in range(images):
        (tmp_path / f"in{i}.png").write_bytes(png_bytes(i))
        paths += ["--image", str(tmp_path / f"in{i}.png")]

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(spindle.api, "load_generator", load)
    out = tmp_path / ("clip.mp4" if family == "wan_i2v" else "edit.png")
    r = spindle_cli("generate", "--model", root, "--prompt", "a kite", *paths, "--out", out)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    low, high = gen.spec.options.images
    if images < low:  # both from the engine's count rule, each naming its own field
        assert served == f"{server_param} is required for {family}: give {low} conditioning image(s)"
        assert f"error: --image is required for {family}: give {low} conditioning image(s) (--image PATH)" in r.stderr
    else:  # the same rule (the server counts uploads before decoding them), each naming its own field
        assert served == f"{server_param}: {family} takes {high} conditioning image(s); got {images}", served
        assert f"error: --image: {family} takes {high} conditioning image(s); got {images}" in r.stderr
