"""Gemma 3 beyond the causal-LM conformance suite: the tiny tokenizer carries Gemma's turn tokens and chat
template (the assistant is "model", a system message folds into the first user turn), the image-text checkpoints
are refused at detection naming why. Ulysses SP (sliding-window layers included) is the conformance suite's `sp2`."""

from __future__ import annotations

import json
import shutil

import pytest


def test_tiny_tokenizer_has_gemma_turns_and_template(tiny_checkpoint):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint("gemma3"))
    text = tok.apply_chat_template(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"},
        ],
        tokenize=False,
    )
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\nyo<end_of_turn>\n"
    assert tok("a")["input_ids"][0] == tok.bos_token_id and tok.eos_token == "<eos>"


def test_an_image_text_checkpoint_is_refused_naming_why(tiny_checkpoint, tmp_path):
    from spindle.registry import UnknownModelError, resolve_family

    folder = tmp_path / "gemma3-vlm"
    shutil.copytree(tiny_checkpoint("gemma3"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gemma3"}))
    with pytest.raises(UnknownModelError, match=r"Gemma3ForConditionalGeneration .*not trained by Spindle yet"):
        resolve_family(folder)
