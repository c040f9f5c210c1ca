"""Qwen3 (dense causal LM) family: transformers' Qwen3 modeling, patched by patchgen (see patches.py)."""
