"""Multi-process inference (gloo on CPU, real processes via torchrun) equals the single process:
Ulysses sequence parallelism (--sp 2), ring attention (--ring 2), both on 4 processes (--sp 2 --ring 2)
and CFG parallelism (--cfg-parallel)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.slow

KW = dict(
    prompt="a windmill at sunset",
    negative_prompt="blurry",
    height=32,
    width=48,
    num_frames=5,
    num_inference_steps=2,
    guidance_scale=4.5,
    seed=21,
)

WORKER = """
import json, sys
import numpy as np
import torch.distributed as dist
from spindle import DiffusionGenerator
root, out, options, kw = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
gen = DiffusionGenerator.from_pretrained(root, **options)
frames = gen.generate(**kw).frames
np.save(f"{out}.rank{dist.get_rank()}.npy", frames)
# no seed given: rank 0 draws one and every rank uses it (same noise on all ranks)
drawn = gen.generate(**{**kw, "seed": None, "num_inference_steps": 1})
np.save(f"{out}.drawn{dist.get_rank()}.npy", drawn.frames)
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def single(tiny_wan):
    from spindle import DiffusionGenerator

    return DiffusionGenerator.from_pretrained(tiny_wan).generate(**KW).frames


def torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.parametrize(
    "options",
    [{"sp": 2}, {"ring": 2}, {"cfg_parallel": True}, {"sp": 2, "ring": 2}],
    ids=["sp2", "ring2", "cfg_parallel", "sp2_ring2"],
)
def test_multiprocess_equals_single_process(tiny_wan, single, tmp_path, options):
    """2 processes, and sp=2 x ring=2 (USP) on 4: every rank's frames equal one process."""
    import json

    nproc = options.get("sp", 1) * options.get("ring", 1) * (2 if options.get("cfg_parallel") else 1)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "frames"
    r = torchrun(nproc, str(script), str(tiny_wan), str(out), json.dumps(options), json.dumps(KW))
    assert r.returncode == 0, r.stderr[-4000:]
    for rank in range(nproc):
        frames = np.load(f"{out}.rank{rank}.npy")
        np.testing.assert_allclose(frames, single, atol=1e-5, rtol=0)
        np.testing.assert_array_equal(np.load(f"{out}.drawn0.npy"), np.load(f"{out}.drawn{rank}.npy"))


def test_cli_nproc_sp_writes_mp4(tiny_wan, tmp_path):
    import av

    out = tmp_path / "sp.mp4"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "spindle",
            "generate",
            "--model",
            str(tiny_wan),
            "--prompt",
            "a windmill",
            "--height",
            "32",
            "--width",
            "48",
            "--num-frames",
            "5",
            "--steps",
            "2",
            "--seed",
            "0",
            "--nproc",
            "2",
            "--sp",
            "2",
            "--quiet",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr[-4000:]
    with av.open(str(out)) as c:
        frames = list(c.decode(video=0))
    assert len(frames) == 5 and (frames[0].height, frames[0].width) == (32, 48)


def test_sp_mismatch_is_a_clear_error(tiny_wan):
    from spindle import DiffusionGenerator

    with pytest.raises(ValueError, match=r"needs 2 processes, but the world size is 1"):
        DiffusionGenerator.from_pretrained(tiny_wan, sp=2)
