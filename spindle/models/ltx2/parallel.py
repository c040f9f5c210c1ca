"""LTX-2's context-parallel plan: both streams split, so every attention of the audio-video transformer runs Ulysses
(or ring) over consistently split queries and keys.

diffusers' `LTX2VideoTransformer3DModel._cp_plan` splits the video tokens, the video text and the video RoPE only
(and the RoPE with `expected_dims=3`, which is the "interleaved" layout's; the "split" layout's cos/sin are
[B, heads, T, D/2] and stay whole). Every attention of the model dispatches through the context-parallel attention,
so the audio self-attention, the audio text cross attention and the audio<->video cross attentions would then see
a whole audio stream next to a split video stream (a shape error). This plan splits, along the token axis, what
the blocks consume of both streams:

- the forward's inputs: the video and audio latents, both text streams and their masks (the same mask), and the
  video timestep where it is per token (image-to-video's [B, Sv]; a per-sample [B] one is left whole);
- the outputs of the four RoPE modules the forward builds the positions with (`rope`, `audio_rope` for the
  self-attentions, `cross_attn_rope`, `cross_attn_audio_rope` for the audio<->video cross attentions), split after
  they run on the whole sequence's coordinates;
- and gathers both outputs (`proj_out`, `audio_proj_out`).

The per-token modulation follows: `temb`, the cross-attention scale/shift/gates and the output layer's timestep
embedding come from the (split) timestep, so they match the local tokens. Every token count (video, audio, text)
must divide the SP degree (checked before the work: spindle.models.ltx2.inference).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# the forward's per-token inputs: (name, dims); split along dim 1, left whole when they have other dims (diffusers'
# hook skips a tensor of another rank: a per-sample timestep [B]). Every caller passes each of them (diffusers' hook
# refuses a planned argument left out). The audio timestep is per sample wherever Spindle calls the model (image-to-
# video's too: only the video's first frame is conditioned), so it is not in the plan; the model's fallback to the
# video timestep when it is None is per sample too in text-to-video
TOKEN_INPUTS = (
    ("hidden_states", 3),
    ("audio_hidden_states", 3),
    ("encoder_hidden_states", 3),
    ("audio_encoder_hidden_states", 3),
    ("encoder_attention_mask", 2),
    ("audio_encoder_attention_mask", 2),
    ("timestep", 2),
)
ROPE_MODULES = ("rope", "audio_rope", "cross_attn_rope", "cross_attn_audio_rope")


def sequence_parallel_plan(config: Mapping[str, Any]) -> dict[str, Any]:
    """The diffusers context-parallel plan of an LTX2VideoTransformer3DModel with `config` (its `rope_type` sets the
    layout of the RoPE cos/sin: "split" [B, heads, T, D/2], "interleaved" [B, T, D])."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    split_rope = config.get("rope_type", "interleaved") == "split"
    rope = ContextParallelInput(
        split_dim=2 if split_rope else 1, expected_dims=4 if split_rope else 3, split_output=True
    )
    inputs = {
        name: ContextParallelInput(split_dim=1, expected_dims=dims, split_output=False) for name, dims in TOKEN_INPUTS
    }
    gather = ContextParallelOutput(gather_dim=1, expected_dims=3)
    return {
        "": inputs,
        **{name: {0: rope, 1: rope} for name in ROPE_MODULES},
        "proj_out": gather,
        "audio_proj_out": gather,
    }
