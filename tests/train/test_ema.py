"""`train.ema`: the EMA of the trained weights follows its rule, resumes exactly, exports where the user
chose in a layout stock diffusers loads, and feeds validation samples; its config errors name the key."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from spindle.api import make_trainer
from spindle.config import ConfigError
from spindle.distributed import checkpoint as ckpt
from tests.conftest import train_interrupted

EMA = {"train__ema__decay": 0.8, "train__ema__start_step": 1, "train__ema__every": 2}
TRANSFORMER_FILE = "diffusion_pytorch_model.safetensors"


def trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable weights by state-dict name (one process: plain tensors), copied."""
    return {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}


def reference_ema(snapshots: list[dict[str, torch.Tensor]], decay: float, start: int, every: int):
    """The EMA as a plain loop: snapshots[0] are the weights before step 1, snapshots[s] after step s."""
    ema = {k: v.double() for k, v in snapshots[0].items()}
    for step, weights in enumerate(snapshots[1:], start=1):
        if step <= start:
            ema = {k: v.double() for k, v in weights.items()}
        elif (step - start) % every == 0:
            ema = {k: decay * ema[k] + (1 - decay) * weights[k].double() for k in ema}
    return ema


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_ema_follows_the_reference_loop(make_config, lora):
    lora_keys = {"train__lora__rank": 4} if lora else {}
    trainer = make_trainer(make_config(train__max_steps=6, checkpoint__export=False, **EMA, **lora_keys))
    snapshots = [trainable(trainer.model)]
    step = trainer.train_step

    def recorded():
        out = step()
        snapshots.append(trainable(trainer.model))
        return out

    trainer.train_step = recorded
    trainer.run()

    ema = trainer.ema.state_dict()
    assert ema.keys() == snapshots[0].keys()  # the trainable weights only (a LoRA run: its adapters)
    assert all(name.count("lora") for name in ema) == lora
    assert all(v.dtype == torch.float32 for v in ema.values())
    expected = reference_ema(snapshots, decay=0.8, start=1, every=2)
    for name, value in ema.items():
        torch.testing.assert_close(value.double(), expected[name], rtol=1e-6, atol=1e-7, msg=name)
    final = snapshots[-1]
    assert any(not torch.equal(ema[k], final[k]) for k in ema), "the EMA is a copy of the weights"

    # swapping the EMA in and out leaves the trained weights bit for bit
    with trainer.ema.swapped_in(trainer.model):
        assert all(torch.equal(v, ema[k]) for k, v in trainable(trainer.model).items())
    assert all(torch.equal(v, final[k]) for k, v in trainable(trainer.model).items())


def read_ema(checkpoint, tiny_wan) -> dict[str, torch.Tensor]:
    from spindle.export.diffusers import load_transformer

    with ckpt.reading_weights("ema"):
        return ckpt.read_checkpoint_model(checkpoint, load_transformer(tiny_wan))


def test_resume_with_ema_is_exact(make_config, tiny_wan, tmp_path, monkeypatch):
    common = dict(train__max_steps=7, checkpoint__every_steps=3, export__weights="both", **EMA)
    straight = make_trainer(make_config(tmp_path / "straight", **common)).run()
    train_interrupted(make_config, tmp_path / "resumed", monkeypatch, 5, **common)
    resumed = make_trainer(make_config(tmp_path / "resumed", checkpoint__resume="auto", **common)).run()

    a = read_ema(ckpt.list_checkpoints(straight.output_dir)[-1], tiny_wan)
    b = read_ema(ckpt.list_checkpoints(resumed.output_dir)[-1], tiny_wan)
    assert all(torch.equal(a[k], b[k]) for k in a)  # bit for bit
    for folder in ("transformer", "transformer_ema"):
        ea = load_file(straight.export_dir / folder / TRANSFORMER_FILE)
        eb = load_file(resumed.export_dir / folder / TRANSFORMER_FILE)
        assert ea.keys() == eb.keys() and all(torch.equal(ea[k], eb[k]) for k in ea), folder
    trained = load_file(straight.export_dir / "transformer" / TRANSFORMER_FILE)
    assert any(not torch.equal(trained[k], a[k]) for k in trained)


def test_ema_export_loads_in_stock_diffusers(make_config, tmp_path, spindle_cli):
    from diffusers import WanPipeline, WanTransformer3DModel

    trainer = make_trainer(make_config(train__max_steps=3, export__weights="both", **EMA))
    result = trainer.run()
    ema, trained = trainer.ema.state_dict(), trainable(trainer.model)
    summary = json.loads((result.output_dir / "summary.json").read_text())
    assert summary["start"]["extra"]["ema"] == "decay 0.8 every 2 steps after step 1 (fp32); export: both weights"

    transformer_ema = WanTransformer3DModel.from_pretrained(result.export_dir, subfolder="transformer_ema")
    assert all(torch.equal(transformer_ema.state_dict()[k], v) for k, v in ema.items())
    pipe = WanPipeline.from_pretrained(result.export_dir, transformer=transformer_ema)
    assert all(torch.equal(pipe.transformer.state_dict()[k], v) for k, v in ema.items())
    plain = WanPipeline.from_pretrained(result.export_dir)  # the trained weights stay the pipeline's own
    assert all(torch.equal(plain.transformer.state_dict()[k], v) for k, v in trained.items())

    # `spindle export` of the checkpoint: the run's choice by default, --weights to pick
    out = tmp_path / "cli"
    assert spindle_cli("export", result.output_dir, "--out", out).returncode == 0
    assert load_file(out / "transformer_ema" / TRANSFORMER_FILE).keys() == ema.keys()
    # replacing that export takes --force (`spindle.export.target`)
    assert spindle_cli("export", result.output_dir, "--out", out, "--weights", "ema", "--force").returncode == 0
    written = load_file(out / "transformer" / TRANSFORMER_FILE)
    assert all(torch.equal(written[k], v) for k, v in ema.items())
    assert not (out / "transformer_ema").exists()


def test_lora_ema_exports_beside_the_adapters(make_config, spindle_cli, tmp_path):
    from diffusers import WanPipeline, WanTransformer3DModel

    from spindle.export.record import LORA_WEIGHTS
    from spindle.train.lora import adapter_state_dict, lora_scale

    overrides = dict(train__max_steps=3, train__lora__rank=4, export__weights="both", export__merge_lora=True, **EMA)
    trainer = make_trainer(make_config(**overrides))
    result = trainer.run()
    expected = adapter_state_dict(trainer.ema.state_dict(), lora_scale(trainer.model))
    loaded = WanPipeline.lora_state_dict(result.export_dir / "lora_ema")  # stock diffusers' reader
    loaded = loaded[0] if isinstance(loaded, tuple) else loaded
    written = {k.removeprefix("transformer."): v for k, v in loaded.items()}
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[k], v) for k, v in expected.items())
    trained = load_file(result.export_dir / "lora" / LORA_WEIGHTS)
    assert trained.keys() == {f"transformer.{k}" for k in expected}
    assert any(not torch.equal(trained[f"transformer.{k}"], v) for k, v in expected.items())
    card = (result.export_dir / "lora_ema" / "README.md").read_text()  # its lines load it where it lies
    assert f'load_lora_weights("{(result.export_dir / "lora_ema").resolve()}")' in card and ".tmp" not in card
    # merge_lora: the pipeline with the trained LoRA fused, and the EMA's fused transformer beside it
    merged = result.export_dir / "merged"
    fused = WanTransformer3DModel.from_pretrained(merged, subfolder="transformer").state_dict()
    fused_ema = WanTransformer3DModel.from_pretrained(merged, subfolder="transformer_ema").state_dict()
    assert fused.keys() == fused_ema.keys() and any(not torch.equal(fused[k], fused_ema[k]) for k in fused)
    # `spindle export` of the LoRA checkpoint writes the same files
    out = tmp_path / "cli"
    assert spindle_cli("export", result.output_dir, "--out", out).returncode == 0
    for folder in ("lora", "lora_ema"):
        a, b = load_file(out / folder / LORA_WEIGHTS), load_file(result.export_dir / folder / LORA_WEIGHTS)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), folder


@pytest.mark.parametrize(
    ("validation", "with_ema"),
    [({"train__validation__use_ema": True}, True), ({}, True), ({"export__weights": "trained"}, False)],
    ids=["use_ema", "default-follows-the-export", "trained-export"],
)
def test_validation_renders_with_the_ema(make_config, monkeypatch, validation, with_ema):
    """Validation samples come from the weights the export holds by default (issue 43): the EMA when it is
    exported, the trained weights when export.weights: trained; use_ema says so explicitly."""
    from spindle.train.tasks.flow_matching import FlowMatchingTask

    seen = []

    def validate(self, model, step, out_dir):
        seen.append((step, trainable(model)))
        return []

    monkeypatch.setattr(FlowMatchingTask, "validate", validate)
    overrides = {
        "train__validation__every_steps": 2,
        "train__validation__prompts": ["a"],
        **validation,
        **EMA,
    }
    trainer = make_trainer(make_config(train__max_steps=4, checkpoint__export=False, **overrides))
    ema_at = {}
    update = trainer.ema.update

    def recorded(step):
        update(step)
        ema_at[step] = {k: v.clone() for k, v in trainer.ema.state_dict().items()}

    trainer.ema.update = recorded
    trainer.run()
    assert [s for s, _ in seen] == [2, 4]
    for step, weights in seen:
        same = all(torch.equal(weights[k], v) for k, v in ema_at[step].items())
        assert same == with_ema, step
    assert any(not torch.equal(trainer.ema.state_dict()[k], v) for k, v in trainable(trainer.model).items())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"train__ema__decay": 1.5}, "'train.ema.decay': Input should be less than 1 (got 1.5)"),
        ({"train__ema__decay": 0}, "'train.ema.decay': Input should be greater than 0 (got 0)"),
        ({"train__ema": "often"}, "train.ema must be true, false or a mapping"),
        ({"train__ema": 0.99}, "got 0.99; for a decay of 0.99, set train.ema.decay=0.99"),
        ({"train__ema__deacy": 0.9}, "did you mean 'train.ema.decay'"),
        ({"train__ema__every": 0}, "'train.ema.every'"),
        ({"export__weights": "ema"}, "export.weights=ema needs an EMA of the weights; set train.ema: true"),
        ({"export__weights": "both", "train__ema": False}, "export.weights=both needs an EMA"),
        ({"train__validation__use_ema": True}, "train.validation.use_ema: true needs an EMA"),
        ({"export__weights": "last"}, "'export.weights'"),
    ],
)
def test_ema_config_errors_name_the_key(make_config, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_config(**overrides)


def test_ema_true_takes_the_defaults_and_defines_the_run(make_config, tmp_path):
    from spindle.train.run_record import changed_keys, run_identity

    cfg = make_config(train__ema=True)
    assert cfg.train.ema.model_dump() == {"decay": 0.999, "start_step": 0, "every": 1}
    assert cfg.export_weights == "ema"  # the EMA is what an EMA run exports unless told
    assert make_config().export_weights == "trained"
    assert make_config(train__ema=False).train.ema is None
    # a run without EMA keeps the identity it had before EMA existed; turning it on changes the run
    assert "train.ema.decay" not in run_identity(make_config())
    changes = changed_keys(run_identity(make_config()), run_identity(cfg))
    assert [key for key, _, _ in changes] == ["train.ema.decay", "train.ema.every", "train.ema.start_step"]


def test_export_cli_refuses_ema_of_a_run_without_one(make_config, spindle_cli, tmp_path):
    result = make_trainer(make_config(train__max_steps=1, checkpoint__export=False)).run()
    state = json.loads((ckpt.list_checkpoints(result.output_dir)[-1] / ckpt.TRAINER_STATE).read_text())
    assert state["ema"] is None and state["export_weights"] == "trained"
    proc = spindle_cli("export", result.output_dir, "--out", tmp_path / "o", "--weights", "ema")
    assert proc.returncode == 2
    assert "holds no EMA (its run had no train.ema); use --weights trained" in proc.stderr


def test_causal_lm_ema_exports_beside_in_a_transformers_folder(tiny_qwen3, lm_corpus, tmp_path, spindle_cli):
    """The EMA is the trainer's, not a task's: a causal-LM run keeps one too, and `both` writes it as
    `export/ema/`, a transformers folder stock transformers loads with `subfolder="ema"`."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import lm_train

    trainer, result = lm_train(tiny_qwen3, lm_corpus, tmp_path / "run", export__weights="both", **EMA)
    ema, trained = trainer.ema.state_dict(), trainable(trainer.model)
    model = AutoModelForCausalLM.from_pretrained(result.export_dir, subfolder="ema", dtype=torch.float32)
    loaded = dict(model.named_parameters())
    assert all(torch.equal(loaded[k], v) for k, v in ema.items() if k in loaded)
    assert {k for k in ema if k in loaded} == set(loaded)  # (a tied head is one parameter)
    plain = dict(AutoModelForCausalLM.from_pretrained(result.export_dir, dtype=torch.float32).named_parameters())
    assert all(torch.equal(plain[k], trained[k]) for k in plain)
    assert any(not torch.equal(plain[k], ema[k]) for k in plain)
    # `spindle export --weights ema` of the checkpoint: the average in the transformers folder itself
    out = tmp_path / "cli"
    assert spindle_cli("export", result.output_dir, "--out", out, "--weights", "ema").returncode == 0
    again = dict(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).named_parameters())
    assert all(torch.equal(again[k], loaded[k]) for k in loaded) and not (out / "ema").exists()


def test_the_tiny_configs_ema_example_is_a_valid_config():
    """The commented `train.ema` / `export.weights` lines of the tiny configs, uncommented, validate."""
    from pathlib import Path

    import yaml

    from spindle.api import job_task
    from spindle.config import validate_config
    from spindle.registry import get_family

    configs = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*_tiny.yaml"))
    examples = [p for p in configs if "# ema:" in p.read_text()]
    assert {p.stem.removesuffix("_tiny") for p in examples} >= {"wan", "flux", "qwenimage", "qwen3"}
    for path in examples:
        text = path.read_text().replace("  # ema:", "  ema:").replace("# export:\n#   weights:", "export:\n  weights:")
        raw = yaml.safe_load(text)
        cfg = validate_config(raw, job_task(get_family(path.stem.removesuffix("_tiny"))).config_class)
        assert cfg.train.ema is not None and cfg.export_weights == "both", path.name


def test_forced_resume_of_a_run_without_ema_starts_it_from_the_checkpoint(make_config, tiny_wan, tmp_path, caplog):
    from spindle.export.diffusers import load_transformer

    out = tmp_path / "run"
    make_trainer(make_config(out, train__max_steps=2, checkpoint__export=False)).run()
    with pytest.raises(ConfigError, match=re.escape("train.ema.decay: '(unset)' -> 0.5")):
        make_trainer(make_config(out, train__max_steps=3, checkpoint__resume="auto", train__ema__decay=0.5))
    trainer = make_trainer(
        make_config(
            out, train__max_steps=3, checkpoint__resume="force", checkpoint__export=False, train__ema__decay=0.5
        )
    )
    trainer.run()
    assert "holds no EMA: train.ema starts from its weights" in caplog.text
    start = ckpt.read_checkpoint_model(ckpt.list_checkpoints(out)[0], load_transformer(tiny_wan))
    final = trainable(trainer.model)
    for name, value in trainer.ema.state_dict().items():
        torch.testing.assert_close(value, 0.5 * start[name] + 0.5 * final[name], rtol=1e-6, atol=1e-7)


def test_export_warns_when_the_ema_saw_few_updates(tiny_wan, shapes_videos, spindle_cli, tmp_path):
    """An EMA exported after few updates is mostly its starting weights: the run and `spindle export`
    say so (issue 43); one that has seen enough updates exports quietly."""
    from tests.conftest import run_spindle, train_overrides

    config = tmp_path / "job.yaml"
    config.write_text("{}\n")

    def overrides(out, decay):
        short = dict(train__max_steps=2, train__global_batch_size=2, train__ema=f"{{decay: {decay}}}")
        return train_overrides(tiny_wan, shapes_videos, out, **short)

    run = run_spindle("train", config, *overrides(tmp_path / "run", 0.99))  # the CLI's own logging
    assert run.returncode == 0, run.stderr
    assert "the exported EMA has seen 2 update(s) (train.ema.decay=0.99): 98% of it" in run.stderr
    assert "export.weights: trained" in run.stderr
    again = spindle_cli("export", tmp_path / "run", "--out", tmp_path / "out")
    assert again.returncode == 0 and "warning: the exported EMA has seen 2 update(s)" in again.stderr
    trained = spindle_cli("export", tmp_path / "run", "--out", tmp_path / "t", "--weights", "trained")
    assert trained.returncode == 0 and "EMA" not in trained.stderr
    quick = run_spindle("train", config, *overrides(tmp_path / "quick", 0.5))
    assert quick.returncode == 0 and "exported EMA" not in quick.stderr
