"""Llama (dense causal LM) family: transformers' Llama modeling, patched by patchgen (see patches.py)."""
