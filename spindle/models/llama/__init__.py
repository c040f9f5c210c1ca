"""Llama dense causal LMs (transformers `model_type` "llama", `LlamaForCausalLM`), trained by the causal-LM task."""

from spindle.models.base import CausalLMFamily, TextDemoSpec

FAMILY = CausalLMFamily(
    name="llama",
    model_types=("llama",),
    # The class the task trains. Stock transformers until the patchgen-generated class
    # (spindle/models/llama/generated/patched_modeling_llama.py) lands; both take the same loss arguments.
    model_class="transformers:LlamaForCausalLM",
    tiny_model="spindle.testing.tiny_llm:build_tiny_llama",
    demo=TextDemoSpec(),
)
