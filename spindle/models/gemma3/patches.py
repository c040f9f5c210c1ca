"""patchgen config for transformers' Gemma 3 modeling -> generated/patched_modeling_gemma3.py.

Gemma 3's text head (`Gemma3ForCausalLM`) takes Qwen3's patch through name_map rather than a copy
(../qwen3/patches.py says what it does): its forward delegates to the shared causal-LM forward, which also
applies the head's `final_logit_softcapping` where the config sets one (none of the released Gemma 3
checkpoints do). The module's multimodal classes are left as upstream wrote them. Regenerate with
`spindle patchgen`.
"""

from spindle.models.qwen3 import patches as qwen3
from spindle.patchgen import PatchConfig

config = PatchConfig(source_module="transformers.models.gemma3.modeling_gemma3")
config.extend(qwen3.config, name_map={"Qwen3": "Gemma3"})
