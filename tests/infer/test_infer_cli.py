"""`spindle generate` writes an mp4 that PyAV reads back; bad requests are one clear error line."""

from __future__ import annotations

from tests.conftest import run_spindle


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
