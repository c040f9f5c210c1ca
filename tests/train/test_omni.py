"""The omni task (spindle.train.tasks.omni) on the tiny Qwen2.5-Omni: step-1 loss and grad norm equal the
stock thinker on the stock processor's inputs, a packed row's loss equals its conversations' losses, an
audio-free batch runs the audio encoder with weight zero, train.freeze over the audio encoder, and an
export that the stock full model loads (talker and token2wav tensors byte-identical to the input) and
whose thinker answers an audio clip.

(Multi-process layouts against one process: tests/distributed/test_omni_distributed.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from spindle.api import load_job_config, make_trainer
from spindle.testing import vlm_conformance as suite
from spindle.testing.vlm_conformance import subset
from tests.data.test_omni_data import lines, stock_call, stock_processor
from tests.train.test_vlm import grad_norm, vlm_overrides

SEQ = 128  # the longest conversation of the shared data is 92 tokens: nothing is cut


def omni_overrides(model: Path, data: Path, out: Path, **values) -> list[str]:
    return vlm_overrides(model, data, out, **{"data__seq_len": SEQ, **values})


def omni_train(model: Path, data: Path, out: Path, **overrides):
    trainer = make_trainer(load_job_config(None, omni_overrides(model, data, out, **overrides)))
    return trainer, trainer.run()


def stock_inputs(
    model: Path, data: Path, family_name: str = "qwen2_5_omni", processor_class: type | None = None
) -> list[dict]:
    """Each conversation as the stock thinker takes it: the stock processor's output (tests/data/test_omni_data.py
    proves it equals Spindle's rows) and labels = the assistant tokens (-100 elsewhere; the model shifts)."""
    from spindle.data.multimodal import conversation_document
    from tests.data.test_omni_data import omni_processor

    ours, stock = omni_processor(model, family_name), stock_processor(model, processor_class)
    out = []
    for obj in lines(data):
        doc, _ = conversation_document(obj, data.parent, ours, 4096, "x")
        inputs = stock_call(stock, obj, data.parent)
        assert inputs["input_ids"][0].tolist() == doc.tokens
        inputs["labels"] = torch.tensor([[t if keep else -100 for t, keep in zip(doc.tokens, doc.learn, strict=True)]])
        out.append(inputs)
    return out


def stock_thinker(path: Path, cls: str = "Qwen2_5OmniThinkerForConditionalGeneration"):
    """The stock transformers thinker `cls` of the folder, fp32, sdpa, in training mode."""
    import transformers

    model = getattr(transformers, cls).from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    return model


def first_step(model: Path, conversations: Path, out: Path, line: int, **stock) -> tuple[dict, dict]:
    """Spindle's logged first step on the conversation `line` alone (unpacked), and the stock processor's inputs
    for it (`stock`: stock_inputs' family and processor)."""
    data = subset(conversations, out / "data", [line])
    omni_train(model, data, out / "run", data__packing=False, train__max_steps=1)
    logged = json.loads((out / "run" / "metrics.jsonl").read_text().splitlines()[0])
    (inputs,) = stock_inputs(model, data, **stock)
    assert "input_features" in inputs
    return logged, inputs


@pytest.mark.parametrize("line", [0, 2], ids=["audio", "image_then_audio"])
def test_step1_loss_and_grad_norm_equal_the_stock_thinker(line, tiny_qwen2_5_omni, omni_conversations, tmp_path):
    logged, inputs = first_step(tiny_qwen2_5_omni, omni_conversations, tmp_path, line)
    model = stock_thinker(tiny_qwen2_5_omni)
    loss = model(**inputs).loss
    loss.backward()
    assert logged["loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    assert logged["grad_norm"] == pytest.approx(grad_norm(model), rel=1e-4)


def test_packed_row_loss_equals_the_conversations_losses(tiny_qwen2_5_omni, omni_conversations, tmp_path):
    """The four conversations (audio, image, image + audio, image) in one packed row: the summed loss equals the
    sum of the stock thinker's per-conversation losses (neither attention nor positions cross conversations,
    and the clips' features go to their own tokens)."""
    data = subset(omni_conversations, tmp_path / "data", [0, 1, 2, 3])
    trainer = make_trainer(
        load_job_config(None, omni_overrides(tiny_qwen2_5_omni, data, tmp_path / "run", data__seq_len=384))
    )
    assert trainer.loader.dataset.stats.rows == 1
    batch = next(trainer.loader)
    assert batch["input_features"].shape[0] == 2 and batch["image_grid_thw"].shape[0] == 3
    packed = trainer.task.forward(trainer.model, batch, 0).loss_sum

    model = stock_thinker(tiny_qwen2_5_omni)
    total = torch.zeros(())
    for inputs in stock_inputs(tiny_qwen2_5_omni, data):
        n = int((inputs["labels"][:, 1:] != -100).sum())
        total = total + model(**inputs).loss * n
    torch.testing.assert_close(packed, total, rtol=1e-5, atol=0)


def test_audio_free_batch_runs_the_audio_encoder_with_zero_weight(tiny_qwen2_5_omni, omni_conversations, tmp_path):
    """A micro-batch without audio still runs the audio encoder (what keeps FSDP2's collectives in step across
    ranks): every parameter its forward uses gets a gradient, all zeros, and the loss is the stock loss."""
    data = subset(omni_conversations, tmp_path / "data", [0, 1])  # line 1: an image, no audio
    trainer = make_trainer(
        load_job_config(None, omni_overrides(tiny_qwen2_5_omni, data, tmp_path / "run", data__packing=False))
    )
    next(trainer.loader)
    batch = next(trainer.loader)
    assert "input_features" not in batch and "pixel_values" in batch
    out = trainer.task.forward(trainer.model, batch, 0)
    out.loss_sum.backward()
    audio = {n: p for n, p in trainer.model.named_parameters() if n.startswith("model.audio_tower.")}
    # audio_bos_eos_token is a parameter the stock forward never uses (no gradient in stock either)
    used = {n: p for n, p in audio.items() if "audio_bos_eos_token" not in n}
    assert used and all(p.grad is not None and not p.grad.any() for p in used.values())

    inputs = stock_inputs(tiny_qwen2_5_omni, data)[1]
    n = int((inputs["labels"][:, 1:] != -100).sum())
    torch.testing.assert_close(out.loss_sum, stock_thinker(tiny_qwen2_5_omni)(**inputs).loss * n, rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    ("freeze", "trained"),
    [(["audio"], {"vision", "aligner", "language"}), (["audio", "vision", "language"], {"aligner"})],
    ids=["audio", "all_but_aligners"],
)
def test_freeze_keeps_parts_unchanged_without_optimizer_state(
    freeze, trained, tiny_qwen2_5_omni, omni_conversations, tmp_path
):
    from spindle.registry import get_family

    family = get_family("qwen2_5_omni")
    trainer, _ = omni_train(tiny_qwen2_5_omni, omni_conversations, tmp_path / "run", **suite.freeze_overrides(freeze))
    before, after = (stock_thinker(path).state_dict() for path in (tiny_qwen2_5_omni, tmp_path / "run" / "export"))
    suite.check_frozen_parts(family, trainer, before, after, trained)


def test_freeze_names_only_the_familys_parts(tiny_qwen2_5_vl, tmp_path):
    from spindle.api import check_job_plan
    from spindle.config import ConfigError

    cfg = load_job_config(
        None, vlm_overrides(tiny_qwen2_5_vl, tmp_path / "d.jsonl", tmp_path, train__freeze='["audio"]')
    )
    with pytest.raises(ConfigError, match=r"train\.freeze names \['audio'\], which qwen2_5_vl models do not have"):
        check_job_plan(cfg, 1)


def untrained_bytes(
    folder: Path, prefixes: tuple[str, ...] = ("talker.", "token2wav.")
) -> dict[str, tuple[torch.dtype, bytes]]:
    """Every tensor of a folder's untrained sub-models (`prefixes`: talker, token2wav) as stored: (dtype, raw bytes)."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    )
    out = {}
    for name in files:
        with safe_open(str(folder / name), "pt") as f:
            for k in f.keys():
                if k.startswith(prefixes):
                    t = f.get_tensor(k)
                    out[k] = (t.dtype, t.contiguous().view(torch.uint8).numpy().tobytes())
    return out


def test_export_loads_in_the_stock_full_model_and_answers_an_audio_clip(
    tiny_qwen2_5_omni, omni_conversations, tmp_path, spindle_cli
):
    from transformers import Qwen2_5OmniForConditionalGeneration

    from spindle.data.audio import decode_audio

    trainer, _ = omni_train(tiny_qwen2_5_omni, omni_conversations, tmp_path / "run", train__max_steps=2)
    data = json.loads((tmp_path / "run" / "summary.json").read_text())["start"]["data"]
    assert (data["documents"], data["images"], data["audio_clips"], data["skipped"]) == (4, 3, 2, 0)
    export = tmp_path / "run" / "export"
    before = untrained_bytes(tiny_qwen2_5_omni)
    assert before and untrained_bytes(export) == before  # the talker and token2wav as they came
    for name in ("spk_dict.pt", "preprocessor_config.json"):
        assert (export / name).read_bytes() == (tiny_qwen2_5_omni / name).read_bytes()

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(export)
    assert set(model.speaker_map) == {"Chelsie", "Ethan"}
    trained = trainer.model.state_dict()
    thinker = model.thinker.state_dict()
    assert thinker.keys() == trained.keys()
    for k, v in thinker.items():
        assert torch.equal(v, trained[k]), k

    # the thinker answers an audio clip: the stock processor's prompt, greedy text generation
    stock = stock_processor(export)
    user = lines(omni_conversations)[0]["messages"][0]  # an audio part and a question
    prompt = stock.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
    clip = decode_audio(omni_conversations.parent / user["content"][0]["audio"], 16000)
    inputs = dict(stock(text=[prompt], audio=[clip], return_tensors="pt"))
    out = model.generate(
        **inputs, generation_mode="text", thinker_max_new_tokens=5, thinker_do_sample=False, thinker_min_new_tokens=5
    )
    ids = inputs["input_ids"]
    assert out.shape == (1, ids.shape[1] + 5) and torch.equal(out[:, : ids.shape[1]], ids)
    reply = stock.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)[0]
    assert isinstance(reply, str)

    # `spindle export` of the final checkpoint writes the same folder on one process.
    r = spindle_cli("export", tmp_path / "run", "--out", tmp_path / "cli")
    assert r.returncode == 0, r.stderr
    assert untrained_bytes(tmp_path / "cli") == before
    again = Qwen2_5OmniForConditionalGeneration.from_pretrained(tmp_path / "cli").thinker.state_dict()
    assert all(torch.equal(again[k], thinker[k]) for k in thinker)


def test_lora_trains_adapters_and_refuses_a_merged_export(tiny_qwen2_5_omni, omni_conversations, tmp_path):
    from spindle.api import check_job_plan
    from spindle.config import ConfigError

    trainer, _ = omni_train(
        tiny_qwen2_5_omni, omni_conversations, tmp_path / "run", train__max_steps=2, train__lora='{"rank": 4}'
    )
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora" in n and n.startswith("model.language_model.") for n in trainable)
    assert (tmp_path / "run" / "export" / "lora" / "adapter_model.safetensors").is_file()
    cfg = load_job_config(
        None,
        omni_overrides(
            tiny_qwen2_5_omni, omni_conversations, tmp_path, train__lora='{"rank": 4}', export__merge_lora=True
        ),
    )
    with pytest.raises(ConfigError, match=r"export\.merge_lora"):
        check_job_plan(cfg, 1)


def video_step(model: Path, out: Path, use_audio_in_video: bool) -> tuple[Any, dict, dict, dict]:
    """Step 1 of Spindle on one conversation about a video with an audio track (`data.use_audio_in_video` as
    given): the trainer, its logged metrics, the dataset's row and the row's collated vision inputs."""
    from spindle.data.multimodal import collate_vision
    from tests.data.test_omni_data import video_with_audio

    data = out / "data"
    data.mkdir()
    video_with_audio(data)
    user = [{"type": "video", "video": "clip.mp4"}, {"type": "text", "text": "What?"}]
    line = {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": "A tone."}]}
    (data / "data.jsonl").write_text(json.dumps(line) + "\n")
    trainer, _ = omni_train(
        model,
        data / "data.jsonl",
        out / "run",
        data__packing=False,
        train__max_steps=1,
        data__use_audio_in_video=use_audio_in_video,
    )
    logged = json.loads((out / "run" / "metrics.jsonl").read_text().splitlines()[0])
    batch = trainer.loader.dataset[0]
    return trainer, logged, batch, collate_vision(batch["vision"])


def unshifted(shift_labels: torch.Tensor) -> torch.Tensor:
    """[1, L] labels as stock takes them (it shifts): position i+1's label is shift_labels[i]."""
    return torch.cat([torch.tensor([-100]), shift_labels[:-1]])[None]


def test_use_audio_in_video_step1_equals_the_stock_thinker(tiny_qwen2_5_omni, tiny_qwen2_5_vl, tmp_path):
    """A video with its audio track (`data.use_audio_in_video`): step 1's loss and grad norm equal the stock
    thinker given Spindle's tokens, frames and track features, computing its own positions with
    use_audio_in_video. A VLM family refuses the option."""
    from spindle.api import check_job_plan
    from spindle.config import ConfigError

    _, logged, batch, inputs = video_step(tiny_qwen2_5_omni, tmp_path, use_audio_in_video=True)
    model = stock_thinker(tiny_qwen2_5_omni)
    loss = model(
        input_ids=batch["input_ids"][None],
        attention_mask=batch["attention_mask"][None],
        labels=unshifted(batch["shift_labels"]),
        use_audio_in_video=True,
        video_second_per_grid=inputs.pop("second_per_grid_ts"),
        **inputs,
    ).loss
    loss.backward()
    assert logged["loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    assert logged["grad_norm"] == pytest.approx(grad_norm(model), rel=1e-4)

    cfg = load_job_config(
        None, vlm_overrides(tiny_qwen2_5_vl, tmp_path / "data" / "data.jsonl", tmp_path, data__use_audio_in_video=True)
    )
    with pytest.raises(ConfigError, match=r"data\.use_audio_in_video: qwen2_5_vl models: they do not take"):
        check_job_plan(cfg, 1)


def test_the_talker_and_token2wav_are_never_read_for_training(tiny_qwen2_5_omni, omni_conversations, tmp_path):
    """The tensors the training model is loaded from are the thinker's only; the model holds no talker."""
    trainer = make_trainer(load_job_config(None, omni_overrides(tiny_qwen2_5_omni, omni_conversations, tmp_path)))
    sources = trainer.task.checkpoint_sources()
    assert set(sources) == set(trainer.model.state_dict())
    names = [n for n, _ in trainer.model.named_modules()]
    assert not any("talker" in n or "token2wav" in n for n in names)
    assert type(trainer.model).__name__ == "Qwen2_5OmniThinkerForConditionalGeneration"


def test_gradient_checkpointing_equals_the_plain_run(tiny_qwen2_5_omni, omni_conversations, tmp_path):
    """Activation checkpointing recomputes encoder layers, vision blocks and decoder layers (with the tower and
    language-model hooks, audio-free and image-free rows included): the same losses and grad norms."""
    runs = []
    for ac in (False, True):
        out = tmp_path / f"ac_{ac}"
        omni_train(
            tiny_qwen2_5_omni,
            omni_conversations,
            out,
            train__max_steps=2,
            data__packing=False,
            train__global_batch_size=2,
            train__gradient_checkpointing=ac,
        )
        runs.append([json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()])
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in runs[1]] == pytest.approx([m[key] for m in runs[0]], rel=1e-5), key


def test_whole_model_load_path_equals_the_sharded_one(tiny_qwen2_5_omni, omni_conversations, tmp_path):
    """`model.sharded_load: false` (the thinker's own from_pretrained of the whole folder, which skips the
    talker's tensors) trains exactly as the sharded read of the thinker's tensors."""
    runs = []
    for sharded in (True, False):
        out = tmp_path / f"sharded_{sharded}"
        omni_train(tiny_qwen2_5_omni, omni_conversations, out, train__max_steps=2, model__sharded_load=sharded)
        runs.append([json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()])
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in runs[1]] == [m[key] for m in runs[0]], key
