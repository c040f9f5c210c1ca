"""Spindle: train and serve diffusion transformers from standard diffusers checkpoints."""

__version__ = "0.1.0"


def __getattr__(name):  # lazy: `import spindle` stays light
    if name == "load_generator":  # spindle.load_generator(path, **engine_options) -> DiffusionGenerator
        from spindle.api import load_generator

        return load_generator
    if name == "DiffusionGenerator":  # spindle.DiffusionGenerator.from_pretrained(path, **engine_options)
        from spindle.generator import DiffusionGenerator

        return DiffusionGenerator
    raise AttributeError(f"module 'spindle' has no attribute {name!r}")


def __dir__():
    return ["DiffusionGenerator", "__version__", "load_generator"]
