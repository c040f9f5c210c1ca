# mypy: disable-error-code="assignment,attr-defined,index,name-defined,union-attr,misc"
# (the overrides below are upstream's method bodies with one branch / one line changed, typed as upstream types
# them: its reassignments and Optional uses do not type-check, and a method's `super()` is outside a class here;
# rewriting them would bury the change in the generated .diff)
"""patchgen config for transformers' Qwen3.5 modeling -> generated/patched_modeling_qwen3_5.py.

Regenerate with `spindle patchgen` after editing, read generated/patched_modeling_qwen3_5.diff, run the
tests (docs/patchgen.md).

Patched: `Qwen3_5ForConditionalGeneration.forward` calls the causal-LM forward every patched family shares
(spindle/models/shared/causal_lm_patch.py): with labels, the token loss from the last hidden states with the
chunked linear cross-entropy, never the [tokens, vocab] logits (248K columns a token); without, the logits
exactly as upstream computes them.

`Qwen3_5GatedDeltaNet.forward` (upstream's body with one branch added at its top): under Ulysses SP (the layer
carries the context spindle.distributed.ulysses_attention attached) and without a cache, the layer runs
spindle.distributed.ulysses_linear_attention's forward: the projections on this rank's chunk of the sequence,
then the causal convolution and the gated delta rule (this module's own `causal_conv1d_fn` and
`torch_chunk_gated_delta_rule`) over the whole sequence of this rank's heads between two all-to-alls. Without SP
the body is upstream's. Qwen3.5-MoE's patches reuse this override.

`Qwen3_5Model.__init__` builds its language model as this module's `Qwen3_5TextModel` (upstream builds it
with `AutoModel.from_config`, which would be transformers' own class, without the override above); the same
construction, the same weights and names.

Everything else is upstream: the vision tower, the 3-D RoPE, the full-attention layers (Ulysses SP reaches
them through transformers' attention interface).
"""

import torch
import torch.nn.functional as F
from transformers import AutoModel
from transformers.cache_utils import Cache
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5Config,
    Qwen3_5TextModel,
    apply_mask_to_padding_states,
    causal_conv1d_fn,
    causal_conv1d_update,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs

from spindle.distributed.ulysses_attention import sequence_parallel_context
from spindle.distributed.ulysses_linear_attention import gated_deltanet_forward
from spindle.models.shared.patched_conversions import chunked_loss_head_patch

config = chunked_loss_head_patch("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5ForConditionalGeneration")
config.add_import("spindle.distributed.ulysses_attention", names=["sequence_parallel_context"])
config.add_import("spindle.distributed.ulysses_linear_attention", names=["gated_deltanet_forward"])


@config.override_method(
    "Qwen3_5GatedDeltaNet.forward",
    description="under Ulysses SP: convolution and recurrence over the whole sequence of this rank's heads",
)
def forward(
    self,
    hidden_states: torch.Tensor,
    cache_params: Cache | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Unpack[TransformersKwargs],
):
    if cache_params is None and (sp := sequence_parallel_context(self)) is not None:
        # Ulysses SP: this rank holds a chunk of the sequence; the convolution and the recurrence need all of it
        return gated_deltanet_forward(
            self, hidden_states, attention_mask, sp, conv=causal_conv1d_fn, delta_rule=torch_chunk_gated_delta_rule
        )
    hidden_states = apply_mask_to_padding_states(hidden_states, attention_mask)

    # Set up dimensions for reshapes later
    batch_size, seq_len, _ = hidden_states.shape
    # Retrieve conv and recurrent states if there is a cache. They may be None if the layer is not initialized.
    if cache_params is not None:
        conv_state = cache_params.get_conv_state(self.layer_idx, state_idx=0)
        recurrent_state = cache_params.get_recurrent_state(self.layer_idx, state_idx=0)
    else:
        conv_state, recurrent_state = None, None

    mixed_qkv = self.in_proj_qkv(hidden_states)
    mixed_qkv = mixed_qkv.transpose(1, 2)

    z = self.in_proj_z(hidden_states)
    z = z.reshape(batch_size, seq_len, -1, self.head_v_dim)

    b = self.in_proj_b(hidden_states)
    a = self.in_proj_a(hidden_states)

    if conv_state is not None and seq_len == 1 and not cache_params.is_recording_past(self.layer_idx):
        # Single-token cached decode: the fused per-step kernel updates the conv state in-place.
        mixed_qkv = causal_conv1d_update(
            mixed_qkv,
            conv_state,
            self.conv1d.weight.squeeze(1),
            self.conv1d.bias,
            self.activation,
        )
    else:
        if cache_params is not None:
            mixed_qkv = cache_params.update_conv_state(
                mixed_qkv, self.layer_idx, conv_kernel_size=self.conv_kernel_size
            )

        mixed_qkv = causal_conv1d_fn(
            mixed_qkv,
            self.conv1d.weight.squeeze(1),
            self.conv1d.bias,
            activation=self.activation,
            **kwargs,
        )

        # Drop the additional previous states
        if cache_params is not None:
            mixed_qkv = mixed_qkv[:, :, -seq_len:]

    mixed_qkv = mixed_qkv.transpose(1, 2)
    query, key, value = torch.split(
        mixed_qkv,
        [
            self.key_dim,
            self.key_dim,
            self.value_dim,
        ],
        dim=-1,
    )

    query = query.reshape(batch_size, seq_len, -1, self.head_k_dim)
    key = key.reshape(batch_size, seq_len, -1, self.head_k_dim)
    value = value.reshape(batch_size, seq_len, -1, self.head_v_dim)

    beta = b.sigmoid()
    # If the model is loaded in fp16, without the .float() here, A might be -inf
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)

    if recurrent_state is not None and seq_len == 1:
        core_attn_out, last_recurrent_state = torch_recurrent_gated_delta_rule(
            query,
            key,
            value,
            g=g,
            beta=beta,
            initial_state=recurrent_state,
            output_final_state=cache_params is not None,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=kwargs.pop("cu_seq_lens_q", None),
            **kwargs,
        )
    else:
        core_attn_out, last_recurrent_state = torch_chunk_gated_delta_rule(
            query,
            key,
            value,
            g=g,
            beta=beta,
            initial_state=recurrent_state,
            output_final_state=cache_params is not None,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=kwargs.pop("cu_seq_lens_q", None),
            **kwargs,
        )

    # Update cache
    if cache_params is not None:
        cache_params.update_recurrent_state(last_recurrent_state, self.layer_idx)

    # reshape input data into 2D tensor
    core_attn_out = core_attn_out.reshape(-1, self.head_v_dim)
    z = z.reshape(-1, self.head_v_dim)
    core_attn_out = self.norm(core_attn_out, z)
    core_attn_out = core_attn_out.reshape(batch_size, seq_len, -1)

    output = self.out_proj(core_attn_out)
    return output


@config.override_method(
    "Qwen3_5Model.__init__",
    description="the language model is this module's Qwen3_5TextModel (its Gated DeltaNet layers patched)",
)
def __init__(self, config: Qwen3_5Config):
    super().__init__(config)
    self.visual = AutoModel.from_config(config.vision_config)
    self.language_model = Qwen3_5TextModel._from_config(config.text_config)
    self.rope_deltas = None  # cache rope_deltas here

    # Initialize weights and apply final processing
    self.post_init()
