"""What an export folder records about how it was trained (`spindle.json`), and the LoRA model card.

A DiT export (`export/` pipeline, `export/lora/`, `export/merged/`) carries `spindle.json` beside its
weights: the family, the base model a LoRA was trained on, and `model.max_text_length`, the text
length the transformer saw in training. `spindle generate` / `spindle serve` use that length as the
default `max_sequence_length` (a request can still set its own), so samples match the run's
validation samples instead of using the family's inference default (512 tokens for most).
Torch-free: the registry (to explain a LoRA folder given as `--model`) and the engines read it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

EXPORT_RECORD = "spindle.json"
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"  # diffusers' default LoRA weight name


def write_export_record(folder: str | Path, **facts: Any) -> None:
    (Path(folder) / EXPORT_RECORD).write_text(json.dumps(facts, indent=2) + "\n")


def read_export_record(folder: str | Path | None) -> dict[str, Any]:
    """The folder's `spindle.json` ({} when there is none or it is unreadable: it is a hint, not a requirement)."""
    if folder is None:
        return {}
    path = Path(folder)
    path = (path.parent if path.is_file() else path) / EXPORT_RECORD
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def trained_text_length(model: str | Path | None, lora: str | Path | None = None) -> int | None:
    """The `model.max_text_length` a LoRA (first) or a pipeline was trained with, when its folder says."""
    for folder in (lora, model):
        value = read_export_record(folder).get("max_text_length")
        if isinstance(value, int) and value > 0:
            return value
    return None


def is_lora_folder(folder: str | Path) -> bool:
    folder = Path(folder)
    from spindle.model_index import has_model_index

    return (folder / LORA_WEIGHTS).is_file() and not has_model_index(folder)


def lora_usage(folder: str | Path, base: str | None) -> str:
    """The one-line fix for a LoRA folder given where a model is expected."""
    base_text = base or "BASE"
    return (
        f"{folder} is a LoRA ({LORA_WEIGHTS}), not a model: load it on the pipeline it was trained from, "
        f"e.g. `spindle generate --model {base_text} --lora {folder} ...`"
        + ("" if base else " (BASE: the diffusers pipeline folder the LoRA was trained on)")
        + "; or write the full folder with the LoRA fused: `spindle export RUN --out DIR --merge`"
    )


def write_lora_card(
    folder: str | Path,
    family: str,
    base: str,
    pipeline_class: str,
    max_text_length: int | None,
    lora_dir: str | None = None,
    media: str = "image",
    component: str = "transformer",
    images: int = 0,
    size: dict[str, int] | None = None,
    lora_loader: str | None = None,
    text_length_arg: bool = True,
) -> None:
    """README.md of an exported LoRA folder (`folder`, to be found at `lora_dir` once renamed): what it
    is, the base model, and the exact `spindle generate` / diffusers lines that use it, which run as
    written: `images` conditioning image files (image-to-video, editing) named `image.png` (`image1.png`
    ... for several) in both, and `size` (`height`, `width`, `num_frames`: what it was trained at)."""
    folder = Path(folder)
    where = lora_dir or str(folder)
    original = (folder / "original_layout_lora.safetensors").is_file()
    files = f"`{LORA_WEIGHTS}` (diffusers layout)" + (
        ", `original_layout_lora.safetensors` (the original/ComfyUI layout)" if original else ""
    )
    length = (
        f"Trained with text prompts of up to {max_text_length} tokens (`model.max_text_length`): `spindle "
        "generate` and `spindle serve` use that as the default `max_sequence_length`; pass the same to "
        "diffusers to get what the run's validation samples showed."
        if max_text_length
        else "The text length it was trained with is not recorded."
    )
    length_arg = f", max_sequence_length={max_text_length}" if max_text_length and text_length_arg else ""
    out_file = "sample.mp4" if media == "video" else "sample.png"
    files_in = ["image.png"] if images == 1 else [f"image{i + 1}.png" for i in range(images)]
    image_flags = "".join(f" --image {f}" for f in files_in)
    loaded = [f'load_image("{f}")' for f in files_in]
    image_arg = "" if not loaded else f", image={loaded[0] if images == 1 else '[' + ', '.join(loaded) + ']'}"
    sized = {k: v for k, v in (size or {}).items() if k != "num_frames" or media == "video"}
    size_flags = "".join(f" --{k.replace('_', '-')} {v}" for k, v in sized.items())
    size_arg = "".join(f", {k}={v}" for k, v in sized.items())
    import_image = "from diffusers.utils import load_image\n" if loaded else ""
    inputs = (
        f"\nThe commands take {images} conditioning image file(s) ({', '.join(f'`{f}`' for f in files_in)}: the "
        "first frame for image-to-video, the source for editing); put yours there or change the names.\n"
        if loaded
        else ""
    )
    trained_at = f"\nThe size given is the one it was trained at ({', '.join(f'{k} {v}' for k, v in sized.items())}).\n"
    trained_at = trained_at if sized else ""
    # a two-expert checkpoint's low-noise expert (Wan2.2 A14B): diffusers loads it there when told
    into = ", load_into_transformer_2=True" if component == "transformer_2" else ""
    load_line = f'pipe.load_lora_weights("{where}"{into})'
    if lora_loader is not None:  # a stock pipeline without LoRA loading (HunyuanVideo15Pipeline): its transformer's
        load_line = f'pipe.transformer.load_lora_adapter("{where}", prefix="transformer")'
    card = f"""# LoRA for {family} (trained with Spindle)

Base model: `{base}` (the diffusers pipeline folder this LoRA was trained on).
Files: {files}, `{EXPORT_RECORD}` (how it was trained).

{length}
{inputs}{trained_at}
## Spindle

```
spindle generate --model {base} --lora {where} --prompt "..."{image_flags}{size_flags} --out {out_file}
spindle serve --model {base} --lora {where}
```

## diffusers

```python
import diffusers
{import_image}
pipe = diffusers.{pipeline_class}.from_pretrained("{base}")
{load_line}
out = pipe(prompt="..."{image_arg}{size_arg}{length_arg})
```
"""
    (folder / "README.md").write_text(card)
