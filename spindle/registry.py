"""Family registry: family name / diffusers `_class_name` / transformers `model_type` -> family record, lazily.

A family package (`spindle/models/<family>/__init__.py`) defines `FAMILY` (a record of
`spindle.contracts.family`); every family names its training task (`family.task`, see
`spindle.train.tasks`). The registry knows only the module paths, so importing Spindle imports no
model code. Only entry points (the CLI commands, `spindle.api`) use it: they resolve the family and
pass it to the engines, which never look a family up themselves.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any, TypeAlias

from spindle.contracts.family import CausalLMFamily, DiTFamily, VLMFamily
from spindle.export.record import is_lora_folder, lora_usage, read_export_record
from spindle.model_index import has_model_index, model_index_path, read_model_index

Family: TypeAlias = DiTFamily | CausalLMFamily | VLMFamily  # OmniFamily is a VLMFamily

# name -> module defining FAMILY. Adding a family: one line here, one folder under models/.
BUILTIN_FAMILIES: dict[str, str] = {
    "deepseek_v3": "spindle.models.deepseek_v3",
    "flux": "spindle.models.flux",
    "flux_kontext": "spindle.models.flux_kontext",
    "flux2": "spindle.models.flux2",
    "flux2_klein": "spindle.models.flux2.klein",
    "gemma3": "spindle.models.gemma3",
    "gemma3_vl": "spindle.models.gemma3_vl",
    "gpt_oss": "spindle.models.gpt_oss",
    "hunyuan_video_1_5": "spindle.models.hunyuan_video_1_5",
    "hunyuan_video_1_5_i2v": "spindle.models.hunyuan_video_1_5_i2v",
    "llama": "spindle.models.llama",
    "ltx2": "spindle.models.ltx2",
    "ltx2_i2v": "spindle.models.ltx2_i2v",
    "qwen2": "spindle.models.qwen2",
    "qwen2_5_omni": "spindle.models.qwen2_5_omni",
    "qwen2_5_vl": "spindle.models.qwen2_5_vl",
    "qwen3": "spindle.models.qwen3",
    "qwen3_moe": "spindle.models.qwen3_moe",
    "qwen3_omni_moe": "spindle.models.qwen3_omni_moe",
    "qwen3_5": "spindle.models.qwen3_5",
    "qwen3_5_moe": "spindle.models.qwen3_5_moe",
    "qwen3_vl": "spindle.models.qwen3_vl",
    "qwen3_vl_moe": "spindle.models.qwen3_vl_moe",
    "qwenimage": "spindle.models.qwenimage",
    "qwenimage_edit": "spindle.models.qwenimage_edit",
    "qwenimage_edit_plus": "spindle.models.qwenimage_edit.plus",
    "wan": "spindle.models.wan",
    "wan_i2v": "spindle.models.wan_i2v",
    "wan22": "spindle.models.wan22",
    "wan22_i2v": "spindle.models.wan22_i2v",
    "wan22_ti2v": "spindle.models.wan22_ti2v",
    "z_image": "spindle.models.z_image",
}


class UnknownModelError(ValueError):
    """The checkpoint (or family name) is not served by any registered family."""


def family_names() -> list[str]:
    return sorted(BUILTIN_FAMILIES)


def get_family(name: str) -> Family:
    if name not in BUILTIN_FAMILIES:
        raise UnknownModelError(f"unknown model family {name!r}; known families: {', '.join(family_names())}")
    family: Family = importlib.import_module(BUILTIN_FAMILIES[name]).FAMILY
    return family


def all_families() -> list[Family]:
    return [get_family(n) for n in family_names()]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        return data
    except json.JSONDecodeError as e:
        raise UnknownModelError(f"{path} is not valid JSON: {e}") from e


def family_of(path: str | Path, name: str | None = None) -> Family:
    """The family named `name` (refused when the checkpoint at `path` is not one of its models), else the
    one that serves the checkpoint at `path`."""
    if not name:
        return resolve_family(path)
    family = get_family(name)
    check_family_matches(family, Path(path))
    return family


def check_family_matches(family: Family, root: Path) -> None:
    """A forced family must serve the checkpoint: a transformers folder's `model_type` is one the family
    lists; a diffusers folder's pipeline or transformer class is the family's, or its detector accepts
    the folder. Otherwise loading would fill the gaps with defaults (a GPT-2 folder as qwen3)."""
    if not root.is_dir():
        return  # the loaders name the missing folder
    if isinstance(family, CausalLMFamily):
        if not (root / "config.json").is_file():
            raise UnknownModelError(
                f"model.family={family.name} is a language model family, but {root} has no config.json"
            )
        model_type = _read_json(root / "config.json").get("model_type")
        if reason := family.refused_model_types.get(str(model_type)):
            raise UnknownModelError(f"model.family={family.name}: {root} (model_type {model_type!r}): {reason}")
        if model_type not in family.model_types:
            raise UnknownModelError(
                f"model.family={family.name} serves transformers model_type {', '.join(family.model_types)}, but "
                f"{root}/config.json has model_type {model_type!r}; remove model.family to detect the family, or "
                "point model.path at a checkpoint of that family"
            )
        return
    if not has_model_index(root):
        raise UnknownModelError(
            f"model.family={family.name} is a diffusion family, but {root} has no model_index.json "
            "(a diffusers pipeline folder)"
        )
    index_path = model_index_path(root)
    pipeline_cls = read_model_index(root).get("_class_name")
    tcfg_path = root / "transformer" / "config.json"
    transformer_cls = _read_json(tcfg_path).get("_class_name") if tcfg_path.is_file() else None
    if (
        pipeline_cls == family.checkpoint.pipeline
        or transformer_cls == family.checkpoint.transformer
        or (family.checkpoint.detect is not None and family.checkpoint.detect(root))
    ):
        return
    raise UnknownModelError(
        f"model.family={family.name} serves pipeline {family.checkpoint.pipeline}, but {index_path} names "
        f"{pipeline_cls!r} (transformer {transformer_cls!r}); remove model.family to detect the family, or point "
        "model.path at a checkpoint of that family"
    )


def _resolve_transformers_folder(root: Path) -> Family:
    """A transformers folder (config.json with model_type) -> the family declaring that model_type."""
    model_type = _read_json(root / "config.json").get("model_type")
    families = all_families()
    for fam in families:
        if model_type in getattr(fam, "model_types", ()):
            return fam
    for fam in families:
        if reason := getattr(fam, "refused_model_types", {}).get(model_type):
            raise UnknownModelError(f"{root} (transformers model_type {model_type!r}): {reason}")
    known = sorted(t for f in families for t in getattr(f, "model_types", ()))
    raise UnknownModelError(
        f"no Spindle family serves {root} (transformers model_type {model_type!r}); "
        f"known model types: {', '.join(known) or 'none'}"
    )


def _is_diffusers_pipeline(class_name: str) -> bool:
    """`class_name` names a pipeline class of the installed diffusers (not a local, renamed one)."""
    import diffusers

    try:
        cls = getattr(diffusers, class_name)
    except (AttributeError, ImportError):  # unknown name, or a pipeline whose optional dependency is missing
        return class_name in getattr(diffusers, "_import_structure", {}).get("pipelines", ())
    return isinstance(cls, type) and issubclass(cls, diffusers.DiffusionPipeline)


def resolve_family(root: str | Path) -> Family:
    """Find the family serving a checkpoint folder.

    A diffusers pipeline folder (model_index.json): pipeline `_class_name` (among families serving the same
    class, the one whose `variant` accepts the folder, else the base one); a diffusers pipeline class
    no family serves is refused here, before any weight loads; a class diffusers does not know (a
    renamed or hand-assembled local folder) falls back to the transformer's `_class_name`, then to each
    family's detector.
    A transformers folder (config.json with `model_type`): the family declaring that model type.
    """
    root = Path(root)
    index_path = model_index_path(root)
    if not root.is_dir():
        raise FileNotFoundError(
            f"model path {root} does not exist (expected a diffusers pipeline folder or a transformers model folder)"
        )
    if not has_model_index(root):
        if (root / "config.json").is_file():
            return _resolve_transformers_folder(root)
        # an exported LoRA (or a LoRA run's export/, holding lora/) given where a model goes: say how to use it
        lora = next((f for f in (root, root / "lora") if is_lora_folder(f)), None)
        if lora is not None:
            raise FileNotFoundError(lora_usage(lora, read_export_record(lora).get("base_model")))
        raise FileNotFoundError(
            f"{index_path} not found: model.path must be a diffusers pipeline folder (model_index.json) or a "
            "transformers model folder (config.json with model_type)"
        )
    index = read_model_index(root)
    pipeline_cls = index.get("_class_name")
    tcfg_path = root / "transformer" / "config.json"
    transformer_cls = _read_json(tcfg_path).get("_class_name") if tcfg_path.is_file() else None
    families = all_families()
    dit = [f for f in families if isinstance(f, DiTFamily)]
    serving = [f for f in dit if pipeline_cls == f.checkpoint.pipeline]
    if serving:
        variant = [f for f in serving if f.checkpoint.variant is not None and f.checkpoint.variant(index)]
        return (variant or [f for f in serving if f.checkpoint.variant is None] or serving)[0]
    if isinstance(pipeline_cls, str) and _is_diffusers_pipeline(pipeline_cls):
        # A real diffusers pipeline that no family serves (e.g. WanVideoToVideoPipeline around a
        # WanTransformer3DModel) must not fall through to a family matched by its transformer: that family
        # would build the wrong inputs and fail late, after loading every weight.
        supported = sorted({f.checkpoint.pipeline for f in dit})
        raise UnknownModelError(
            f"{root}: diffusers pipeline class {pipeline_cls!r} is not served by Spindle; supported pipeline "
            f"classes: {', '.join(supported)}"
        )
    for fam in dit:
        if transformer_cls == fam.checkpoint.transformer:
            return fam
    for fam in dit:
        if fam.checkpoint.detect is not None and fam.checkpoint.detect(root):
            return fam
    known = ", ".join(f"{f.name} ({f.checkpoint.pipeline}, {f.checkpoint.transformer})" for f in dit)
    raise UnknownModelError(
        f"no Spindle family serves {root} (pipeline class {pipeline_cls!r}, transformer class "
        f"{transformer_cls!r}); known families: {known}"
    )


def dit_family_of(path: str | Path, name: str | None = None) -> DiTFamily:
    """The DiT family of a diffusers pipeline folder (or the one named), for the inference engine."""
    family = family_of(path, name)
    if not isinstance(family, DiTFamily):
        raise UnknownModelError(
            f"{path} is a {family.name} {family.kind} model: Spindle's generate/serve engine runs diffusion models "
            "only; load the folder with transformers (AutoModelForCausalLM.from_pretrained) to generate text"
        )
    return family
