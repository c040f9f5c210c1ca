"""What a `spindle` command imports, imported once by the tests' forkserver (`spindle.testing.multiprocess`), so that
each rank or command it forks starts with it in memory instead of importing it again.

A forked `spindle train` of a tiny model spends more CPU importing (transformers' modeling and generation utilities,
TensorBoard, PyAV, the family's patched modeling module, diffusers' pipeline and its VAE classes) than training; the
suite forks a few hundred of them on CI's two cores. Importing is all this module does: no module state, no
environment read (a forked child sets its own environment before it runs anything)."""

from __future__ import annotations

import importlib

import accelerate  # noqa: F401  (diffusers' and transformers' loaders import it)
import av  # noqa: F401
import torch.utils.tensorboard  # noqa: F401
import transformers
import transformers.generation
import transformers.modeling_utils

import spindle.cli  # noqa: F401
from spindle.contracts.family import CausalLMFamily, DiTFamily
from spindle.registry import all_families

for _name in ("train", "generate", "serve", "export", "demo", "precompute", "tiny_model"):
    importlib.import_module(f"spindle.commands.{_name}")
for _name in ("app", "server", "worker"):  # `spindle serve`: FastAPI, uvicorn, python-multipart
    importlib.import_module(f"spindle.serve.{_name}")

# transformers names the PIL image processors it falls back to without torchvision, once a process: not in the log of
# whichever test starts the forkserver
_verbosity = transformers.logging.get_verbosity()
transformers.logging.set_verbosity_error()
try:
    for _family in all_families():
        if isinstance(_family, DiTFamily):
            _family.condition_model_cls()
            _family.inference_spec()
            _family.pipeline_class()
        elif isinstance(_family, CausalLMFamily):
            _family.model_cls()
finally:
    transformers.logging.set_verbosity(_verbosity)
