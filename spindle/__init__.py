"""Spindle: train and serve diffusion transformers from standard diffusers checkpoints."""

__version__ = "0.1.0"


def __getattr__(name):  # lazy: `import spindle` stays light
    if name == "DiffusionGenerator":
        from spindle.infer.generator import DiffusionGenerator

        return DiffusionGenerator
    raise AttributeError(f"module 'spindle' has no attribute {name!r}")
