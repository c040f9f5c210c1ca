"""Gemma 3 beyond the causal-LM conformance suite: the tiny tokenizer carries Gemma's turn tokens and chat
template (the assistant is "model", a system message folds into the first user turn). Ulysses SP (sliding-window
layers included) is the conformance suite's `sp2`. The image-text checkpoints are the gemma3_vl family's
(tests/models/test_gemma3_vl.py)."""

from __future__ import annotations


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
