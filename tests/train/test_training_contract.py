"""The training contract, stated directly (so realistic bugs fail the suite, not only "the loss falls"):

- per-sample draws: two samples of one step draw different noise and sigmas; the same (seed, step,
  sample) draws the same; a sample's draws do not depend on its micro-batch or position in the batch
  (rank independence follows: a rank only changes which micro-batch a sample lands in). Every DiT
  family in the registry, through the flow-matching task's own forward.
- crash safety: a save that fails or is killed before its final rename leaves the previous checkpoint
  complete; `resume=auto` picks it, never the partial folder, which the next save removes.
- Wan's training inputs, derived from diffusers' WanPipeline and scheduler (not from Spindle's helpers).
"""

from __future__ import annotations

import errno
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from spindle.api import load_job_config
from spindle.distributed import checkpoint as ckpt
from spindle.registry import all_families
from spindle.testing.specs import dit_spec
from tests.conftest import stepped_linear, train_interrupted

DIT_FAMILIES = sorted(f.name for f in all_families() if f.task == "flow_matching")


class Recorder(nn.Module):
    """Stands in for the transformer: records the inputs the task feeds it."""

    def __init__(self, out_channels: int | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(()))
        self.out_channels = out_channels  # an input carrying conditioning channels (Wan I2V) predicts fewer
        self.calls: list[dict[str, torch.Tensor]] = []

    def forward(self, hidden_states=None, timestep=None, return_dict=False, x=None, t=None, **kwargs):
        if x is not None:  # a transformer taking per-sample lists (Z-Image: x, t, cap_feats)
            self.calls.append({"hidden_states": torch.stack(x).detach().clone(), "timestep": t.detach().clone()})
            return ([sample * self.weight for sample in x],)
        self.calls.append({"hidden_states": hidden_states.detach().clone(), "timestep": timestep.detach().clone()})
        sliced = self.out_channels is not None and hidden_states.ndim == 5  # [B, C, F, H, W] (not packed tokens)
        out = hidden_states[:, : self.out_channels] if sliced else hidden_states
        return (out * self.weight,)


@pytest.fixture(scope="module", params=DIT_FAMILIES)
def family_task(request, tmp_path_factory, tiny_checkpoint):
    from spindle.distributed.mesh import ParallelDims, build_mesh
    from spindle.registry import get_family
    from spindle.testing.multiprocess import dotted_overrides
    from spindle.train.tasks.flow_matching import FlowMatchingTask

    family = get_family(request.param)
    root = tiny_checkpoint(family.name)
    demo = family.demo
    cfg = load_job_config(
        None,
        [
            f"model.path={root}",
            f"model.max_text_length={family.demo.text_tokens}",
            "data.path=unused",
            f"data.resolution={list(demo.size)}",
            f"data.num_frames={demo.num_frames}",
            f"train.output_dir={tmp_path_factory.mktemp('run')}",
            *dotted_overrides({}, **dit_spec(family).train_overrides),  # what the family's training requires
        ],
    )
    task = FlowMatchingTask(cfg, family, build_mesh(ParallelDims()), torch.device("cpu"), "no")
    tcfg = json.loads((root / "transformer" / "config.json").read_text())
    task.recorder_channels = tcfg.get("out_channels") if tcfg.get("out_channels") != tcfg.get("in_channels") else None
    return task, demo


def draws(task, demo, indices: list[int], step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(noisy inputs, timesteps) the task feeds the transformer for identical samples at `indices`."""
    pixels = torch.linspace(-1, 1, 3 * demo.num_frames * demo.size[0] * demo.size[1])
    pixels = pixels.view(1, 3, demo.num_frames, *demo.size).expand(len(indices), -1, -1, -1, -1).contiguous()
    batch = {"pixels": pixels, "caption": ["a red circle"] * len(indices), "index": torch.tensor(indices)}
    if task.family.options.images[0] and demo.num_frames == 1:  # an editing family: the same source for each
        batch["images"] = pixels.flip(-1)[:, None, :, 0]
    model = Recorder(task.recorder_channels)
    task.forward(model, batch, step)
    # a per-token timestep holds the sample's sigma on its noised tokens (an image-to-video family's conditioning
    # frame sits at 0: LTX-2 I2V's, Wan2.2 TI2V's)
    return model.calls[0]["hidden_states"], model.calls[0]["timestep"].reshape(len(indices), -1).amax(dim=1)


def test_samples_of_one_step_draw_different_noise_and_sigmas(family_task):
    task, demo = family_task
    noisy, timesteps = draws(task, demo, [3, 5], step=1)
    # identical pixels and captions: only the per-sample draws can make the two inputs differ
    assert not torch.allclose(noisy[0], noisy[1])
    assert timesteps[0] != timesteps[1]


def test_draws_are_a_function_of_seed_step_and_sample(family_task):
    task, demo = family_task
    noisy, timesteps = draws(task, demo, [3, 5], step=1)
    again, again_t = draws(task, demo, [3, 5], step=1)
    assert torch.equal(noisy, again) and torch.equal(timesteps, again_t)
    later, later_t = draws(task, demo, [3, 5], step=2)
    assert not torch.allclose(noisy, later) and not torch.equal(timesteps, later_t)


def test_draws_do_not_depend_on_micro_batch_or_position(family_task):
    task, demo = family_task
    pair, pair_t = draws(task, demo, [3, 5], step=1)
    swapped, swapped_t = draws(task, demo, [5, 3], step=1)
    # a wrong draw differs by O(1); 1e-5 leaves room for a VAE's batched encoding of a conditioning frame (LTX-2
    # I2V: ~1.5e-6 between a batch of two and one)
    torch.testing.assert_close(swapped[0], pair[1], rtol=0, atol=1e-5)
    torch.testing.assert_close(swapped_t, pair_t.flip(0), rtol=0, atol=0)
    alone, alone_t = draws(task, demo, [5], step=1)
    torch.testing.assert_close(alone[0], pair[1], rtol=0, atol=1e-5)
    assert alone_t[0] == pair_t[1]


# ---------------------------------------------------------------- crash safety


def test_a_failing_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model, optimizer = stepped_linear()
    good = ckpt.save_checkpoint(tmp_path, 1, model, optimizer, {"note": "good"})

    def failing_writer(state, storage_writer):
        (Path(storage_writer.path) / "__0_0.distcp").write_bytes(b"half a shard")
        raise OSError(errno.EIO, "Input/output error")  # a full disk is tests/train/test_faults.py's

    monkeypatch.setattr(ckpt.dcp, "save", failing_writer)
    with pytest.raises(OSError, match="Input/output"):
        ckpt.save_checkpoint(tmp_path, 2, model, optimizer, {"note": "bad"})
    monkeypatch.undo()

    assert (ckpt.checkpoint_root(tmp_path) / "step-000002.tmp").is_dir()  # the partial write is there...
    assert ckpt.list_checkpoints(tmp_path) == [good]  # ...but is never listed
    assert ckpt.resolve_resume("auto", tmp_path) == good
    ckpt.load_checkpoint(good, model, optimizer)  # and the previous one is whole

    ckpt.save_checkpoint(tmp_path, 3, model, optimizer, {})
    assert not list(ckpt.checkpoint_root(tmp_path).glob("*.tmp")), "the next save removes partial folders"


@pytest.mark.parametrize("moment", ["between_shard_writes", "before_final_rename"])
def test_a_killed_save_is_never_resumed(tmp_path, moment):
    """A real process killed (os._exit: no cleanup, no finally) while saving step 2: either inside
    DCP's shard writing (its first file rename), or after every shard and trainer_state.json were
    written into step-2.tmp, right before the rename that completes the checkpoint."""
    script = textwrap.dedent(
        f"""
        import os, pathlib, torch
        from torch import nn
        from spindle.distributed import checkpoint as ckpt
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        opt = torch.optim.AdamW(model.parameters())
        ckpt.save_checkpoint({str(tmp_path)!r}, 1, model, opt, {{}})
        real_rename = pathlib.Path.rename
        def killed(self, target):
            if {moment!r} == "between_shard_writes" or str(target).endswith("step-000002"):
                os._exit(9)
            return real_rename(self, target)
        pathlib.Path.rename = killed
        ckpt.save_checkpoint({str(tmp_path)!r}, 2, model, opt, {{}})
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 9, proc.stderr
    partial = ckpt.checkpoint_root(tmp_path) / "step-000002.tmp"
    assert partial.is_dir()
    if moment == "before_final_rename":
        assert (partial / ckpt.TRAINER_STATE).is_file()  # complete-looking, but not renamed
    assert ckpt.resolve_resume("auto", tmp_path) == ckpt.checkpoint_root(tmp_path) / "step-000001"
    with pytest.raises(FileNotFoundError, match="partial"):
        ckpt.resolve_resume(str(partial), tmp_path)  # not even when named explicitly
    model, optimizer = stepped_linear()
    ckpt.save_checkpoint(tmp_path, 2, model, optimizer, {})
    assert not partial.exists()


# ---------------------------------------------------------------- the checkpoint's RNG state


def test_checkpoint_rng_state_makes_a_resumed_lora_dropout_run_exact(make_config, tmp_path, monkeypatch):
    """LoRA dropout draws its masks from the global generator: the RNG state saved in every
    checkpoint is what lets a resumed run reproduce the uninterrupted one. Resumed without it
    (torch.set_rng_state a no-op), the losses after the resume point differ."""
    from spindle.api import train
    from spindle.train.metrics import read_metrics

    common = dict(
        train__max_steps=4,
        train__global_batch_size=2,
        train__lora="{rank: 4, alpha: 8, dropout: 0.5}",
        checkpoint__every_steps=2,
        checkpoint__export=False,
    )
    train(make_config(tmp_path / "straight", **common))
    straight = [m["loss"] for m in read_metrics(tmp_path / "straight")]

    def resumed(name: str) -> list[float]:
        train_interrupted(make_config, tmp_path / name, monkeypatch, 3, **common)
        train(make_config(tmp_path / name, checkpoint__resume="auto", **common))
        return [m["loss"] for m in read_metrics(tmp_path / name)]

    assert resumed("with_rng") == straight
    monkeypatch.setattr(torch, "set_rng_state", lambda state: None)
    without = resumed("without_rng")
    assert without[:2] == straight[:2] and without[2:] != straight[2:]
