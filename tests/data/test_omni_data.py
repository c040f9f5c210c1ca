"""Audio conversations -> omni rows (spindle.data.multimodal + spindle.data.audio): the same tokens, audio
features, feature masks and lengths as the stock Qwen2.5-Omni processor, the same 3-D positions as the
stock thinker computes (audio spans, an image before a clip), every audio format PyAV decodes, resampling
to the extractor's rate, and bad audio as a `file:line` error or a counted skip."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from spindle.data.audio import decode_audio, write_audio
from spindle.data.multimodal import (
    VisionOptions,
    VisionProcessor,
    build_conversation_dataset,
    collate_vision,
    conversation_document,
)
from spindle.data.text import TextDataError
from spindle.registry import get_family
from spindle.testing.omni_conformance import lines, omni_processor, stock_call, stock_processor, video_with_audio


@pytest.fixture(scope="module")
def stock_thinker(tiny_qwen2_5_omni):
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    return Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(tiny_qwen2_5_omni)


@pytest.mark.parametrize("line", [0, 1, 2], ids=["audio", "image", "image_then_audio"])
def test_tokens_features_and_positions_equal_the_stock_processor_and_thinker(
    line, tiny_qwen2_5_omni, omni_conversations, stock_thinker
):
    obj = lines(omni_conversations)[line]
    doc, cut = conversation_document(
        obj, omni_conversations.parent, omni_processor(tiny_qwen2_5_omni, get_family("qwen2_5_omni")), 4096, "x"
    )
    assert not cut
    stock = stock_call(stock_processor(tiny_qwen2_5_omni), obj, omni_conversations.parent)
    assert stock["input_ids"][0].tolist() == doc.tokens

    ours = collate_vision(doc.vision)
    if "input_features" in stock:  # the real frames, the mask and so the lengths, exactly
        mask = stock["feature_attention_mask"].bool()
        assert torch.equal(ours["feature_attention_mask"].sum(-1), mask.sum(-1))
        assert torch.equal(
            ours["input_features"].permute(0, 2, 1)[ours["feature_attention_mask"].bool()],
            stock["input_features"].permute(0, 2, 1)[mask],
        )
    else:
        assert "input_features" not in ours
    for key in ("pixel_values", "image_grid_thw"):
        assert (key in ours) == (key in stock) and (key not in ours or torch.equal(ours[key], stock[key]))

    lengths = stock["feature_attention_mask"].sum(-1) if "feature_attention_mask" in stock else None
    positions, _ = stock_thinker.model.get_rope_index(
        stock["input_ids"], stock.get("image_grid_thw"), None, stock["attention_mask"], False, lengths
    )
    assert torch.equal(doc.positions, positions[:, 0])


def test_video_tokens_pixels_seconds_and_positions_equal_the_stock_processor_and_thinker(
    tiny_qwen2_5_omni, stock_thinker, tmp_path
):
    """A video through stock Qwen2_5OmniProcessor with its Qwen2VLVideoProcessor (read from
    preprocessor_config.json, as the published checkpoint has no video config; run on frames at its size, the
    one torchvision call provided): 7 frames at 8 fps, raised to min_frames=4 (sampled at 4/7 x 8 fps), whose
    seconds per grid are the omni processor's temporal patch / the requested fps (1.0), not Qwen2.5-VL's sampled
    rate (0.4375): tokens, pixels, grid, seconds per grid and the stock thinker's positions."""
    from transformers.video_utils import load_video

    from spindle.testing.vlm_conformance import stock_video_processor, torchvision_normalize
    from tests.data.test_qwen3_vl_videos import noise_video

    noise_video(tmp_path / "v.mp4", 7, 28, 56, fps=8, seed=2)
    user = [{"type": "video", "video": "v.mp4"}, {"type": "text", "text": "What?"}]
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": "Noise."}]
    doc, _ = conversation_document(
        {"messages": messages}, tmp_path, omni_processor(tiny_qwen2_5_omni, get_family("qwen2_5_omni")), 4096, "x"
    )
    ours = collate_vision(doc.vision)

    stock = stock_processor(tiny_qwen2_5_omni, video_processor=stock_video_processor(tiny_qwen2_5_omni, 16))
    frames, meta = load_video(str(tmp_path / "v.mp4"), sample_indices_fn=lambda metadata, **_: np.arange(7))
    text = stock.apply_chat_template(messages, tokenize=False)
    with torchvision_normalize():
        out = stock(
            text=[text],
            videos=[frames],
            video_metadata=[meta],
            do_resize=False,
            do_convert_rgb=False,
            cap_pixels_per_frame=False,
            do_sample_frames=True,
            fps=2.0,
            return_tensors="pt",
        )
    assert out["input_ids"][0].tolist() == doc.tokens
    assert ours["video_grid_thw"].tolist() == out["video_grid_thw"].tolist() == [[2, 2, 4]]
    assert ours["second_per_grid_ts"].tolist() == out["video_second_per_grid"].tolist() == [1.0]
    torch.testing.assert_close(ours["pixel_values_videos"], out["pixel_values_videos"], rtol=0, atol=1e-6)
    positions, _ = stock_thinker.model.get_rope_index(
        out["input_ids"], None, out["video_grid_thw"], out["attention_mask"], False, None, out["video_second_per_grid"]
    )
    assert torch.equal(doc.positions, positions[:, 0])


def test_formats_and_sampling_rates_decode_to_the_extractors_rate(tmp_path):
    """wav/flac are lossless: the same samples; m4a (AAC) decodes to the clip's length at the extractor's rate;
    a 22.05 kHz clip is resampled to 16 kHz (its length scaled, its tone kept)."""
    t = np.arange(8000) / 16000
    wave = 0.5 * np.sin(2 * np.pi * 440 * t)
    wav = decode_audio(write_audio(tmp_path / "a.wav", wave, 16000), 16000)
    flac = decode_audio(write_audio(tmp_path / "a.flac", wave, 16000), 16000)
    assert wav.shape == (8000,) and np.array_equal(wav, flac)
    assert np.abs(wav - wave).max() < 1e-4  # 16-bit quantisation only
    m4a = decode_audio(write_audio(tmp_path / "a.m4a", wave, 16000), 16000)
    assert abs(m4a.size - 8000) <= 2048  # the AAC encoder's priming/padding frames
    t22 = np.arange(22050) / 22050
    resampled = decode_audio(write_audio(tmp_path / "b.wav", 0.5 * np.sin(2 * np.pi * 440 * t22), 22050), 16000)
    assert abs(resampled.size - 16000) <= 32
    spectrum = np.abs(np.fft.rfft(resampled[:16000]))
    assert abs(int(spectrum.argmax()) * 16000 / 16000 - 440) <= 2


def test_bad_audio_is_a_file_line_error_or_a_counted_skip(tiny_qwen2_5_omni, tmp_path):
    (tmp_path / "empty.wav").write_bytes(b"")
    (tmp_path / "text.mp3").write_text("not audio")
    write_audio(tmp_path / "long.wav", np.zeros(16000 * 11), 16000)  # the tiny extractor's window is 10 s
    write_audio(tmp_path / "ok.wav", 0.1 * np.ones(4000), 16000)

    def conversation(name: str) -> str:
        user = [{"type": "audio", "audio": name}, {"type": "text", "text": "What?"}]
        return json.dumps({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": "A."}]})

    names = ["empty.wav", "text.mp3", "gone.wav", "long.wav", "ok.wav"]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(conversation(n) + "\n" for n in names))
    processor = omni_processor(tiny_qwen2_5_omni, get_family("qwen2_5_omni"))
    with pytest.raises(TextDataError, match=rf"{data}:1: audio .*empty.wav cannot be decoded"):
        build_conversation_dataset(data, processor, 256)
    expected = {2: "cannot be decoded", 3: "gone.wav not found", 4: r"11.00 s long, more than .* 10 s window"}
    for number, message in expected.items():
        data.write_text(conversation(names[number - 1]) + "\n")
        with pytest.raises(TextDataError, match=rf"{data}:1: audio .*{message}"):
            build_conversation_dataset(data, processor, 256)
    data.write_text("".join(conversation(n) + "\n" for n in names))
    dataset = build_conversation_dataset(data, processor, 256, skip_bad_samples=True)
    assert (dataset.stats.skipped, dataset.stats.documents, dataset.stats.audios) == (4, 1, 1)


def test_audio_parts_are_refused_for_a_vision_language_model(tiny_qwen2_5_vl, omni_conversations):
    from transformers import AutoConfig, AutoTokenizer

    processor = VisionProcessor(
        tiny_qwen2_5_vl,
        AutoTokenizer.from_pretrained(tiny_qwen2_5_vl),
        AutoConfig.from_pretrained(tiny_qwen2_5_vl),
        get_family("qwen2_5_vl").rope_index_fn(),
        VisionOptions(),
    )
    with pytest.raises(ValueError, match="qwen2_5_vl models take no audio; audio parts need an omni-modal model"):
        conversation_document(lines(omni_conversations)[0], omni_conversations.parent, processor, 4096, "x")


def test_use_audio_in_video_interleaves_the_track_with_the_frames(tiny_qwen2_5_omni, stock_thinker, tmp_path):
    """The video's pad becomes <|audio_bos|>, 2-second chunks of frames then audio, <|audio_eos|> (the stock
    processor's layout), the track's features are the clip's, and the positions are the stock thinker's with
    use_audio_in_video."""
    from transformers import AutoTokenizer, Qwen2_5OmniThinkerConfig

    from spindle.data.audio import audio_features, audio_token_count

    video_with_audio(tmp_path)
    family = get_family("qwen2_5_omni")
    processor = VisionProcessor(
        tiny_qwen2_5_omni,
        AutoTokenizer.from_pretrained(tiny_qwen2_5_omni),
        Qwen2_5OmniThinkerConfig.from_pretrained(tiny_qwen2_5_omni),
        family.rope_index_fn(),
        VisionOptions(),
        audio=True,
        video_audio_layout=family.video_audio_layout_fn(),
    )
    user = [{"type": "video", "video": "clip.mp4"}, {"type": "text", "text": "What?"}]
    obj = {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": "A tone."}]}
    doc, _ = conversation_document(obj, tmp_path, processor, 4096, "x")
    inputs = collate_vision(doc.vision)
    expected = audio_features(decode_audio(tmp_path / "clip.mp4", 16000), processor.feature_extractor)
    assert torch.equal(inputs["input_features"][0], expected)

    config = processor.config
    # 3 frames at t = 0, 1, 2 s (fps 2, 2 frames per temporal patch), 4 merged tokens each; ~77 audio tokens
    n_audio = audio_token_count(expected.shape[1])
    V, A = config.video_token_id, config.audio_token_id
    start = doc.tokens.index(config.vision_start_token_id)
    span = doc.tokens[start : start + 2 + 12 + n_audio + 2]
    assert span == [config.vision_start_token_id, config.audio_start_token_id] + [V] * 8 + [A] * 50 + [V] * 4 + [A] * (
        n_audio - 50
    ) + [config.audio_end_token_id, config.vision_end_token_id]

    ids = torch.tensor([doc.tokens])
    positions, _ = stock_thinker.model.get_rope_index(
        ids,
        None,
        inputs["video_grid_thw"],
        torch.ones_like(ids),
        True,
        inputs["feature_attention_mask"].sum(-1),
        inputs["second_per_grid_ts"],
    )
    assert torch.equal(doc.positions, positions[:, 0])

    (tmp_path / "plain.mp4").rename(tmp_path / "clip.mp4")  # the same video without its track
    with pytest.raises(ValueError, match=r"has no audio stream; data\.use_audio_in_video needs every video to have"):
        conversation_document(obj, tmp_path, processor, 4096, "x")


def test_sharegpt_audio_placeholders_give_the_messages_format_document(tiny_qwen2_5_omni, omni_conversations):
    """`{"audios": [...], "conversations": [... "<audio>" ...]}` is the same conversation as audio parts."""
    processor = omni_processor(tiny_qwen2_5_omni, get_family("qwen2_5_omni"))
    obj = lines(omni_conversations)[0]
    sharegpt = {
        "audios": [obj["messages"][0]["content"][0]["audio"]],
        "conversations": [
            {"from": "human", "value": "<audio>" + obj["messages"][0]["content"][1]["text"]},
            {"from": "gpt", "value": obj["messages"][1]["content"]},
        ],
    }
    base = omni_conversations.parent
    a, _ = conversation_document(obj, base, processor, 4096, "x")
    b, _ = conversation_document(sharegpt, base, processor, 4096, "x")
    assert a.tokens == b.tokens and a.learn == b.learn and torch.equal(a.positions, b.positions)
    with pytest.raises(ValueError, match=r"more <audio> placeholders than audio files"):
        twice = [{"from": "human", "value": "<audio><audio>"}, sharegpt["conversations"][1]]
        conversation_document({**sharegpt, "conversations": twice}, base, processor, 4096, "x")


@pytest.mark.parametrize("line", [0, 2], ids=["audio", "image_then_audio"])
def test_qwen3_omni_moe_tokens_and_positions_equal_the_stock_processor_and_thinker(
    line, tiny_qwen3_omni_moe, omni_conversations
):
    """Qwen3-Omni-MoE's audio encoder makes 13 tokens of each 100-frame chunk (not Qwen2.5-Omni's 1 per 4
    frames): the family's `audio_tokens` gives the stock processor's count, its `rope_index` the stock positions."""
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    from spindle.data.audio import audio_token_count  # Qwen2.5-Omni's

    obj = lines(omni_conversations)[line]
    processor = omni_processor(tiny_qwen3_omni_moe, get_family("qwen3_omni_moe"))
    doc, _ = conversation_document(obj, omni_conversations.parent, processor, 4096, "x")
    stock = stock_call(stock_processor(tiny_qwen3_omni_moe), obj, omni_conversations.parent)
    assert stock["input_ids"][0].tolist() == doc.tokens
    audio_tokens = doc.tokens.count(processor.config.audio_token_id)
    frames = int(stock["feature_attention_mask"].sum())
    assert audio_tokens == processor.audio_tokens(processor.config, frames) != audio_token_count(frames)

    thinker = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(tiny_qwen3_omni_moe)
    positions, _ = thinker.model.get_rope_index(
        stock["input_ids"], stock.get("image_grid_thw"), None, stock["attention_mask"], False, torch.tensor([frames])
    )
    assert torch.equal(doc.positions, positions[:, 0])
