"""patchgen config for transformers' Qwen3-Omni-MoE modeling -> generated/patched_modeling_qwen3_omni_moe.py.

Regenerate with `spindle patchgen` after editing, read generated/patched_modeling_qwen3_omni_moe.diff, run
the tests (docs/patchgen.md).

Patched: `Qwen3OmniMoeThinkerForConditionalGeneration.forward`, as the Qwen3-VL-MoE patch patches its
ForConditionalGeneration (the same shared fragments, spindle/models/shared/causal_lm_patch.py): the token
loss from the last hidden states with the chunked linear cross-entropy, and the router's load-balancing
loss as upstream adds it, through spindle.ops.router_loss (masked for padding with `router_mask`, summed
over a sequence-parallel `router_group`, weighted to survive Spindle's summed loss). transformers has no
hook for either: its loss_function receives logits and the aux term is inline in the forward.

Everything else is upstream: the audio encoder, the vision tower, the 3-D RoPE, deepstack, the fused
experts (`@use_experts_implementation`), the talker and code2wav (never trained, never loaded by Spindle);
expert parallelism is installed on the experts by spindle.distributed.expert_parallel.
"""

from __future__ import annotations

from transformers.modeling_outputs import BaseModelOutputWithPooling, MoeCausalLMOutputWithPast, MoeModelOutputWithPast

from spindle.models.shared.causal_lm_patch import add_moe_loss_helpers, causal_lm_loss_or_logits, with_router_aux_loss
from spindle.patchgen import PatchConfig

config = PatchConfig(source_module="transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe")
add_moe_loss_helpers(config)


# Patch: Qwen3OmniMoeThinkerForConditionalGeneration.forward (upstream signature and decorators kept)
#   1. pop Spindle's loss kwargs (shift_labels, loss_reduction, router_mask, router_group) so the
#      model never sees them;
#   2. with labels or shift_labels: token loss from hidden states via causal_lm_loss, logits=None;
#      without: exactly upstream (lm_head on every position): causal_lm_loss_or_logits;
#   3. the aux loss as upstream, in the token loss's normalisation: with_router_aux_loss.
@config.override_method(
    "Qwen3OmniMoeThinkerForConditionalGeneration.forward",
    description="loss from hidden states with the chunked linear cross-entropy, plus upstream's router aux loss",
)
def thinker_forward(
    self,
    input_ids=None,
    input_features=None,
    pixel_values=None,
    pixel_values_videos=None,
    image_grid_thw=None,
    video_grid_thw=None,
    attention_mask=None,
    feature_attention_mask=None,
    audio_feature_lengths=None,
    position_ids=None,
    past_key_values=None,
    inputs_embeds=None,
    labels=None,
    use_cache=None,
    output_router_logits: bool | None = None,
    use_audio_in_video=None,
    video_second_per_grid=None,
    mm_encoder_outputs: dict[str, BaseModelOutputWithPooling] | None = None,
    **kwargs,
) -> tuple | MoeCausalLMOutputWithPast:
    r"""
    feature_attention_mask (`torch.Tensor` of shape `(batch_size, feature_sequence_length)`, *optional*):
        Mask to avoid performing attention on padding feature indices. Mask values selected in `[0, 1]`:

        - 1 for tokens that are **not masked**,
        - 0 for tokens that are **masked**.
    audio_feature_lengths (`torch.LongTensor` of shape `(num_audios)`, *optional*):
        The length of feature shape of each audio in LLM.
    use_audio_in_video (`bool`, *optional*):
        Whether or not use audio track in video, should same as the parameter in `process_audio_info`.
    video_second_per_grid (`torch.LongTensor` of shape `(num_videos)`, *optional*):
        Number of seconds per grid for each video, used for temporal feature mapping.

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
    outputs: MoeModelOutputWithPast = self.model(
        input_ids=input_ids,
        input_features=input_features,
        pixel_values=pixel_values,
        pixel_values_videos=pixel_values_videos,
        image_grid_thw=image_grid_thw,
        video_grid_thw=video_grid_thw,
        attention_mask=attention_mask,
        feature_attention_mask=feature_attention_mask,
        audio_feature_lengths=audio_feature_lengths,
        position_ids=position_ids,
        past_key_values=past_key_values,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        use_audio_in_video=use_audio_in_video,
        video_second_per_grid=video_second_per_grid,
        mm_encoder_outputs=mm_encoder_outputs,
        output_router_logits=output_router_logits,
        **kwargs,
    )

    hidden_states = outputs[0]
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
        logits=logits,
        aux_loss=aux_loss,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
        past_key_values=outputs.past_key_values,
        router_logits=outputs.router_logits,
    )
