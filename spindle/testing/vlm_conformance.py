"""The conformance suite's checks for VLM families: what every vision-language family must pass.

tests/conformance/test_vlm_conformance.py runs each check over every VLM family in the registry, so a new
family is tested by registering it. What a family declares for the suite is its `CausalLMConformanceSpec`
(a `VLMFamily` is a `CausalLMFamily`): the stock forward's loss arguments and the outputs its step metrics
equal (an MoE's `output_router_logits` and aux loss), and its 2-process layouts (plus ep2 where its task
supports expert parallelism).

The reference data is `vlm_conversations` (tests/conftest.py): image conversations, every 4th text-only.
Tolerances as the causal-LM suite's (spindle/testing/causal_lm_conformance.py): step-1 loss 1e-5 and grad
norm 1e-4 relative against stock transformers; exports equal the trained weights; layouts equal one process.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from spindle.contracts.family import VLMFamily
from spindle.testing.specs import lm_spec

RTOL, GRAD_RTOL = 1e-5, 1e-4
# the config fields naming media tokens (those a model has)
MEDIA_TOKEN_IDS = (
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
    "boi_token_id",
    "eoi_token_id",
)
SEQ = 96  # one conversation of the shared data is at most 80 tokens: nothing is cut
# The 2-process runs: 2 steps, global batch 2 in micro-batches of 1, one conversation per row, in the order
# of REFERENCE_LINES (image, text-only, image, text-only): with dp_shard=2 rank 1 only sees text-only rows.
REFERENCE_LINES = [0, 3, 1, 7]
REFERENCE_RUN: dict[str, Any] = {
    "train__max_steps": 2,
    "train__global_batch_size": 2,
    "data__packing": False,
    "checkpoint__export": True,
}
LAYOUTS: dict[str, dict[str, Any]] = {
    "dp_shard2_text_only_rank": {"parallel__dp_shard": 2},
    "sp2": {"parallel__sp": 2, "parallel__dp_shard": 1},
    "ep2": {"parallel__ep": 2},
}
# which declared causal-LM layout name is which VLM layout (CausalLMConformanceSpec.parallel)
DECLARED = {"dp_shard2": "dp_shard2_text_only_rank", "sp2": "sp2", "ep2": "ep2"}


def parallel_layouts(family: VLMFamily, declared: dict[str, str] = DECLARED) -> list[str]:
    """The 2-process layouts the suite checks for `family`: its declared ones, plus ep2 where its task
    supports expert parallelism; `declared` names the suite's layout for each declared name (the omni
    suite's ranks are audio-free rather than text-only)."""
    from spindle.train.tasks import get_task

    layouts = [declared[name] for name in lm_spec(family).parallel]
    if get_task(family.task).supports_expert_parallel(family) and declared["ep2"] not in layouts:
        layouts.append(declared["ep2"])
    return layouts


# ---------------------------------------------------------------- data


def subset(conversations: Path, out: Path, lines: list[int]) -> Path:
    """Some lines of a conversations file, media paths (image, video, audio parts) made absolute (the shared
    fixture is read-only)."""
    out.mkdir(parents=True, exist_ok=True)
    rows = conversations.read_text().splitlines()
    picked = []
    for i in lines:
        obj = json.loads(rows[i])
        for m in obj["messages"]:
            for part in m["content"] if isinstance(m["content"], list) else []:
                if part["type"] != "text":
                    part[part["type"]] = str(conversations.parent / part[part["type"]])
        picked.append(json.dumps(obj))
    path = out / "data.jsonl"
    path.write_text("\n".join(picked) + "\n")
    return path


def freeze_overrides(freeze: list[str]) -> dict[str, Any]:
    """The dotted overrides of a freeze check's run: two steps of two samples with `train.freeze`."""
    return {"train__max_steps": 2, "train__global_batch_size": 2, "train__freeze": json.dumps(freeze)}


def check_frozen_parts(family: VLMFamily, trainer: Any, before: dict, after: dict, trained: set[str]) -> None:
    """After a run with `train.freeze`, exactly the `trained` parts have optimizer state and changed weights
    (`before` / `after`: the stock model's state dicts of the input and the export)."""
    states = {n for n, p in trainer.model.named_parameters() if p in trainer.optimizer.state}
    assert {family.part_of(n) for n in states} == trained
    changed = {family.part_of(k) for k in before if not torch.equal(before[k], after[k])}
    assert changed == trained


def stock_processor(model: Path, video_processor: Any = None, **components: Any) -> Any:
    """transformers' processor of the model (its AutoProcessor class: Qwen2_5_VLProcessor, Qwen3VLProcessor,
    an omni model's) on the PIL image processor, plus `components` (an omni model's feature_extractor). Its
    constructor insists on a video processor of the class its auto mapping names, which needs torchvision (not
    installable here; the mapping names none): the class check is skipped for that argument only. With no
    `video_processor` only images are processed, the stock code path for images; `stock_video_inputs` gives
    it the stock video processor."""
    import transformers
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    stock_cls = getattr(transformers, PROCESSOR_MAPPING_NAMES[AutoConfig.from_pretrained(model).model_type])
    if "video_processor" not in stock_cls.get_attributes():  # an image-only processor (Gemma3Processor) loads as is
        assert video_processor is None and not components, f"{stock_cls.__name__} takes images only"
        return stock_cls.from_pretrained(model)

    class ImagesOnlyProcessor(stock_cls):  # type: ignore[valid-type,misc]  # a transformers class chosen at run time
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor":
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    tok = AutoTokenizer.from_pretrained(model)
    return ImagesOnlyProcessor(
        image_processor=AutoImageProcessor.from_pretrained(model),
        tokenizer=tok,
        video_processor=video_processor,
        chat_template=tok.chat_template,
        **components,
    )


@contextmanager
def torchvision_normalize() -> Iterator[None]:
    """transformers' torch image/video backend normalises with torchvision's `normalize` (`(x - mean) / std`
    per channel, mean and std shaped [C, 1, 1]); torchvision is not installable here, so that one function is
    provided while the stock video processor runs."""
    import types

    import transformers.image_processing_backends as backends

    def normalize(x: torch.Tensor, mean: Any, std: Any, inplace: bool = False) -> torch.Tensor:
        m, s = (torch.as_tensor(v, dtype=x.dtype, device=x.device).view(-1, 1, 1) for v in (mean, std))
        return (x - m) / s

    assert not hasattr(backends, "tvF"), "torchvision is installed: run the stock processor as it is"
    backends.tvF = types.SimpleNamespace(normalize=normalize)
    try:
        yield
    finally:
        del backends.tvF


def stock_video_processor(model_path: Path, max_frames: int) -> Any:
    """The checkpoint's stock video processor (its family's class: `Qwen3VLVideoProcessor` for Qwen3-VL, else
    `Qwen2VLVideoProcessor`) from its config, capped at `max_frames`."""
    from spindle.data.stock_video import Qwen2VLVideos
    from spindle.data.video_timestamps import TimestampedVideos
    from spindle.registry import resolve_family

    family = resolve_family(model_path)  # by config.json's model_type
    assert isinstance(family, VLMFamily)
    reader = TimestampedVideos if family.video_timestamps else Qwen2VLVideos
    return reader.processor_class().from_pretrained(model_path, max_frames=max_frames)


def stock_video_inputs(
    model_path: Path, messages: list[dict], base: Path, max_frames: int, fps: float = 2.0
) -> dict[str, Any]:
    """A conversation with video parts as the checkpoint's stock processor (`Qwen2_5_VLProcessor`,
    `Qwen3VLProcessor`) takes it, with its stock video processor (`stock_video_processor`, capped at
    `max_frames`): the frames decoded by transformers' own PyAV reader and sampled by the processor
    (`sample_frames` at `fps` on the video metadata), the text expanded by its `replace_video_token` (Qwen3-VL:
    timestamps); -> input_ids, pixel_values_videos, video_grid_thw, mm_token_type_ids (and Qwen2.5-VL's
    second_per_grid_ts). What needs torchvision is left out: RGB conversion (PyAV gives RGB) and the resize, so
    each video must already be at the size stock resizes it to (asserted with stock's own
    `get_num_of_video_patches`)."""
    import numpy as np
    from transformers.video_utils import load_video

    video_processor = stock_video_processor(model_path, max_frames)
    stock = stock_processor(model_path, video_processor)
    paths = [
        base / p["video"] for m in messages if isinstance(m["content"], list) for p in m["content"] if "video" in p
    ]
    videos, metadata = [], []
    for path in paths:
        frames, meta = load_video(
            str(path), sample_indices_fn=lambda metadata, **_: np.arange(metadata.total_num_frames)
        )
        videos.append(frames)
        metadata.append(meta)
    text = stock.apply_chat_template(messages, tokenize=False)
    with torchvision_normalize():
        inputs = dict(
            stock(
                text=[text],
                videos=videos,
                video_metadata=metadata,
                do_resize=False,
                do_convert_rgb=False,
                cap_pixels_per_frame=False,
                do_sample_frames=True,
                fps=fps,
                return_tensors="pt",
            )
        )
    inputs.pop("attention_mask")
    for (frames, meta), grid in zip(zip(videos, metadata, strict=True), inputs["video_grid_thw"], strict=True):
        h, w = frames.shape[1:3]
        sampled = len(video_processor.sample_frames(copy.deepcopy(meta), fps=fps))  # the frames the processor took
        assert video_processor.get_num_of_video_patches(sampled, h, w, {}) == int(grid.prod()), "stock would resize"
    return inputs


def stock_inputs(model_path: Path, data: Path) -> list[dict[str, Any]]:
    """Each conversation of `data` (either format) as stock transformers takes it: the stock processor's
    input_ids, pixel_values, image_grid_thw (or a Qwen3-VL line's video inputs, `stock_video_inputs`),
    mm_token_type_ids (asserted equal to Spindle's tokens), and labels = the assistant tokens (-100
    elsewhere; the model shifts them)."""
    from PIL import Image
    from transformers import AutoConfig

    from spindle.data.multimodal import (
        VisionOptions,
        VisionProcessor,
        conversation_document,
        media_parts,
        normalise_conversation,
    )
    from spindle.registry import resolve_family

    stock = stock_processor(model_path)
    config = AutoConfig.from_pretrained(model_path)
    family = resolve_family(model_path)  # by config.json's model_type
    assert isinstance(family, VLMFamily)
    options = VisionOptions()
    ours = VisionProcessor(
        model_path,
        stock.tokenizer,
        config,
        family.rope_index_fn(),
        options,
        video_timestamps=family.video_timestamps,
        video_grid_seconds=family.video_grid_seconds,
        images=family.image_layout(),
    )
    out = []
    for line in data.read_text().splitlines():
        obj = json.loads(line)
        doc, _ = conversation_document(obj, data.parent, ours, 4096, "x")
        messages = normalise_conversation(obj)
        kinds = {kind for kind, _ in media_parts(messages)}
        if "video" in kinds:
            assert kinds == {"video"}, "the stock reference of a line with videos takes no images"
            inputs = stock_video_inputs(model_path, messages, data.parent, options.max_frames, options.fps)
        else:
            text = stock.apply_chat_template(messages, tokenize=False)
            paths = [path for _, path in media_parts(messages)]
            images = [Image.open(data.parent / p).convert("RGB") for p in paths] or None
            # the template wrote the BOS (Gemma's) already, as the stock processor's own chat path takes it
            inputs = dict(stock(text=[text], images=images, return_tensors="pt", add_special_tokens=False))
            inputs.pop("attention_mask")
        assert inputs["input_ids"][0].tolist() == doc.tokens, f"{family.name}: Spindle's tokens differ from stock's"
        labels = [t if keep else -100 for t, keep in zip(doc.tokens, doc.learn, strict=True)]
        inputs["labels"] = torch.tensor([labels])
        out.append(inputs)
    return out


def stock_model(path: Path) -> Any:
    """Stock transformers' fp32 model of a VLM folder, in training mode (as Spindle's first step runs)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    return model


def grad_norm(model: Any) -> float:
    return float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]))


# ---------------------------------------------------------------- the tiny checkpoint


def check_stock_load(family: VLMFamily, path: Path) -> Any:
    """The tiny checkpoint is a standard transformers folder: AutoModelForImageTextToText loads stock
    transformers' class of the name the family trains, the tokenizer holds its special tokens (one token
    each), among them the media tokens the config names, byte-level BPE round-trips any text, the image
    processor loads without torchvision and matches the vision config; every parameter belongs to one of the
    family's parts (what `train.freeze` names), and every part has parameters. -> the model."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(path)
    expected = family.model_cls().__name__
    assert type(model).__name__ == expected and type(model).__module__.startswith("transformers."), (
        f"{family.name}: stock transformers loads {type(model).__module__}.{type(model).__name__}, not {expected}"
    )
    tok = AutoTokenizer.from_pretrained(path)
    config = model.config
    # the media tokens the config names are special tokens of the tokenizer
    media_ids = [getattr(config, name, None) for name in MEDIA_TOKEN_IDS]
    media = [tok.convert_ids_to_tokens(i) for i in media_ids if i is not None]
    specials = sorted(t.content for t in tok.added_tokens_decoder.values() if t.special)
    assert config.image_token_id is not None and set(media) <= set(specials), f"{family.name}: {media}"
    for token in specials:  # each encodes as one token
        ids = tok(token, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and tok.convert_ids_to_tokens(ids[0]) == token, f"{family.name}: {token}"
    text = "Ünïcode & emoji 🙂 survive"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    processor = AutoImageProcessor.from_pretrained(path)  # the PIL backend: no torchvision
    vision = config.vision_config
    if hasattr(vision, "spatial_merge_size"):  # a patch-grid tower (Qwen-VL's)
        assert processor.merge_size == vision.spatial_merge_size
        assert processor.patch_size == vision.patch_size
    else:  # a fixed-size tower (Gemma 3's SigLIP): every image resized to its size
        assert processor.size == {"height": vision.image_size, "width": vision.image_size}
    parts = {name: family.part_of(name) for name, _ in model.named_parameters()}
    assert None not in parts.values(), f"{family.name}: {[n for n, p in parts.items() if p is None][:3]} in no part"
    assert set(parts.values()) == set(family.parts), f"{family.name}: parts without parameters"
    return model


# ---------------------------------------------------------------- training against stock


def check_step_one(family: VLMFamily, model_path: Path, data: Path, logged: dict[str, Any], model: Any = None) -> None:
    """Spindle's first step on the one conversation of `data` (unpacked, padded to SEQ) logs stock
    transformers' `model(input_ids, pixel_values, image_grid_thw, labels, **stock_loss_kwargs)` loss (1e-5),
    the grad norm of its backward (1e-4) and each declared stock output (1e-5). `model`: the stock model to
    compare with (a stock PEFT model of a LoRA run; default: `stock_model(model_path)`)."""
    (inputs,) = stock_inputs(model_path, data)
    assert "pixel_values" in inputs, f"{family.name}: the step-1 conversation has no image"
    check_stock_step(family, stock_model(model_path) if model is None else model, inputs, logged)


def check_stock_step(family: VLMFamily, model: Any, inputs: dict[str, Any], logged: dict[str, Any]) -> None:
    """Spindle's logged first step equals the stock `model`'s forward on `inputs` (with the family's
    `stock_loss_kwargs`): loss and each declared stock output 1e-5, the grad norm of its backward 1e-4."""
    import pytest

    out = model(**inputs, **lm_spec(family).stock_loss_kwargs)
    out.loss.backward()
    outputs = {name: float(getattr(out, name).detach()) for name in lm_spec(family).stock_outputs}
    want = {"loss": float(out.loss.detach()), **outputs}
    got = {k: logged[k] for k in want}
    assert got == pytest.approx(want, rel=RTOL), f"{family.name}: Spindle's step 1 {got} != stock {want}"
    assert logged["grad_norm"] == pytest.approx(grad_norm(model), rel=GRAD_RTOL), family.name


def stock_token_loss_sum(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    """Stock transformers' summed next-token loss of one conversation (mean loss x its learned tokens)."""
    n = int((inputs["labels"][:, 1:] != -100).sum())
    loss: torch.Tensor = model(**inputs).loss * n
    return loss


def router_aux_term(trainer: Any, out: Any, tokens: int) -> torch.Tensor:
    """What an MoE task adds to a micro-batch's summed token loss (`router_aux_loss_coef x aux x tokens`,
    spindle/models/shared/causal_lm_patch.py; its aux loss is checked against stock's at step 1); 0 for a
    dense family. A one-process, one-micro-batch step logs the aux loss undivided."""
    aux = out.metrics.get("aux_loss")
    if aux is None:
        return torch.zeros(())
    aux = getattr(aux, "value", aux)  # a Metric (its reduction declared) or a plain value
    coef = trainer.model.config.get_text_config().router_aux_loss_coef
    return torch.tensor(coef * aux * tokens)


# ---------------------------------------------------------------- export


def with_dtype(src: Path, out: Path, dtype: torch.dtype) -> Path:
    """A copy of checkpoint folder `src` with its floating-point weights (and config dtype) in `dtype`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    for shard in out.glob("*.safetensors"):
        weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in load_file(shard).items()}
        save_file(weights, shard, metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def safetensors_dtypes(folder: Path) -> dict[str, torch.dtype]:
    from safetensors import safe_open

    found: dict[str, torch.dtype] = {}
    for shard in folder.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            found.update({k: f.get_slice(k).get_dtype() for k in f.keys()})
    return found


def check_export(family: VLMFamily, base: Path, export: Path, trained: dict[str, torch.Tensor], image: Path) -> None:
    """The export holds the base checkpoint's tensor names and dtypes (its layout and precision), loads in
    stock AutoModelForImageTextToText with every tensor equal to the trained one in that precision (and
    different from the base's), carries the image processor, and generates a reply to an image."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    written, given = safetensors_dtypes(export), safetensors_dtypes(base)
    assert written.keys() == given.keys(), f"{family.name}: export keys differ: {sorted(written.keys() ^ given.keys())}"
    dtypes = {str(v).removeprefix("torch.") for v in given.values()}
    assert written == given, f"{family.name}: the export's dtypes differ from the input's ({dtypes})"
    model = AutoModelForImageTextToText.from_pretrained(export, dtype="auto")
    loaded = model.state_dict()
    assert loaded.keys() == trained.keys(), f"{family.name}: {sorted(loaded.keys() ^ trained.keys())}"
    for key, value in trained.items():
        assert torch.equal(loaded[key], value.detach().to(loaded[key].dtype)), f"{family.name}: exported {key}"
    base_state = AutoModelForImageTextToText.from_pretrained(base, dtype="auto").state_dict()
    assert any(not torch.equal(base_state[k], loaded[k]) for k in loaded), f"{family.name}: training changed nothing"

    # the export's own processor files, through the stock processor (the image tokens expanded as it does)
    stock = stock_processor(export)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}]
    text = stock.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = stock(
        text=[text], images=[Image.open(image).convert("RGB")], return_tensors="pt", add_special_tokens=False
    )
    ids = inputs["input_ids"]
    assert int((ids == model.config.image_token_id).sum()) > 0, f"{family.name}: no image tokens"
    inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
    out = model.generate(**inputs, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert out.shape == (1, ids.shape[1] + 5) and torch.equal(out[:, : ids.shape[1]], ids), family.name
