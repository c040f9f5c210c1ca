"""FLUX.2-dev's `tokenizer/` component read without torchvision.

The checkpoint names a `transformers.PixtralProcessor` (Mistral's tokenizer + Pixtral's image processor).
transformers cannot import that class without torchvision (its module imports the torchvision image
processor), and Spindle never depends on torchvision. `Flux2Pipeline` only calls the component's
`apply_chat_template` on text-only conversations (the system message and the prompt), which the processor
renders with its chat template and tokenizes with its tokenizer (no special tokens added: the template
starts with bos). The folder's tokenizer does exactly that itself (`apply_chat_template(tokenize=True)` never
adds special tokens), with the same chat template file, so the component is loaded as that tokenizer: the
same token ids. Prompt upsampling (`caption_upsample_temperature`, which shows images to the text encoder)
needs the image processor and is not supported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_tokenizer(path: str | Path) -> Any:
    """A FLUX.2 `tokenizer/` folder -> its tokenizer with its chat template (FLUX.2-dev: the PixtralProcessor's)."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not (path / "tokenizer_config.json").is_file():
        raise FileNotFoundError(
            f"{path}/tokenizer_config.json not found: a FLUX.2-dev checkpoint's tokenizer folder holds the Mistral "
            "tokenizer and chat template of its PixtralProcessor"
        )
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.chat_template is None:
        raise ValueError(
            f"{path} has no chat template: FLUX.2-dev formats each prompt as a chat (system message + user)"
        )
    return tokenizer


def stock_components(root: str | Path) -> dict[str, Any]:
    """`from_pretrained` overrides that let stock diffusers load a FLUX.2-dev folder here: the tokenizer component
    read by `load_tokenizer` (everything else is loaded by diffusers as usual)."""
    return {"tokenizer": load_tokenizer(Path(root) / "tokenizer")}
