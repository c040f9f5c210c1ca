"""patchgen config for transformers' Gemma 3 modeling -> generated/patched_modeling_gemma3.py.

Gemma 3's text head (`Gemma3ForCausalLM`) takes Qwen3's patch through name_map rather than a copy
(../qwen3/patches.py says what it does): its forward delegates to the shared causal-LM forward, which also
applies the head's `final_logit_softcapping` where the config sets one (none of the released Gemma 3
checkpoints do). The image-text head (`Gemma3ForConditionalGeneration`, trained by the gemma3_vl family) takes
the multimodal families' chunked-loss patch (spindle/models/shared/patched_conversions.py): its forward
delegates to the same shared forward, which passes `pixel_values` and `token_type_ids` on to `Gemma3Model` as
upstream does (the vision tower, the projector, the bidirectional image-token mask: all upstream's). Its
config has no `final_logit_softcapping`, and upstream's image-text forward applies none. Regenerate with
`spindle patchgen`.
"""

from spindle.models.qwen3 import patches as qwen3
from spindle.models.shared.causal_lm_patch import causal_lm_forward
from spindle.patchgen import PatchConfig

SOURCE = "transformers.models.gemma3.modeling_gemma3"

config = PatchConfig(source_module=SOURCE)
config.extend(qwen3.config, name_map={"Qwen3": "Gemma3"})
config.delegate_method(
    "Gemma3ForConditionalGeneration.forward",
    to=causal_lm_forward,
    description="loss from hidden states with the chunked linear cross-entropy",
)
# transformers keys Gemma 3's checkpoint conversion (the released checkpoints' `language_model.model.*` ->
# `model.language_model.*`) by model type, which it skips for a class outside its package unless the user
# registered it: registered again as the user's, so Hub checkpoints load in the generated classes and exports
# are saved under the stock names
config.add_import("spindle.models.shared.patched_conversions", names=["keep_model_type_conversions"])
config.add_post_import_block(
    'keep_model_type_conversions(("gemma3", "gemma3_text"))',
    description="transformers' checkpoint key conversions apply to the generated image-text classes too",
)
