"""`spindle.DiffusionGenerator`: the inference engine's `DiffusionGenerator` loaded the diffusers way,
`DiffusionGenerator.from_pretrained(path, **engine_options)`, its family detected from the folder.

The engine (`spindle.infer.generator`) never looks a family up (docs/architecture.md: engines take the
family record from an entry point); this entry point does, through the registry, and accepts a Hugging
Face repo id in the local cache (`spindle.hub`). `spindle.load_generator` is this `from_pretrained`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spindle.contracts.family import DiTFamily
from spindle.hub import resolve_model_path
from spindle.infer import generator as engine
from spindle.registry import dit_family_of


class DiffusionGenerator(engine.DiffusionGenerator):
    """The engine's generator (see `spindle.infer.generator.DiffusionGenerator`), whose `from_pretrained`
    detects the family."""

    @classmethod
    def from_pretrained(
        cls, path: str | Path, family: DiTFamily | str | None = None, **engine_options: Any
    ) -> DiffusionGenerator:
        """Load the diffusers pipeline folder `path` (or a cached Hugging Face repo id `org/name[@revision]`).
        `family`: a family name to force (refused when the folder is not one of its models) or a family
        record; None detects it. Engine options: the fields of `spindle.engine_config.EngineConfig` (dtype,
        compile, cache, sp, lora, ...) as keywords; a bad one raises `ConfigError` before anything loads."""
        root = resolve_model_path(path)
        record = family if isinstance(family, DiTFamily) else dit_family_of(root, family)
        generator = super().from_pretrained(root, record, **engine_options)
        assert isinstance(generator, cls)
        return generator
