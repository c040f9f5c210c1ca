"""What the audio encoder of Qwen2.5-Omni-7B costs next to its decoder: the measured reason Spindle runs the
audio encoder whole on every SP rank (docs/training.md, "Omni-modal models").

Counts the forward FLOPs (torch's FlopCounterMode; backward is about twice the forward for both, so the
ratio holds for a training step) of one audio encoder layer and one decoder layer at the published
shapes (transformers' config defaults are Qwen2.5-Omni-7B's), on meta tensors (no weights, no compute),
and scales them by the layer counts. A clip of S seconds is 100*S mel frames -> 50*S encoder tokens in
windows of n_window*2 frames -> 25*S decoder tokens; the decoder also carries the conversation's other
tokens (`--text-tokens`).

    python bench/omni_audio_cost.py --seconds 10 30 300 --text-tokens 512
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen2_5OmniAudioEncoderConfig, Qwen2_5OmniTextConfig
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniAudioEncoderLayer,
    Qwen2_5OmniDecoderLayer,
    Qwen2_5OmniRotaryEmbedding,
)


def flops(run) -> int:
    with FlopCounterMode(display=False) as counter:
        run()
    return int(counter.get_total_flops())


def audio_encoder_flops(seconds: float, config) -> int:
    frames = int(100 * seconds)
    window = config.n_window * 2  # mel frames per attention window
    lengths = [window] * (frames // window) + ([frames % window] if frames % window else [])
    after_conv = torch.tensor([(n - 1) // 2 + 1 for n in lengths])
    cu_seqlens = torch.nn.functional.pad(after_conv.cumsum(0), (1, 0)).int()  # on the CPU: split sizes
    with torch.device("meta"):
        layer = Qwen2_5OmniAudioEncoderLayer(config)
        hidden = torch.zeros(int(after_conv.sum()), config.d_model)
    per_layer = flops(lambda: layer(hidden, cu_seqlens=cu_seqlens))
    return per_layer * config.encoder_layers


def decoder_flops(tokens: int, config) -> int:
    with torch.device("meta"):
        layer = Qwen2_5OmniDecoderLayer(config, 0)
        rotary = Qwen2_5OmniRotaryEmbedding(config)
        hidden = torch.zeros(1, tokens, config.hidden_size)
        positions = torch.arange(tokens).view(1, 1, -1).expand(3, 1, -1)
        cos_sin = rotary(hidden, positions)
    per_layer = flops(lambda: layer(hidden, attention_mask=None, position_embeddings=cos_sin))
    return per_layer * config.num_hidden_layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, nargs="+", default=[10.0, 30.0, 300.0])
    parser.add_argument("--text-tokens", type=int, default=512, help="the conversation's non-audio tokens")
    args = parser.parse_args()
    audio, text = Qwen2_5OmniAudioEncoderConfig(), Qwen2_5OmniTextConfig()
    text._attn_implementation = "sdpa"
    audio._attn_implementation = "sdpa"
    print("clip_s  audio_tokens  encoder_TFLOP  decoder_TFLOP  encoder/decoder")
    for seconds in args.seconds:
        tokens = int(25 * seconds) + args.text_tokens
        enc, dec = audio_encoder_flops(seconds, audio), decoder_flops(tokens, text)
        print(f"{seconds:6g}  {int(25 * seconds):12d}  {enc / 1e12:13.2f}  {dec / 1e12:13.2f}  {enc / dec:15.3f}")


if __name__ == "__main__":
    main()
