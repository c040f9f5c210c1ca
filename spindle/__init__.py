"""Spindle: train and serve diffusion transformers from standard diffusers checkpoints."""

__version__ = "0.1.0"


def __getattr__(name):  # lazy: `import spindle` stays light
    if name == "load_generator":  # spindle.load_generator(path, **engine_options) -> DiffusionGenerator
        from spindle.python_api import load_generator

        return load_generator
    if name == "DiffusionGenerator":  # spindle.DiffusionGenerator.from_pretrained(path, **engine_options)
        from spindle.generator import DiffusionGenerator

        return DiffusionGenerator
    if name == "train":  # spindle.train(config, **overrides): the callable subpackage (below)
        import importlib

        return importlib.import_module("spindle.train")
    raise AttributeError(f"module 'spindle' has no attribute {name!r}")


def __dir__():
    return ["DiffusionGenerator", "__version__", "load_generator", "train"]


# `spindle.train(config, **overrides)` (spindle.python_api.train) is the subpackage spindle/train made
# callable (spindle/train/__init__.py): importing a subpackage sets it as the package's attribute, so a
# function of that name here would be replaced by the module the first time the trainer is imported.
