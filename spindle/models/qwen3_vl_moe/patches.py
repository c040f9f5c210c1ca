"""patchgen config for transformers' Qwen3-VL-MoE modeling -> generated/patched_modeling_qwen3_vl_moe.py.

Regenerate with `spindle patchgen` after editing, read generated/patched_modeling_qwen3_vl_moe.diff, run
the tests (docs/patchgen.md).

Patched: `Qwen3VLMoeForConditionalGeneration.forward`, as the Qwen3-MoE patch patches its ForCausalLM
(the same shared fragments, spindle/models/shared/causal_lm_patch.py): the token loss from the last
hidden states with the chunked linear cross-entropy, and the router's load-balancing loss as upstream
adds it, through spindle.ops.router_loss, so that it is masked for padding (`router_mask`), summed over
a sequence-parallel group (`router_group`) and weighted to survive Spindle's summed loss. Upstream adds
`router_aux_loss_coef x aux_loss` to a loss its caller may have asked to be a sum: without the patch the
aux term would be divided by the global token count. transformers has no hook for either: its
loss_function receives logits and the aux term is inline in the forward.

Everything else is upstream: the vision tower, the 3-D RoPE, deepstack, and the fused experts
(`Qwen3VLMoeTextExperts`, with `@use_experts_implementation`); expert parallelism is installed on the
experts by spindle.distributed.expert_parallel.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPooling, MoeCausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs

from spindle.models.shared.causal_lm_patch import add_moe_loss_helpers, causal_lm_loss_or_logits, with_router_aux_loss
from spindle.patchgen import PatchConfig

config = PatchConfig(source_module="transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe")
add_moe_loss_helpers(config)


# Patch: Qwen3VLMoeForConditionalGeneration.forward (upstream signature and decorators kept)
#   1. pop Spindle's loss kwargs (shift_labels, loss_reduction, router_mask, router_group) so the
#      model never sees them;
#   2. with labels or shift_labels: token loss from hidden states via causal_lm_loss, logits=None;
#      without: exactly upstream (lm_head on the logits_to_keep slice): causal_lm_loss_or_logits;
#   3. the aux loss as upstream, in the token loss's normalisation: with_router_aux_loss.
@config.override_method(
    "Qwen3VLMoeForConditionalGeneration.forward",
    description="loss from hidden states with the chunked linear cross-entropy, plus upstream's router aux loss",
)
def vl_moe_forward(
    self,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values: Cache | None = None,
    inputs_embeds: torch.Tensor | None = None,
    labels: torch.LongTensor | None = None,
    pixel_values: torch.Tensor | None = None,
    pixel_values_videos: torch.Tensor | None = None,
    image_grid_thw: torch.LongTensor | None = None,
    video_grid_thw: torch.LongTensor | None = None,
    mm_token_type_ids: torch.IntTensor | None = None,
    output_router_logits: bool | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    mm_encoder_outputs: dict[str, BaseModelOutputWithPooling] | None = None,
    **kwargs: Unpack[TransformersKwargs],
) -> tuple | MoeCausalLMOutputWithPast:
    r"""
    Besides transformers' arguments, Spindle's loss arguments (as in the Qwen3-MoE patch): `shift_labels`
    (already shifted labels, used instead of `labels`), `loss_reduction="sum"`, `router_mask` ([rows, seq],
    1 = real token: the padding mask of the aux loss, which is not passed to attention) and `router_group`
    (the process group holding the other tokens of the same rows: sequence parallelism).
    """
    # --- Patch.1: Spindle's loss kwargs are for the loss only.
    shift_labels = kwargs.pop("shift_labels", None)
    loss_reduction = kwargs.pop("loss_reduction", None)
    router_mask = kwargs.pop("router_mask", None)
    router_group = kwargs.pop("router_group", None)
    output_router_logits = (
        output_router_logits if output_router_logits is not None else self.config.text_config.output_router_logits
    )

    outputs = self.model(
        input_ids=input_ids,
        pixel_values=pixel_values,
        pixel_values_videos=pixel_values_videos,
        image_grid_thw=image_grid_thw,
        video_grid_thw=video_grid_thw,
        mm_token_type_ids=mm_token_type_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        past_key_values=past_key_values,
        inputs_embeds=inputs_embeds,
        mm_encoder_outputs=mm_encoder_outputs,
        output_router_logits=output_router_logits,
        **kwargs,
    )

    hidden_states = outputs[0]
    hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)
    # --- Patch.2: the chunked loss replaces lm_head + loss_function when there is something to learn.
    loss, logits = causal_lm_loss_or_logits(self, hidden_states, labels, shift_labels, loss_reduction, kwargs)

    aux_loss = None
    if output_router_logits:
        # --- Patch.3: the aux term in the token loss's normalisation (1 for upstream's mean).
        mask = attention_mask if router_mask is None else router_mask
        loss, aux_loss = with_router_aux_loss(
            loss,
            outputs.router_logits,
            self.config.text_config,
            mask,
            router_group,
            labels,
            shift_labels,
            loss_reduction,
            kwargs,
        )

    return MoeCausalLMOutputWithPast(
        loss=loss,
        aux_loss=aux_loss,
        logits=logits,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
        router_logits=outputs.router_logits,
    )
