"""patchgen config for transformers' Qwen2 modeling -> generated/patched_modeling_qwen2.py.

Qwen2's causal-LM forward is Qwen3's with other names, so it takes Qwen3's patch through name_map
rather than a copy (../qwen3/patches.py says what they do). Regenerate with `spindle patchgen`.
"""

from spindle.models.qwen3 import patches as qwen3
from spindle.patchgen import PatchConfig

config = PatchConfig(source_module="transformers.models.qwen2.modeling_qwen2")
config.extend(qwen3.config, name_map={"Qwen3": "Qwen2"})
