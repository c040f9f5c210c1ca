"""Spindle: train and serve diffusion transformers from standard diffusers checkpoints."""

__version__ = "0.1.0"
