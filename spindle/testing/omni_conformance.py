"""The conformance suite's checks for omni families: what every omni-modal family must pass.

tests/conformance/test_omni_conformance.py runs each check over every omni family in the registry, so a new
family is tested by registering it. An omni family's checkpoint is a whole speech-in/speech-out model of which
Spindle trains the thinker (`OmniFamily`): the checks are the VLM suite's (spindle/testing/vlm_conformance.py,
reused here, not copied) on audio conversations, against the stock thinker and the stock full model. What a
family declares for the suite is its `CausalLMConformanceSpec` (an `OmniFamily` is a `CausalLMFamily`): the
stock forward's loss arguments and the outputs its step metrics equal (an MoE's `output_router_logits` and aux
loss), and its 2-process layouts (plus ep2 where its task supports expert parallelism).

The reference data is `omni_conversations` (tests/conftest.py): a 0.5 s tone; an image; an image then a 1 s
tone; an image. Tolerances: step-1 loss 1e-5 and grad norm 1e-4 relative against the stock thinker; exports
equal the trained weights exactly, the untrained sub-models byte for byte; layouts equal one process (loss,
grad norm, aux loss 1e-5 relative, exported weights 1e-5 absolute).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from spindle.contracts.family import OmniFamily
from spindle.testing import causal_lm_conformance as lm_suite
from spindle.testing import vlm_conformance as vlm_suite

SEQ = 128  # the longest conversation of the shared data is 92 tokens: nothing is cut
# step 1 against the stock thinker: an audio conversation, and one with an image before its audio clip
STEP_ONE_LINES = {"audio": 0, "image_then_audio": 2}
# The 2-process runs (the VLM suite's REFERENCE_RUN: 2 steps, global batch 2 in micro-batches of 1, unpacked)
# on the 4 conversations in order (audio, image, image + audio, image): with 2 data-parallel ranks rank 0
# sees only audio rows and rank 1 only audio-free ones (its audio encoder runs the zero-weight dummy forward).
REFERENCE_LINES = [0, 1, 2, 3]
LAYOUTS: dict[str, dict[str, Any]] = {
    "dp_shard2_audio_free_rank": {"parallel__dp_shard": 2},
    "sp2": {"parallel__sp": 2, "parallel__dp_shard": 1},
    # the experts split over the 2 ranks, the dense thinker FSDP2-sharded over the same 2 (one audio-free)
    "ep2_audio_free_rank": {"parallel__ep": 2},
}
# which declared causal-LM layout name is which omni layout (CausalLMConformanceSpec.parallel)
DECLARED = {"dp_shard2": "dp_shard2_audio_free_rank", "sp2": "sp2", "ep2": "ep2_audio_free_rank"}
WEIGHT_ATOL = 1e-5  # a layout's exported thinker against one process's (2 AdamW steps)
# a fused MoE expert tensor of a stock model (`...mlp.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I])
_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<name>gate_up_proj|down_proj)$")


def parallel_layouts(family: OmniFamily) -> list[str]:
    """The 2-process layouts the suite checks for `family` (vlm_conformance.parallel_layouts, omni names)."""
    return vlm_suite.parallel_layouts(family, DECLARED)


# ---------------------------------------------------------------- data and the stock side


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def omni_processor(model: Path, family: OmniFamily) -> Any:
    """Spindle's processor of an omni checkpoint, as the omni task builds it."""
    from transformers import AutoTokenizer

    from spindle.data.multimodal import VisionOptions, VisionProcessor

    config = family.model_cls().config_class.from_pretrained(model)  # type: ignore[attr-defined]
    tok = AutoTokenizer.from_pretrained(model)
    return VisionProcessor(
        model,
        tok,
        config,
        family.rope_index_fn(),
        VisionOptions(),
        video_grid_seconds=family.video_grid_seconds,
        audio=True,
        audio_tokens=family.audio_tokens_fn(),
    )


def stock_processor(model: Path, video_processor: Any = None) -> Any:
    """transformers' omni processor of the folder (its AutoProcessor class) from its tokenizer, PIL image
    processor and WhisperFeatureExtractor (vlm_conformance.stock_processor); with no `video_processor` no video
    is processed."""
    from transformers import AutoFeatureExtractor

    feature_extractor = AutoFeatureExtractor.from_pretrained(model)
    return vlm_suite.stock_processor(model, video_processor, feature_extractor=feature_extractor)


def stock_call(stock: Any, obj: dict[str, Any], base: Path) -> dict[str, Any]:
    """The stock processor's output for one conversation (its media decoded as Spindle decodes audio)."""
    from PIL import Image

    from spindle.data.audio import decode_audio

    parts = [p for m in obj["messages"] if isinstance(m["content"], list) for p in m["content"]]
    images = [Image.open(base / p["image"]).convert("RGB") for p in parts if p["type"] == "image"] or None
    rate = stock.feature_extractor.sampling_rate
    audio = [decode_audio(base / p["audio"], rate) for p in parts if p["type"] == "audio"] or None
    text = stock.apply_chat_template(obj["messages"], tokenize=False)
    return dict(stock(text=[text], images=images, audio=audio, return_tensors="pt"))


def stock_inputs(model: Path, data: Path, family: OmniFamily) -> list[dict[str, Any]]:
    """Each conversation as the stock thinker takes it: the stock processor's output (asserted to hold
    Spindle's tokens; tests/data/test_omni_data.py checks the features and positions) and labels = the
    assistant tokens (-100 elsewhere; the model shifts them)."""
    from spindle.data.multimodal import conversation_document

    ours, stock = omni_processor(model, family), stock_processor(model)
    out = []
    for obj in lines(data):
        doc, _ = conversation_document(obj, data.parent, ours, 4096, "x")
        inputs = stock_call(stock, obj, data.parent)
        assert inputs["input_ids"][0].tolist() == doc.tokens, f"{family.name}: Spindle's tokens differ from stock's"
        inputs["labels"] = torch.tensor([[t if keep else -100 for t, keep in zip(doc.tokens, doc.learn, strict=True)]])
        out.append(inputs)
    return out


def stock_thinker(family: OmniFamily, path: Path) -> Any:
    """Stock transformers' fp32 thinker (the class of the name the family trains) of an omni folder, in
    training mode (as Spindle's first step runs)."""
    import transformers

    cls = getattr(transformers, family.model_cls().__name__)
    model = cls.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    return model


def stock_full_model(family: OmniFamily, path: Path, **kwargs: Any) -> Any:
    """The family's stock full model (`full_model_class`: thinker, talker, speech decoder) of an omni folder."""
    from spindle.contracts.family import import_object

    return import_object(family.full_model_class).from_pretrained(path, dtype=torch.float32, **kwargs)


def loading_info(family: OmniFamily, path: Path) -> dict[str, Any]:
    """transformers' loading info (missing, unexpected, mismatched keys) of the family's full model from `path`,
    through the base `from_pretrained`: Qwen2.5-Omni's own wrapper loads spk_dict.pt after it and fails when
    asked for the info."""
    from spindle.contracts.family import import_object

    cls = import_object(family.full_model_class)
    _, info = super(cls, cls).from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    return dict(info)


def stored_tensors(folder: Path, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder (all its safetensors files) whose name starts with one of `prefixes`."""
    from safetensors import safe_open

    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys() if k.startswith(prefixes)})
    return out


def untrained_bytes(folder: Path, prefixes: tuple[str, ...]) -> dict[str, tuple[torch.dtype, bytes]]:
    """Every tensor of a folder's untrained sub-models (`prefixes`: the family's `untrained`) as stored:
    (dtype, raw bytes)."""
    return {
        k: (t.dtype, t.contiguous().view(torch.uint8).numpy().tobytes())
        for k, t in stored_tensors(folder, prefixes).items()
    }


def video_with_audio(folder: Path) -> Path:
    """A 3 s, 4 fps mp4 (brightening frames) with a 3 s 440 Hz AAC track: `folder`/clip.mp4."""
    import numpy as np

    from spindle.data.audio import add_audio_track
    from spindle.data.media import write_video

    frames = np.stack([np.full((56, 56, 3), 20 * i, dtype=np.uint8) for i in range(12)])
    write_video(folder / "plain.mp4", frames, fps=4)
    t = np.arange(48000) / 16000
    return add_audio_track(folder / "plain.mp4", 0.5 * np.sin(2 * np.pi * 440 * t), 16000, folder / "clip.mp4")


def video_conversation(folder: Path) -> Path:
    """A conversations file of one line: `video_with_audio`'s clip and a question, a short answer."""
    folder.mkdir(parents=True, exist_ok=True)
    video_with_audio(folder)
    user = [{"type": "video", "video": "clip.mp4"}, {"type": "text", "text": "What?"}]
    line = {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": "A tone."}]}
    path = folder / "data.jsonl"
    path.write_text(json.dumps(line) + "\n")
    return path


def row_stock_inputs(row: dict[str, Any], use_audio_in_video: bool) -> dict[str, Any]:
    """One unpacked training row of Spindle's dataset as the stock thinker takes it: Spindle's tokens, media
    tensors and track features (the stock video processor needs torchvision), unshifted labels, and the
    arguments with which the thinker computes its own 3-D positions (the seconds per grid, use_audio_in_video)."""
    from spindle.data.multimodal import collate_vision

    vision = collate_vision(row["vision"])
    labels = row["shift_labels"]
    return {
        "input_ids": row["input_ids"][None],
        "attention_mask": row["attention_mask"][None],
        "labels": torch.cat([torch.tensor([-100]), labels[:-1]])[None],  # stock shifts: i+1's label is shift_labels[i]
        "video_second_per_grid": vision.pop("second_per_grid_ts"),
        "use_audio_in_video": use_audio_in_video,
        **vision,
    }


def check_speakers(family: OmniFamily, model: Any, folder: Path) -> None:
    """A folder with a speaker table (spk_dict.pt) loads into a full model that knows its speakers."""
    if (folder / "spk_dict.pt").is_file():
        speakers = torch.load(folder / "spk_dict.pt", weights_only=True)
        assert speakers and set(model.speaker_map) == set(speakers), f"{family.name}: speakers"


# ---------------------------------------------------------------- the tiny checkpoint


def check_stock_load(family: OmniFamily, path: Path) -> None:
    """The tiny checkpoint is a standard whole-model folder: its tensors are the thinker's and the untrained
    sub-models' (the thinker's experts as the family's checkpoint adapter reads them per expert, as Qwen's
    releases store them); the stock full model loads it with no key missing or unexpected, with a talker whose
    tensors are the stored ones (a fused expert tensor the stored per-expert ones stacked) and the speakers
    of spk_dict.pt; the registry resolves the folder to the family; every thinker parameter is in one of the
    family's parts and every part has parameters; one preprocessor_config.json names the stock processor class
    and serves its image processor and feature extractor, which match the thinker's config, and the
    tokenizer's audio and image tokens are the config's ids."""
    from transformers import AutoConfig, AutoFeatureExtractor, AutoImageProcessor, AutoTokenizer
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    from spindle.models.shared.moe_checkpoints import PER_EXPERT
    from spindle.registry import resolve_family

    stored = stored_tensors(path, ("",))
    roots = {p.rstrip(".") for p in (family.prefix, *family.untrained)}
    assert {k.split(".")[0] for k in stored} == roots, f"{family.name}: stored sub-models differ from {roots}"
    adapter = family.adapter()
    assert adapter is None or adapter.layout(path) == PER_EXPERT, f"{family.name}: the tiny's experts are fused"

    info = loading_info(family, path)
    assert not info["missing_keys"] and not info["unexpected_keys"], f"{family.name}: {info}"
    model = stock_full_model(family, path)
    assert model.has_talker, f"{family.name}: the stock full model has no talker"
    talker = {f"talker.{k}": v for k, v in model.talker.state_dict().items()}
    for key, value in talker.items():
        fused = _FUSED_EXPERTS.match(key)
        if key in stored or not fused:
            assert torch.equal(value, stored[key]), f"{family.name}: loaded {key}"
            continue
        n = value.shape[0]
        experts = [f"{fused['prefix']}.{j}" for j in range(n)]
        if fused["name"] == "down_proj":
            want = torch.stack([stored[f"{e}.down_proj.weight"] for e in experts])
        else:
            want = torch.stack(
                [torch.cat([stored[f"{e}.gate_proj.weight"], stored[f"{e}.up_proj.weight"]]) for e in experts]
            )
        assert value.abs().sum() > 0 and torch.equal(value, want), f"{family.name}: loaded {key}"
    check_speakers(family, model, path)

    assert resolve_family(path).name == family.name
    parts = {name: family.part_of(name) for name, _ in model.thinker.named_parameters()}
    assert None not in parts.values(), f"{family.name}: {[n for n, p in parts.items() if p is None][:3]} in no part"
    assert set(parts.values()) == set(family.parts), f"{family.name}: parts without parameters"

    config = model.config.thinker_config
    fields = json.loads((path / "preprocessor_config.json").read_text())
    model_type = AutoConfig.from_pretrained(path).model_type
    assert fields["processor_class"] == PROCESSOR_MAPPING_NAMES[model_type], family.name
    assert AutoImageProcessor.from_pretrained(path).merge_size == config.vision_config.spatial_merge_size
    assert AutoFeatureExtractor.from_pretrained(path).feature_size == config.audio_config.num_mel_bins
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.convert_tokens_to_ids(tok.audio_token) == config.audio_token_id, family.name
    assert tok.convert_tokens_to_ids(tok.image_token) == config.image_token_id, family.name
    assert tok.convert_tokens_to_ids(tok.audio_bos_token) == config.audio_start_token_id, family.name


# ---------------------------------------------------------------- training against the stock thinker


def check_step_one(family: OmniFamily, model_path: Path, data: Path, logged: dict[str, Any]) -> None:
    """Spindle's first step on the one audio conversation of `data` (unpacked) logs the stock thinker's loss
    (with the family's `stock_loss_kwargs`) and each declared stock output (1e-5) and the grad norm of its
    backward (1e-4): vlm_conformance.check_stock_step on the stock omni processor's inputs."""
    (inputs,) = stock_inputs(model_path, data, family)
    assert "input_features" in inputs, f"{family.name}: the step-1 conversation has no audio"
    vlm_suite.check_stock_step(family, stock_thinker(family, model_path), inputs, logged)


# ---------------------------------------------------------------- export


def check_export(
    family: OmniFamily, base: Path, run: Path, trained: dict[str, torch.Tensor], conversations: Path
) -> dict[str, torch.Tensor]:
    """The export of a run on `conversations` keeps the base folder's tensor names and dtypes (the thinker's
    experts in the input's layout) and every other file of it byte for byte, the untrained sub-models' tensors
    byte-identical; the stock full model loads it with no key missing, unexpected or mismatched, its thinker
    holding the trained weights (and changed from the base: for an MoE family its experts too) and the
    speakers, and answers the first conversation's audio clip (greedy text generation from the stock
    processor's prompt). -> the loaded thinker's state dict."""
    from spindle.data.audio import decode_audio
    from spindle.train.tasks import get_task

    export = run / "export"
    summary = json.loads((run / "summary.json").read_text())["start"]["data"]
    assert (summary["documents"], summary["images"], summary["audio_clips"], summary["skipped"]) == (4, 3, 2, 0)
    written, given = vlm_suite.safetensors_dtypes(export), vlm_suite.safetensors_dtypes(base)
    assert written.keys() == given.keys(), f"{family.name}: export keys differ: {sorted(written.keys() ^ given.keys())}"
    assert written == given, f"{family.name}: the export's dtypes differ from the input's"
    before = untrained_bytes(base, family.untrained)
    assert before and untrained_bytes(export, family.untrained) == before, f"{family.name}: untrained tensors"
    for file in base.iterdir():
        if file.suffix != ".safetensors" and file.name != "model.safetensors.index.json":
            assert (export / file.name).read_bytes() == file.read_bytes(), f"{family.name}: {file.name} changed"

    info = loading_info(family, export)
    model = stock_full_model(family, export)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), f"{family.name}: {info}"
    thinker = model.thinker.state_dict()
    assert thinker.keys() == trained.keys(), f"{family.name}: {sorted(thinker.keys() ^ trained.keys())}"
    for k, v in thinker.items():
        assert torch.equal(v, trained[k]), f"{family.name}: exported {k}"
    check_speakers(family, model, export)
    base_thinker = stock_thinker(family, base).state_dict()
    changed = [k for k, v in base_thinker.items() if not torch.equal(v, thinker[k])]
    assert changed, f"{family.name}: training changed nothing"
    if get_task(family.task).supports_expert_parallel(family):
        assert any("experts" in k for k in changed), f"{family.name}: the experts were not written back"

    stock = stock_processor(export)
    user = lines(conversations)[0]["messages"][0]  # an audio part and a question
    prompt = stock.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
    clip = decode_audio(conversations.parent / user["content"][0]["audio"], stock.feature_extractor.sampling_rate)
    inputs = dict(stock(text=[prompt], audio=[clip], return_tensors="pt"))
    out = model.generate(
        **inputs,
        generation_mode="text",
        thinker_eos_token_id=stock.tokenizer.eos_token_id,
        thinker_max_new_tokens=5,
        thinker_min_new_tokens=5,
        thinker_do_sample=False,
    )
    ids = inputs["input_ids"]
    assert out.shape == (1, ids.shape[1] + 5) and torch.equal(out[:, : ids.shape[1]], ids), family.name
    assert isinstance(stock.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)[0], str)
    return thinker


def check_cli_export(family: OmniFamily, base: Path, export: Path, cli: Path, thinker: dict[str, torch.Tensor]) -> None:
    """`spindle export` of the final checkpoint (written to `cli`) writes the same folder as the run's export:
    the same tensor names and dtypes, the untrained tensors byte-identical to the input's, and a thinker the
    stock full model loads with the export's weights (`thinker`, what check_export loaded)."""
    assert vlm_suite.safetensors_dtypes(cli) == vlm_suite.safetensors_dtypes(export), family.name
    assert untrained_bytes(cli, family.untrained) == untrained_bytes(base, family.untrained), family.name
    again = stock_full_model(family, cli).thinker.state_dict()
    assert again.keys() == thinker.keys() and all(torch.equal(again[k], thinker[k]) for k in thinker), family.name


# ---------------------------------------------------------------- parallel layouts equal one process


def check_same_run(family: OmniFamily, base: Path, a: Path, b: Path) -> None:
    """Run `b` (2 processes) logged the steps of REFERENCE_RUN and the same losses, grad norms, declared stock
    outputs (an MoE's aux loss) and expert loads as run `a` (one process; causal_lm_conformance.check_same_run),
    and exported the same thinker (WEIGHT_ATOL) under the input's thinker tensor names, with the untrained
    sub-models' tensors byte-identical to the input's."""
    from spindle.train.metrics import read_metrics

    steps = vlm_suite.REFERENCE_RUN["train__max_steps"]
    assert [m["step"] for m in read_metrics(b)] == list(range(1, steps + 1)), family.name
    lm_suite.check_same_run(family, a, b, weights=False)
    wa, wb = (stored_tensors(run / "export", (family.prefix,)) for run in (a, b))
    assert wa.keys() == wb.keys() == stored_tensors(base, (family.prefix,)).keys(), f"{family.name}: thinker keys"
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=0, atol=WEIGHT_ATOL, msg=k)
    assert untrained_bytes(b / "export", family.untrained) == untrained_bytes(base, family.untrained), family.name


def check_thinker_peft_export(family: OmniFamily, base: Path, data: Path, trainer: Any, lora: Path) -> None:
    """A LoRA-trained thinker's logits on `data`'s first conversation: changed from the base, and stock
    `PeftModel.from_pretrained(stock thinker, lora)` gives them (1e-5)."""
    from peft import PeftModel

    (inputs,) = stock_inputs(base, data, family)
    inputs.pop("labels")
    with torch.no_grad():
        ours = trainer.model.eval()(**inputs).logits
        thinker = stock_thinker(family, base).eval()
        assert (ours - thinker(**inputs).logits).abs().max() > 1e-4  # the adapters changed the thinker
        peft = PeftModel.from_pretrained(thinker, lora).eval()
        torch.testing.assert_close(peft(**inputs).logits, ours, rtol=0, atol=1e-5)
