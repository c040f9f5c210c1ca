"""LoRA fine-tuning: only adapters train, exports load in stock diffusers, original layout round-trips."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from spindle.api import load_generator, make_trainer, train
from spindle.config import ConfigError
from spindle.train.metrics import read_metrics
from tests.conftest import TINY_TEXT, train_interrupted

LORA = "{rank: 4, alpha: 8}"
# max_sequence_length: the stock pipeline's default is 512; Spindle's, on a LoRA export, the length it
# was trained with (TINY_TEXT, recorded in its spindle.json): both given the same here
SAMPLE = dict(
    prompt="a red circle moves left",
    height=32,
    width=32,
    num_frames=5,
    num_inference_steps=2,
    max_sequence_length=TINY_TEXT,
)


@pytest.fixture(scope="module")
def lora_run(tiny_wan, shapes_videos, tmp_path_factory):
    """3 LoRA steps on the tiny Wan with a merged export too; -> (trainer, result)."""
    from spindle.api import load_job_config
    from tests.conftest import train_overrides

    out = tmp_path_factory.mktemp("lora") / "run"
    overrides = train_overrides(
        tiny_wan, shapes_videos, out, train__max_steps=3, train__global_batch_size=2, train__lora=LORA
    )
    cfg = load_job_config(None, [*overrides, "export.merge_lora=true"])
    trainer = make_trainer(cfg)
    return trainer, trainer.run()


def test_only_adapters_train_and_base_stays_bit_identical(lora_run, tiny_wan):
    trainer, result = lora_run
    model = trainer.model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    in_optimizer = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for n, p in model.named_parameters() if n in trainable}

    base = load_file(tiny_wan / "transformer" / "diffusion_pytorch_model.safetensors")
    current = {n.replace(".base_layer", ""): p for n, p in model.state_dict().items() if n not in trainable}
    assert current.keys() == base.keys()
    for key, value in base.items():
        assert torch.equal(current[key], value), f"base tensor {key} changed"
    ups = [p for n, p in model.named_parameters() if ".lora_B." in n]
    assert any(p.abs().max() > 0 for p in ups), "the adapters did not train (lora_B still zero)"

    # the checkpoint holds only the adapters (plus their optimizer state)
    import torch.distributed.checkpoint as dcp

    ckpt = result.output_dir / "checkpoints" / "step-000003"
    saved = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    model_keys = {k[len("model.") :] for k in saved if k.startswith("model.")}
    assert model_keys == trainable
    assert json.loads((ckpt / "trainer_state.json").read_text())["lora"]["rank"] == 4


def _stock_frames(root, lora=None, fuse=False):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(root)
    if lora is not None:
        pipe.load_lora_weights(lora)
    return pipe(**SAMPLE, guidance_scale=1.0, output_type="np", generator=torch.Generator().manual_seed(0)).frames


def _spindle_frames(root, num_frames=SAMPLE["num_frames"], **options):

    gen = load_generator(root, device="cpu", **options)
    return gen.generate(**{**SAMPLE, "num_frames": num_frames}, guidance_scale=1.0, seed=0).frames


def test_diffusers_export_loads_in_stock_diffusers_like_generate_lora(lora_run, tiny_wan):
    _, result = lora_run
    lora_dir = result.export_dir / "lora"
    stock = _stock_frames(tiny_wan, lora=lora_dir)
    ours = _spindle_frames(tiny_wan, lora=str(lora_dir))
    assert np.abs(stock - ours).max() <= 1e-5
    base = _spindle_frames(tiny_wan)
    assert np.abs(base - ours).max() > 1e-4, "the LoRA changed nothing"
    # the original-layout file, read by diffusers' converter inside --lora, gives the same frames
    original = _spindle_frames(tiny_wan, lora=str(lora_dir / "original_layout_lora.safetensors"))
    assert np.abs(original - ours).max() <= 1e-5
    # scale 0 switches the adapter off
    off = _spindle_frames(tiny_wan, lora=str(lora_dir), lora_scale=0.0)
    assert np.abs(off - base).max() <= 1e-6
    # the merged pipeline folder (LoRA fused into the weights) loads in stock diffusers alone
    merged = _stock_frames(result.export_dir / "merged")
    assert np.abs(merged - ours).max() <= 1e-4


def test_adapter_file_equals_trained_adapters(lora_run):
    trainer, result = lora_run
    exported = load_file(result.export_dir / "lora" / "pytorch_lora_weights.safetensors")
    scale = 8 / 4  # alpha / rank, folded into lora_B
    params = dict(trainer.model.named_parameters())
    assert len(exported) == sum(1 for n in params if ".lora_" in n)
    for key, value in exported.items():
        name = key.removeprefix("transformer.").replace(".lora_A.", ".lora_A.default.")
        name = name.replace(".lora_B.", ".lora_B.default.")
        expected = params[name].detach() * (scale if ".lora_B." in key else 1.0)
        assert torch.equal(value, expected), key


def test_wan_original_layout_round_trips_through_diffusers(lora_run):
    from diffusers import WanPipeline

    _, result = lora_run
    ours = load_file(result.export_dir / "lora" / "pytorch_lora_weights.safetensors")
    original_file = result.export_dir / "lora" / "original_layout_lora.safetensors"
    assert all(k.startswith("diffusion_model.blocks.") for k in load_file(original_file))
    back = WanPipeline.lora_state_dict(load_file(original_file))
    assert back.keys() == ours.keys()
    assert all(torch.equal(back[k], ours[k]) for k in ours)


def test_flux_original_layout_round_trips_through_diffusers():
    """At FLUX.1's real projection sizes (diffusers' kohya reader hard-codes them for fused linear1):
    q/k/v and the single blocks' q/k/v/mlp are fused in the original layout and split back exactly."""
    from diffusers import FluxPipeline

    from spindle.models.flux.lora import to_original

    g = torch.Generator().manual_seed(0)
    inner, mlp, r = 3072, 12288, 2
    double = {
        **{f"attn.{p}": (inner, inner) for p in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")},
        "attn.to_out.0": (inner, inner),
        "attn.to_add_out": (inner, inner),
        "ff.net.0.proj": (inner, 4 * inner),
        "ff.net.2": (4 * inner, inner),
        "ff_context.net.0.proj": (inner, 4 * inner),
        "ff_context.net.2": (4 * inner, inner),
    }
    single = {**{f"attn.{p}": (inner, inner) for p in ("to_q", "to_k", "to_v")}, "proj_mlp": (inner, mlp)}
    single["proj_out"] = (inner + mlp, inner)
    ours = {}
    for prefix, table in (("transformer_blocks.0", double), ("single_transformer_blocks.1", single)):
        for module, (fan_in, fan_out) in table.items():
            ours[f"{prefix}.{module}.lora_A.weight"] = torch.randn(r, fan_in, generator=g)
            ours[f"{prefix}.{module}.lora_B.weight"] = torch.randn(fan_out, r, generator=g)
    original = to_original(ours)
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight" in original
    assert original["lora_unet_single_blocks_1_linear1.lora_down.weight"].shape == (4 * r, inner)
    back = FluxPipeline.lora_state_dict(original)
    back = {k.removeprefix("transformer."): v for k, v in back.items()}
    assert back.keys() == ours.keys()
    assert all(torch.equal(back[k], ours[k]) for k in ours)


def test_lora_resume_is_exact(make_config, tmp_path, monkeypatch):
    common = dict(train__max_steps=4, train__global_batch_size=2, checkpoint__every_steps=2, checkpoint__export=False)
    train(make_config(tmp_path / "straight", train__lora=LORA, **common))
    train_interrupted(make_config, tmp_path / "resumed", monkeypatch, 3, train__lora=LORA, **common)
    train(make_config(tmp_path / "resumed", train__lora=LORA, checkpoint__resume="auto", **common))
    straight = [(m["loss"], m["grad_norm"]) for m in read_metrics(tmp_path / "straight")]
    resumed = [(m["loss"], m["grad_norm"]) for m in read_metrics(tmp_path / "resumed")]
    assert resumed == straight


def test_lora_with_activation_checkpointing_gives_the_same_run(make_config, tmp_path):
    common = dict(train__max_steps=2, train__global_batch_size=2, train__lora=LORA, checkpoint__export=False)
    train(make_config(tmp_path / "plain", **common))
    train(make_config(tmp_path / "ckpt", train__gradient_checkpointing=True, **common))
    for key in ("loss", "grad_norm"):
        plain = [m[key] for m in read_metrics(tmp_path / "plain")]
        assert [m[key] for m in read_metrics(tmp_path / "ckpt")] == pytest.approx(plain, rel=1e-6), key


def test_export_cli_writes_the_lora_of_a_checkpoint(lora_run, tmp_path):
    from tests.conftest import run_spindle

    _, result = lora_run
    out = tmp_path / "exported"
    proc = run_spindle("export", result.output_dir, "--out", out)
    assert proc.returncode == 0, proc.stderr
    a = load_file(result.export_dir / "lora" / "pytorch_lora_weights.safetensors")
    b = load_file(out / "lora" / "pytorch_lora_weights.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_export_cli_merge_writes_a_full_pipeline_stock_diffusers_loads(lora_run, tiny_wan, tmp_path, spindle_cli):
    """`spindle export RUN --merge` (issue 43): OUT/merged is a full pipeline with the LoRA fused that
    stock `WanPipeline.from_pretrained` loads and that generates what base + LoRA generates; without
    --merge, `generate --model RUN_EXPORT` says to use `--model BASE --lora DIR` (or --merge)."""
    _, result = lora_run
    out = tmp_path / "exported"
    proc = spindle_cli("export", result.output_dir, "--out", out, "--merge")
    assert proc.returncode == 0, proc.stderr
    assert (out / "lora" / "pytorch_lora_weights.safetensors").is_file()
    merged = _stock_frames(out / "merged")
    with_lora = _stock_frames(tiny_wan, lora=out / "lora")
    assert np.abs(merged - with_lora).max() <= 1e-4
    assert np.abs(merged - _stock_frames(tiny_wan)).max() > 1e-4, "the merge changed nothing"

    plain = tmp_path / "plain"
    assert spindle_cli("export", result.output_dir, "--out", plain).returncode == 0
    assert not (plain / "merged").exists()
    proc = spindle_cli("generate", "--model", plain, "--prompt", "a cat", "--out", tmp_path / "x.png")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"--model {tiny_wan.resolve()} --lora {plain / 'lora'}" in proc.stderr and "--merge" in proc.stderr


def test_export_cli_merge_of_a_full_fine_tune_is_refused(tiny_qwen3, lm_corpus, tmp_path, spindle_cli):
    from tests.conftest import lm_train

    _, result = lm_train(tiny_qwen3, lm_corpus, tmp_path / "run", train__max_steps=1, checkpoint__export=False)
    proc = spindle_cli("export", result.output_dir, "--out", tmp_path / "x", "--merge")
    assert proc.returncode == 2 and "no train.lora" in proc.stderr and "drop --merge" in proc.stderr


# ---------------------------------------------------------------- bad input


def test_unknown_target_names_the_closest_modules(make_config):
    cfg = make_config(train__lora="{rank: 4, targets: [to_qq]}")
    with pytest.raises(ConfigError, match=r"'to_qq' matches no linear layer.*attn1\.to_q"):
        make_trainer(cfg)
    # a Wan block's 3-D scale_shift_table is no fused expert stack (those are opt-in targets of MoE models)
    cfg = make_config(train__lora="{rank: 4, targets: [scale_shift_table]}")
    with pytest.raises(ConfigError, match=r"'scale_shift_table' matches no linear layer or fused expert"):
        make_trainer(cfg)


@pytest.mark.parametrize("rank", [0, -2])
def test_rank_must_be_positive(make_config, rank):
    with pytest.raises(ConfigError, match=r"train\.lora\.rank must be a positive integer"):
        make_config(train__lora=f"{{rank: {rank}}}")


def test_lora_for_another_family_is_refused(tiny_wan, tmp_path):

    flux_lora = tmp_path / "flux_lora.safetensors"
    save_file(
        {
            "transformer.single_transformer_blocks.0.proj_mlp.lora_A.weight": torch.zeros(4, 32),
            "transformer.single_transformer_blocks.0.proj_mlp.lora_B.weight": torch.zeros(64, 4),
        },
        str(flux_lora),
    )
    with pytest.raises(
        ValueError,
        match=r"flux_lora\.safetensors does not fit this wan checkpoint.*single_transformer_blocks.*another model family",
    ):
        load_generator(tiny_wan, device="cpu", lora=str(flux_lora))


def test_lora_of_another_shape_is_refused(lora_run, tiny_wan, tmp_path):

    _, result = lora_run
    ours = load_file(result.export_dir / "lora" / "pytorch_lora_weights.safetensors")
    wide = {k: torch.cat([v, v], dim=1) if ".lora_A." in k else v for k, v in ours.items()}  # other in_features
    path = tmp_path / "wide.safetensors"
    save_file(wide, str(path))
    with pytest.raises(ValueError, match=r"(?s)wide\.safetensors does not fit this wan checkpoint.*size mismatch"):
        load_generator(tiny_wan, device="cpu", lora=str(path))


# ---------------------------------------------------------------- Flux and the CLI


def test_flux_lora_trains_exports_and_loads_in_stock_diffusers(tiny_flux, tmp_path):
    from diffusers import FluxPipeline

    from spindle.api import load_job_config
    from spindle.data.synthetic import make_shapes_image_dataset
    from tests.conftest import train_overrides

    tiny = tiny_flux
    images = make_shapes_image_dataset(tmp_path / "images", num_images=4, size=(32, 32))
    overrides = dict(data__num_frames=1, data__resolution=[32, 32], train__max_steps=2, train__global_batch_size=2)
    cfg = load_job_config(None, train_overrides(tiny, images, tmp_path / "run", **overrides, train__lora=LORA))
    result = train(cfg)
    lora_dir = result.export_dir / "lora"
    assert (lora_dir / "original_layout_lora.safetensors").is_file()
    original = load_file(lora_dir / "original_layout_lora.safetensors")
    assert any(k.startswith("lora_unet_single_blocks_0_linear1.") for k in original)

    request = dict(
        prompt="a red circle", height=32, width=32, num_inference_steps=2, guidance_scale=3.5, max_sequence_length=16
    )
    pipe = FluxPipeline.from_pretrained(tiny)
    pipe.load_lora_weights(lora_dir)
    stock = pipe(**request, output_type="np", generator=torch.Generator().manual_seed(0)).images
    gen = load_generator(tiny, device="cpu", lora=str(lora_dir))
    ours = gen.generate(**request, seed=0).frames
    assert np.abs(stock - ours).max() <= 1e-5
    base = load_generator(tiny, device="cpu").generate(**request, seed=0).frames
    assert np.abs(base - ours).max() > 1e-4, "the LoRA changed nothing"


def test_generate_cli_applies_lora(lora_run, tiny_wan, tmp_path):
    from PIL import Image

    from tests.conftest import run_spindle

    _, result = lora_run
    out = tmp_path / "frame.png"
    request = ["--prompt", SAMPLE["prompt"], "--height", "32", "--width", "32", "--num-frames", "1"]
    request += ["--steps", "2", "--guidance", "1", "--seed", "0", "--quiet"]
    lora = ["--lora", str(result.export_dir / "lora"), "--lora-scale", "0.5"]
    proc = run_spindle("generate", "--model", tiny_wan, *request, *lora, "--out", out)
    assert proc.returncode == 0, proc.stderr
    api = _spindle_frames(tiny_wan, num_frames=1, lora=str(result.export_dir / "lora"), lora_scale=0.5)
    written = np.asarray(Image.open(out).convert("RGB"), dtype=np.float32) / 255
    assert np.abs(written - api[0, 0]).max() <= 1 / 255 + 1e-6  # png rounding only


def test_the_lora_export_says_how_to_use_it(lora_run, tiny_wan, spindle_cli, tmp_path):
    """The LoRA folder names its base model and the exact lines that use it; given as --model it is
    explained in one line (exit 2); generate defaults to the text length it was trained with."""
    _, result = lora_run
    lora_dir = (result.export_dir / "lora").resolve()
    base = str(tiny_wan.resolve())
    card = (lora_dir / "README.md").read_text()
    assert f"spindle generate --model {base} --lora {lora_dir} " in card
    assert f'diffusers.WanPipeline.from_pretrained("{base}")' in card
    assert f'pipe.load_lora_weights("{lora_dir}")' in card and f"max_sequence_length={TINY_TEXT}" in card
    record = json.loads((lora_dir / "spindle.json").read_text())
    assert record == {"base_model": base, "family": "wan", "max_text_length": TINY_TEXT}

    proc = spindle_cli("generate", "--model", lora_dir, "--prompt", "a cat", "--out", tmp_path / "x.png")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "is a LoRA (pytorch_lora_weights.safetensors), not a model" in proc.stderr
    assert f"spindle generate --model {base} --lora {lora_dir}" in proc.stderr

    assert load_generator(tiny_wan, device="cpu", lora=str(lora_dir)).defaults.max_sequence_length == TINY_TEXT
    assert load_generator(tiny_wan, device="cpu").defaults.max_sequence_length == 512  # no record: the family's


def test_an_i2v_lora_card_runs_as_written(tiny_wan_i2v, shapes_videos, tmp_path, spindle_cli, monkeypatch):
    """The LoRA card of an image-to-video LoRA (issue 43): its `spindle generate` line passes `--image`
    and the size it was trained at, and runs as written from a folder holding `image.png`; its
    diffusers snippet passes `image=` and runs as written too."""
    import shlex

    from PIL import Image

    from spindle.models.wan_i2v import TEXT_LENGTH
    from tests.conftest import TINY_FRAMES, TINY_SIZE, train_overrides

    overrides = train_overrides(
        tiny_wan_i2v,
        shapes_videos,
        tmp_path / "run",
        train__max_steps=1,
        train__global_batch_size=2,
        train__lora=LORA,
        model__max_text_length=TEXT_LENGTH,
    )
    config = tmp_path / "job.yaml"
    config.write_text("{}\n")
    trained = spindle_cli("train", config, *overrides)
    assert trained.returncode == 0, trained.stderr
    card = (tmp_path / "run" / "export" / "lora" / "README.md").read_text()
    spindle_line = next(line for line in card.splitlines() if line.startswith("spindle generate"))
    height, width = TINY_SIZE
    assert f"--image image.png --height {height} --width {width} --num-frames {TINY_FRAMES}" in spindle_line
    snippet = card.split("```python\n")[1].split("```")[0]
    assert 'image=load_image("image.png")' in snippet

    work = tmp_path / "work"
    work.mkdir()
    Image.new("RGB", (width, height), (200, 40, 40)).save(work / "image.png")
    monkeypatch.chdir(work)
    args = shlex.split(spindle_line)[1:]
    proc = spindle_cli(*args)
    assert proc.returncode == 0, proc.stderr
    assert (work / "sample.mp4").stat().st_size > 0
    scope: dict = {}
    exec(compile(snippet, "card", "exec"), scope)
    assert scope["out"].frames.shape[1] == TINY_FRAMES
