"""Image/video conversations -> VLM rows (spindle.data.multimodal): the same tokens, pixels and 3-D
positions as the stock processor and model of every VLM family (Gemma 3: its fixed-size images and 1-D
positions), assistant-only labels, packing, bad samples."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from spindle.data.multimodal import (
    VisionOptions,
    VisionProcessor,
    build_conversation_dataset,
    collate_conversations,
    conversation_document,
)
from spindle.data.text import IGNORE_INDEX, TextDataError
from spindle.registry import all_families
from spindle.testing.vlm_conformance import stock_processor

SEQ = 256


@pytest.fixture(scope="module")
def parts(tiny_qwen2_5_vl):
    from transformers import AutoConfig, AutoTokenizer

    from spindle.registry import get_family

    tok = AutoTokenizer.from_pretrained(tiny_qwen2_5_vl)
    config = AutoConfig.from_pretrained(tiny_qwen2_5_vl)
    family = get_family("qwen2_5_vl")
    return tok, config, family


def make_processor(model: Path, parts, **options) -> VisionProcessor:
    tok, config, family = parts
    return VisionProcessor(model, tok, config, family.rope_index_fn(), VisionOptions(**options))


def image(path: Path, size: tuple[int, int], seed: int) -> Path:
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(path)
    return path


def two_image_conversation(folder: Path) -> dict:
    image(folder / "a.png", (60, 90), 1)
    image(folder / "b.png", (120, 70), 2)
    return {
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": "a.png"},
                    {"type": "text", "text": "What colour is the shape?"},
                    {"type": "image", "image": "b.png"},
                ],
            },
            {"role": "assistant", "content": "The red circle."},
            {"role": "user", "content": "Which way does it move?"},
            {"role": "assistant", "content": "To the right."},
        ]
    }


@pytest.mark.parametrize("family", sorted(f.name for f in all_families() if f.kind == "vlm"))
def test_tokens_pixels_and_positions_equal_the_stock_processor_and_model(family, tiny_checkpoint, tmp_path):
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

    from spindle.registry import get_family

    model_path = tiny_checkpoint(family)
    obj = two_image_conversation(tmp_path)
    config = AutoConfig.from_pretrained(model_path)
    fam = get_family(family)
    tok = AutoTokenizer.from_pretrained(model_path)
    processor = VisionProcessor(
        model_path, tok, config, fam.rope_index_fn(), VisionOptions(), images=fam.image_layout()
    )
    doc, cut = conversation_document(obj, tmp_path, processor, 4096, "x:1")
    assert not cut

    stock = stock_processor(model_path)
    text = stock.apply_chat_template(obj["messages"], tokenize=False)
    images = [Image.open(tmp_path / n).convert("RGB") for n in ("a.png", "b.png")]
    ref = stock(text=[text], images=images, return_tensors="pt", add_special_tokens=False)  # the template's BOS
    assert doc.tokens == ref["input_ids"][0].tolist()
    torch.testing.assert_close(torch.cat([v.pixel_values for v in doc.vision]), ref["pixel_values"], rtol=0, atol=0)
    if "image_grid_thw" not in ref:  # a fixed-size tower (Gemma 3): 1-D positions, no multimodal RoPE rows
        assert ref["pixel_values"].shape[0] == 2 and doc.positions.shape == (0, len(doc.tokens))
        assert processor.media_ids == {config.image_token_id}
        assert sum(t in processor.media_ids for t in doc.tokens) == int(ref["token_type_ids"].sum())
        return
    assert torch.equal(torch.stack([v.grid_thw for v in doc.vision]), ref["image_grid_thw"])
    assert len({tuple(v.grid_thw.tolist()) for v in doc.vision}) == 2  # two sizes, each capped by max_pixels

    model = AutoModelForImageTextToText.from_pretrained(model_path)
    positions, _ = model.model.get_rope_index(
        ref["input_ids"], mm_token_type_ids=ref["mm_token_type_ids"], image_grid_thw=ref["image_grid_thw"]
    )
    assert torch.equal(doc.positions, positions[:, 0])


def test_min_and_max_pixels_set_the_image_size(tiny_qwen2_5_vl, parts, tmp_path):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    obj = two_image_conversation(tmp_path)
    for lo, hi in ((28 * 28, 112 * 112), (112 * 112, 168 * 168)):
        processor = make_processor(tiny_qwen2_5_vl, parts, min_pixels=lo, max_pixels=hi)
        doc, _ = conversation_document(obj, tmp_path, processor, 4096, "x:1")
        want = [[1, *(d // 14 for d in smart_resize(h, w, 28, lo, hi))] for h, w in ((60, 90), (120, 70))]
        assert [v.grid_thw.tolist() for v in doc.vision] == want
    assert want != [[1, 2, 4], [1, 4, 2]]  # the tiny model's own max_pixels would give these


def test_only_assistant_turns_are_learned(tiny_qwen2_5_vl, parts, tmp_path):
    tok = parts[0]
    obj = two_image_conversation(tmp_path)
    doc, _ = conversation_document(obj, tmp_path, make_processor(tiny_qwen2_5_vl, parts), 4096, "x:1")
    learned = tok.decode([t for t, keep in zip(doc.tokens, doc.learn, strict=True) if keep])
    assert learned == "The red circle.<|im_end|>\nTo the right.<|im_end|>\n"


def test_sharegpt_format_gives_the_same_document(tiny_qwen2_5_vl, parts, tmp_path):
    obj = two_image_conversation(tmp_path)
    sharegpt = {
        "images": ["a.png", "b.png"],
        "conversations": [
            {"from": "system", "value": "You are a helpful assistant."},
            {"from": "human", "value": "<image>What colour is the shape?<image>"},
            {"from": "gpt", "value": "The red circle."},
            {"from": "human", "value": "Which way does it move?"},
            {"from": "gpt", "value": "To the right."},
        ],
    }
    processor = make_processor(tiny_qwen2_5_vl, parts)
    a, _ = conversation_document(obj, tmp_path, processor, 4096, "x:1")
    b, _ = conversation_document(sharegpt, tmp_path, processor, 4096, "x:2")
    assert a.tokens == b.tokens and a.learn == b.learn and torch.equal(a.positions, b.positions)


def test_openai_image_url_parts_give_the_same_document(tiny_qwen2_5_vl, parts, tmp_path):
    """OpenAI's chat content parts: a base64 data URL and a local file (`file://`, absolute) read as the same
    images as `{"type": "image"}` parts; an http(s) URL is refused, never fetched."""
    import base64

    obj = two_image_conversation(tmp_path)
    data_url = "data:image/png;base64," + base64.b64encode((tmp_path / "a.png").read_bytes()).decode()
    openai_obj = json.loads(json.dumps(obj))
    openai_obj["messages"][1]["content"][0] = {"type": "image_url", "image_url": {"url": data_url}}
    openai_obj["messages"][1]["content"][2] = {"type": "image_url", "image_url": {"url": f"file://{tmp_path}/b.png"}}
    processor = make_processor(tiny_qwen2_5_vl, parts)
    a, _ = conversation_document(obj, tmp_path, processor, 4096, "x:1")
    b, _ = conversation_document(openai_obj, tmp_path, processor, 4096, "x:2")
    assert a.tokens == b.tokens and a.learn == b.learn and torch.equal(a.positions, b.positions)
    for x, y in zip(a.vision, b.vision, strict=True):
        assert torch.equal(x.pixel_values, y.pixel_values)
    openai_obj["messages"][1]["content"][0] = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    with pytest.raises(ValueError, match="not fetched"):
        conversation_document(openai_obj, tmp_path, processor, 4096, "x:3")


def test_packed_rows_restart_positions_per_document(tiny_qwen2_5_vl, parts, vlm_conversations):
    processor = make_processor(tiny_qwen2_5_vl, parts)
    packed = build_conversation_dataset(vlm_conversations, processor, SEQ, packing=True)
    single = build_conversation_dataset(vlm_conversations, processor, SEQ, packing=False)
    assert single.stats.rows == single.stats.documents == 8 and packed.stats.rows < 8
    assert packed.stats.images == 6 and packed.stats.label_tokens == single.stats.label_tokens
    batch = collate_conversations([packed[0]])
    pos = batch["position_ids"][:, 0]  # [4, SEQ]
    starts = (pos[0] == 0).nonzero().flatten().tolist()
    assert len(starts) > 1  # several documents, each from text position 0
    ids = batch["input_ids"][0]
    n_pad = int((ids == processor.config.image_token_id).sum())
    assert n_pad == sum(int(g.prod()) // 4 for g in batch["image_grid_thw"])
    assert batch["pixel_values"].shape[0] == int(batch["image_grid_thw"].prod(-1).sum())
    # the documents' 3-D positions are each its own rope_index, concatenated
    for row_doc, start in zip(range(len(starts)), starts, strict=True):
        end = starts[row_doc + 1] if row_doc + 1 < len(starts) else int(batch["attention_mask"][0].sum())
        assert pos[1:, start].tolist() == [0, 0, 0] and end > start
    assert batch["shift_labels"][0, int(batch["attention_mask"][0].sum()) - 1] == IGNORE_INDEX


def test_micro_batch_is_padded_to_its_longest_conversation_a_multiple_of_sp(tiny_qwen2_5_vl, parts, vlm_conversations):
    # a transformers loop pads a batch to its longest conversation; Spindle too, rounded up to the SP degree (each
    # SP rank an equal chunk), not to data.seq_len: only padding is cut (never learned, after the real tokens)
    processor = make_processor(tiny_qwen2_5_vl, parts)
    single = build_conversation_dataset(vlm_conversations, processor, SEQ, packing=False)
    rows = [single[i] for i in range(3)]
    whole = collate_conversations(rows)  # multiple 1: the longest conversation itself
    longest = max(int(r["attention_mask"].sum()) for r in rows)
    assert whole["input_ids"].shape == (3, longest) and longest < SEQ and longest % 6 != 0
    for sp in (2, 3):
        batch = collate_conversations(rows, multiple=sp)
        width = -(-longest // sp) * sp
        assert batch["input_ids"].shape == (3, width) and batch["position_ids"].shape == (4, 3, width)
        for key in ("input_ids", "shift_labels", "attention_mask"):
            assert torch.equal(batch[key], torch.stack([r[key] for r in rows])[:, :width])
        assert torch.equal(batch["position_ids"], torch.stack([r["position_ids"] for r in rows], dim=1)[..., :width])
        assert torch.equal(batch["pixel_values"], whole["pixel_values"])


def write_lines(folder: Path, *objs) -> Path:
    path = folder / "bad.jsonl"
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))
    return path


GOOD = {
    "messages": [
        {"role": "user", "content": [{"type": "image", "image": "ok.png"}, {"type": "text", "text": "What?"}]},
        {"role": "assistant", "content": "A square."},
    ]
}


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "image": "nope.png"}]}, GOOD["messages"][1]]},
            "image .*nope.png not found",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image", "image": "broken.png"}]},
                    GOOD["messages"][1],
                ]
            },
            "image .*broken.png cannot be decoded",
        ),
        (
            {
                "images": ["ok.png"],
                "conversations": [{"from": "human", "value": "<image><image>"}, {"from": "gpt", "value": "x"}],
            },
            "more <image> placeholders than image files",
        ),
        (
            {
                "images": ["ok.png", "ok.png"],
                "conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "x"}],
            },
            "1 image.* listed but never placed",
        ),
        ({"messages": [{"role": "user", "content": "hi"}]}, "the conversation has no assistant turn"),
    ],
    ids=["missing", "undecodable", "more_placeholders", "unplaced", "no_assistant"],
)
def test_bad_samples_are_file_line_errors_or_counted_skips(tiny_qwen2_5_vl, parts, tmp_path, line, message):
    image(tmp_path / "ok.png", (56, 56), 0)
    (tmp_path / "broken.png").write_bytes(b"not a png")
    path = write_lines(tmp_path, GOOD, line)
    processor = make_processor(tiny_qwen2_5_vl, parts)
    with pytest.raises(TextDataError, match=rf"bad.jsonl:2: {message}.*skip_bad_samples"):
        build_conversation_dataset(path, processor, SEQ)
    data = build_conversation_dataset(path, processor, SEQ, skip_bad_samples=True)
    assert data.stats.skipped == 1 and data.stats.documents == 1


def test_a_conversation_longer_than_seq_len_may_lose_text_but_never_vision_tokens(tiny_qwen2_5_vl, parts, tmp_path):
    image(tmp_path / "ok.png", (56, 56), 0)
    long_answer = {"messages": [GOOD["messages"][0], {"role": "assistant", "content": "A square. " * 40}]}
    image_late = {
        "messages": [
            {"role": "user", "content": "word " * 60},
            {"role": "assistant", "content": "Yes."},
            {"role": "user", "content": [{"type": "image", "image": "ok.png"}]},
            {"role": "assistant", "content": "A square."},
        ]
    }
    processor = make_processor(tiny_qwen2_5_vl, parts)
    data = build_conversation_dataset(write_lines(tmp_path, long_answer), processor, 64)
    assert data.stats.truncated == 1 and data[0]["input_ids"].shape == (64,)
    with pytest.raises(
        TextDataError, match=r"bad.jsonl:1: .*longer than data.seq_len=64.*cut image/video/audio tokens"
    ):
        build_conversation_dataset(write_lines(tmp_path, image_late), processor, 64)


def test_video_patches_of_a_still_equal_the_image_processor(tiny_qwen2_5_vl, parts, tmp_path):
    """The stock video processor needs torchvision; its patch layout is reproduced from the image processor.
    A still repeated over the temporal patch is exactly what the image processor patches an image as."""
    from spindle.data.video_patches import frame_patches

    processor = make_processor(tiny_qwen2_5_vl, parts)
    still = Image.open(image(tmp_path / "s.png", (60, 90), 3)).convert("RGB")
    ref = processor.image_processor(images=[still], return_tensors="pt")
    pixels, grid = frame_patches([still, still], processor.image_processor)
    assert grid.tolist() == ref["image_grid_thw"][0].tolist()
    torch.testing.assert_close(pixels, ref["pixel_values"], rtol=0, atol=0)
    # an odd frame count repeats the last frame (as the stock processor pads the temporal axis)
    other = Image.open(image(tmp_path / "o.png", (60, 90), 4)).convert("RGB")
    pixels3, grid3 = frame_patches([other, still, still], processor.image_processor)
    assert grid3.tolist() == [2, *grid.tolist()[1:]]
    torch.testing.assert_close(pixels3[pixels.shape[0] :], ref["pixel_values"], rtol=0, atol=0)


def test_video_conversation_samples_frames_by_fps_and_positions_follow_time(tiny_qwen2_5_vl, parts, tmp_path):
    from spindle.data.media import write_video

    frames = np.stack([np.full((56, 56, 3), 20 * i, dtype=np.uint8) for i in range(12)])
    write_video(tmp_path / "clip.mp4", frames, fps=4)
    obj = {
        "messages": [
            {"role": "user", "content": [{"type": "video", "video": "clip.mp4"}, {"type": "text", "text": "What?"}]},
            {"role": "assistant", "content": "It gets brighter."},
        ]
    }
    processor = make_processor(tiny_qwen2_5_vl, parts, fps=2.0, max_frames=16)
    doc, _ = conversation_document(obj, tmp_path, processor, 4096, "x:1")
    (video,) = doc.vision
    # 12 frames at 4 fps = 3 s; 2 fps -> 6 frames -> 3 temporal patches of 2 frames
    assert video.kind == "video" and video.grid_thw.tolist() == [3, 4, 4]
    assert video.second_per_grid == pytest.approx(1.0)  # 2 frames per patch at 2 sampled fps
    n = int(video.grid_thw.prod()) // 4
    assert sum(t == processor.config.video_token_id for t in doc.tokens) == n
    vid = torch.tensor([t == processor.config.video_token_id for t in doc.tokens])
    t_pos = doc.positions[0, vid]
    # temporal positions step by tokens_per_second * seconds per grid (the model's rule): 2 per patch here
    assert sorted(set((t_pos - t_pos.min()).tolist())) == [0, 2, 4]
