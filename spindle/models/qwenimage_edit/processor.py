"""The Qwen2-VL processor of Qwen-Image-Edit checkpoints, built without torchvision.

`QwenImageEditPipeline` / `QwenImageEditPlusPipeline` take a `transformers.Qwen2VLProcessor` (the
checkpoint's `processor/` folder: tokenizer files + `preprocessor_config.json`). transformers refuses
to construct one without torchvision: `Qwen2VLProcessor.from_pretrained` also loads the video
processor (`Qwen2VLVideoProcessor`, torchvision only), and its constructor checks every sub-processor
it declares. Spindle never depends on torchvision, so `load_processor` assembles the same processor
from the folder's tokenizer and the PIL backend of Qwen2-VL's image processor
(`Qwen2VLImageProcessorPil`), as an image-only subclass (no video processor declared). Its `__call__`
is `Qwen2VLProcessor`'s: the text with each `<|image_pad|>` expanded to the image's token count, the
patches and `image_grid_thw`.

The PIL backend is also what the stock processor uses where torchvision is missing; with torchvision
installed, transformers picks the torchvision ("fast") backend, whose resize differs from PIL's in the
last bits, so the pixel values (and the output) can differ slightly from a run here. The reference
runs of the tests are the stock pipeline given this processor: `stock_components`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import Qwen2VLProcessor


class ImageQwen2VLProcessor(Qwen2VLProcessor):
    """`Qwen2VLProcessor` for images only: the same `__call__`, no video processor (which needs torchvision)."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None, **kw: Any):
        # ProcessorMixin reads the sub-processors from this signature: image_processor and tokenizer only
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kw)


def load_processor(path: str | Path) -> ImageQwen2VLProcessor:
    """A checkpoint's `processor/` folder -> its processor (tokenizer + Qwen2-VL PIL image processor)."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    path = Path(path)
    if not (path / "preprocessor_config.json").is_file():
        raise FileNotFoundError(
            f"{path}/preprocessor_config.json not found: a Qwen-Image-Edit checkpoint's processor folder holds the "
            "tokenizer and the Qwen2-VL image processor config"
        )
    return ImageQwen2VLProcessor(Qwen2VLImageProcessorPil.from_pretrained(path), AutoTokenizer.from_pretrained(path))


def stock_components(root: str | Path) -> dict[str, Any]:
    """`from_pretrained` overrides that let stock diffusers load a Qwen-Image-Edit folder here: the
    processor assembled by `load_processor` (everything else is loaded by diffusers as usual)."""
    return {"processor": load_processor(Path(root) / "processor")}


def save_processor(out: Path, tokenizer_dir: Path, image_processor: dict[str, Any]) -> None:
    """Write a `processor/` folder as real Qwen-Image-Edit checkpoints ship it: the tokenizer's files and
    the Qwen2-VL image processor's `preprocessor_config.json` (`image_processor`: its fields)."""
    import shutil

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out.mkdir(parents=True, exist_ok=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy2(f, out / f.name)
    Qwen2VLImageProcessorPil(**image_processor).save_pretrained(out)
    config = out / "preprocessor_config.json"
    text = config.read_text().replace('"Qwen2VLImageProcessorPil"', '"Qwen2VLImageProcessor"')
    config.write_text(text)  # the class real checkpoints name (transformers maps it to the backend it has)
