# mypy: disable-error-code="assignment,attr-defined,index"
# (the override below is upstream's method body with one line added, typed as upstream types it: its reassignments
# of annotated parameters do not type-check, and rewriting them would bury that line in the generated .diff)
"""patchgen config for transformers' GPT-OSS modeling -> generated/patched_modeling_gpt_oss.py.

Regenerate with `spindle patchgen` after editing, read generated/patched_modeling_gpt_oss.diff, run
the tests (docs/patchgen.md).

Patched:

- `GptOssForCausalLM.forward` calls the causal-LM forward every family's patch calls
  (spindle/models/shared/causal_lm_patch.py): the loss from the hidden states with the chunked linear
  cross-entropy, plus upstream's router aux loss (`router_aux_loss_coef x load_balancing_loss_func` on
  the router logits) where `output_router_logits` asks for it, as upstream adds it.
- `GptOssModel.forward` passes the position ids to transformers' mask functions, which upstream's does
  not: `create_causal_mask` / `create_sliding_window_causal_mask` find packed documents from the position
  ids (`find_packed_sequence_indices`, when no attention mask and no cache is given) and then mask
  attention per document, windowed on the sliding layers. Without them a packed row's documents attend to
  each other. The attention sinks are one logit per head added to every query's softmax, whatever the
  keys, so a packed row with the per-document mask equals its documents as rows exactly
  (tests/train/test_gpt_oss.py). Where nothing is packed (one document per row, or generation with a
  cache) the masks are upstream's.

Everything else is upstream: the eager attention with sinks (transformers refuses sdpa for them), the
top-k router, and the fused experts (`GptOssExperts`: interleaved gate/up columns, biases, a clamped
SwiGLU) keeping `@use_experts_implementation`, so `config._experts_implementation` picks transformers'
grouped_mm / batched_mm kernels, and expert parallelism is installed on the module by
spindle.distributed.expert_parallel.
"""

import torch
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_outputs import MoeModelOutputWithPast
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs

from spindle.models.shared.causal_lm_patch import causal_lm_forward
from spindle.patchgen import PatchConfig

config = PatchConfig(source_module="transformers.models.gpt_oss.modeling_gpt_oss")
config.delegate_method(
    "GptOssForCausalLM.forward",
    to=causal_lm_forward,
    description="loss from hidden states with the chunked linear cross-entropy, plus upstream's router aux loss",
)


@config.override_method(
    "GptOssModel.forward",
    description="position ids passed to the mask functions: packed documents masked apart (module docstring)",
)
def forward(
    self,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values: Cache | None = None,
    inputs_embeds: torch.Tensor | None = None,
    use_cache: bool | None = None,
    **kwargs: Unpack[TransformersKwargs],
) -> MoeModelOutputWithPast:
    if (input_ids is None) ^ (inputs_embeds is not None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")

    if use_cache and past_key_values is None:
        past_key_values = DynamicCache(config=self.config)

    if inputs_embeds is None:
        inputs_embeds = self.embed_tokens(input_ids)

    if position_ids is None:
        past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
        position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
        position_ids = position_ids.unsqueeze(0)

    # It may already have been prepared by e.g. `generate`
    if not isinstance(causal_mask_mapping := attention_mask, dict):
        mask_kwargs = {
            "config": self.config,
            "inputs_embeds": inputs_embeds,
            "attention_mask": attention_mask,
            "past_key_values": past_key_values,
            "position_ids": position_ids,
        }
        causal_mask_mapping = {
            "full_attention": create_causal_mask(**mask_kwargs),
            "sliding_attention": create_sliding_window_causal_mask(**mask_kwargs),
        }

    hidden_states = inputs_embeds
    position_embeddings = self.rotary_emb(hidden_states, position_ids)

    for i, decoder_layer in enumerate(self.layers):
        hidden_states = decoder_layer(
            hidden_states,
            attention_mask=causal_mask_mapping[self.config.layer_types[i]],
            position_embeddings=position_embeddings,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            **kwargs,
        )
    hidden_states = self.norm(hidden_states)
    return MoeModelOutputWithPast(
        last_hidden_state=hidden_states,
        past_key_values=past_key_values,
    )
