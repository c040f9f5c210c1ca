"""A VLM export loads in stock transformers as installed here (no torchvision), issue 43: the code block
docs/training.md documents (tokenizer + PIL image processor, `<|image_pad|>` expanded) runs as written on
a trained export and generates from the image (a different image gives other logits: it is not dropped)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from PIL import Image

from spindle.testing.vlm_conformance import subset
from tests.conftest import vlm_train

DOC = Path(__file__).resolve().parents[2] / "docs" / "training.md"


def documented_block() -> str:
    match = re.search(r"<!-- vlm-stock-load -->\n```python\n(.*?)```", DOC.read_text(), re.S)
    assert match, "docs/training.md lost its vlm-stock-load block"
    return match.group(1)


def test_the_documented_stock_load_of_a_vlm_export_generates_from_the_image(
    tiny_qwen2_5_vl, vlm_conversations, tmp_path
):
    _, result = vlm_train(
        tiny_qwen2_5_vl, subset(vlm_conversations, tmp_path / "data", [0, 1]), tmp_path / "run", train__max_steps=1
    )
    block = documented_block().replace('"outputs/vlm-run/export"', repr(str(result.export_dir)))
    check = (
        "\nimport torch\n"
        "with torch.no_grad():\n"
        "    logits = model(**inputs, **vision).logits\n"
        "    other = image_processor(images=[Image.new('RGB', picture.size, (0, 90, 250))], return_tensors='pt')\n"
        "    assert (model(**inputs, **other).logits - logits).abs().max() > 1e-6, 'the image changed nothing'\n"
        "assert output.shape[1] > inputs['input_ids'].shape[1]\n"
        "import sys\n"
        "assert 'torchvision' not in sys.modules, 'the documented path must not need torchvision'\n"
        "print('IMAGE-USED')\n"
    )
    Image.new("RGB", (56, 56), (200, 40, 40)).save(tmp_path / "picture.png")
    script = tmp_path / "load.py"
    script.write_text(block + check)
    proc = subprocess.run([sys.executable, script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "IMAGE-USED" in proc.stdout
