"""Tokenizers built locally for the tiny checkpoints, saved in the Hugging Face `tokenizer.json` layout.

Real checkpoints ship trained tokenizers; tiny test checkpoints cannot download one. The DiT text
encoders (T5, CLIP, Qwen-Image's prompt encoder) get a deterministic word-level vocabulary covering
the demo captions and common English, with an <unk> fallback. The language models get byte-level BPE
(`build_byte_level_bpe`), as the real Qwen and Llama 3 tokenizers are: any text round-trips. Both
load through `transformers.AutoTokenizer` like any other fast tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

COMMON_WORDS = """
a an the of and or in on at to from with by for over under up down left right top bottom
red green blue yellow orange purple pink white black gray cyan magenta brown
circle square triangle box ball shape shapes dot disk star line
moves moving move slides sliding drifts drifting goes going bounces bouncing across toward towards
fast slow small big large tiny bright dark background foreground scene video image photo picture
cat dog bird fish car tree house sky sea sun moon mountain river city street person man woman child
is are was be it this that its one two three four five many some very while then
low quality blurry worst bad ugly static still frame frames camera view
""".split()

SPECIALS = ["<pad>", "</s>", "<unk>"]


def build_vocab(extra_words: list[str] | None = None, bos_token: str | None = None) -> dict[str, int]:
    """Special tokens first (T5 ids: pad=0, eos=1, unk=2; a bos token, if any, is 3), then words,
    then single characters."""
    words = list(dict.fromkeys(COMMON_WORDS + (extra_words or [])))
    chars = [c for c in "abcdefghijklmnopqrstuvwxyz0123456789.,!?'-" if c not in words]
    specials = SPECIALS + ([bos_token] if bos_token else [])
    return {tok: i for i, tok in enumerate(specials + words + chars)}


def build_tokenizer(extra_words: list[str] | None = None, bos_token: str | None = None) -> Tokenizer:
    """T5-style (`$A </s>`) by default; with `bos_token`, CLIP-style (`<bos> $A </s>`): CLIPTextModel
    pools the hidden state at the first eos, so every sequence must carry one."""
    vocab = build_vocab(extra_words, bos_token)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace()])
    if bos_token:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A </s>", special_tokens=[(bos_token, vocab[bos_token]), ("</s>", 1)]
        )
    else:
        tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tok.decoder = decoders.WordPiece(prefix="##")
    return tok


# Words of the tests' and demo's chats (in the byte-level vocabularies' training text).
CHAT_WORDS = [
    "system",
    "user",
    "assistant",
    "you",
    "what",
    "colour",
    "shape",
    "which",
    "way",
    "does",
    "say",
    "yes",
    "no",
]


def save_tokenizer(out: Path, model_max_length: int = 512, bos_token: str | None = None) -> int:
    """Write tokenizer.json + tokenizer_config.json into `out`; returns the vocabulary size."""
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(bos_token=bos_token)
    tok.save(str(out / "tokenizer.json"))
    specials = {"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}
    if bos_token:
        specials["bos_token"] = bos_token
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        **specials,
        "padding_side": "right",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))
    return tok.get_vocab_size()


# what a Qwen prompt tokenizer isolates besides words: each newline and each punctuation mark
QWEN_PROMPT_SPLIT = r"\n|[^\w\s]"


def save_qwen_prompt_tokenizer(
    out: Path,
    special_tokens: list[str],
    pad_token: str,
    extra_words: list[str] | None = None,
    split: str = QWEN_PROMPT_SPLIT,
) -> int:
    """A chat-template tokenizer (Qwen style) written into `out`; returns the vocabulary size.

    Unlike the T5/CLIP ones: no bos/eos added, the chat markers in `special_tokens` are single
    tokens, and every word, punctuation mark and newline is one token, so a template's prefix has a
    known token count (Qwen-Image drops the first 34 hidden states, which is exactly its template's
    system prefix tokenized this way and by the real Qwen2 tokenizer). `split`: the regex of the
    pieces isolated besides whitespace-separated words (a piece it matches must be in `extra_words`
    unless it is one character).
    """
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_vocab(["\n", ":", *(extra_words or [])])
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"[ \t]+"), behavior="removed"),
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
        ]
    )
    tok.add_special_tokens([*special_tokens, pad_token])
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(out / "tokenizer.json"))
    specials = {"pad_token": pad_token, "unk_token": "<unk>"}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 131072,
        **specials,
        "padding_side": "right",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))
    return tok.get_vocab_size()


# ---------------------------------------------------------------- byte-level BPE (language models)

# What the tiny byte-level vocabularies are trained on: the demo/test vocabulary as sentences, so the
# tiny models' data is a few tokens per word (like a real tokenizer on English) while any other text
# still encodes, byte by byte.
# Each word both after a space (" red") and at the start of a text or line ("red").
BPE_CORPUS = [" ".join(COMMON_WORDS + CHAT_WORDS), "\n".join(COMMON_WORDS + CHAT_WORDS), "Hello, world! It is 1 2 3."]


def build_byte_level_bpe(
    special_tokens: list[str],
    added_tokens: list[str] = (),  # type: ignore[assignment]
    vocab_size: int = 2048,
    bos_token: str | None = None,
) -> Tokenizer:
    """A GPT-2-style byte-level BPE tokenizer, as the Qwen and Llama 3 families ship: every UTF-8 string
    encodes (the 256 byte symbols are in the vocabulary, so there is no <unk>) and decodes back exactly
    (no normaliser). The merges are trained on `BPE_CORPUS` up to `vocab_size`.

    `special_tokens` come first in the vocabulary (ids 0..) and are skipped by decode(skip_special_tokens);
    `added_tokens` are single tokens that stay in decoded text (Qwen3's <think>). With `bos_token`,
    `tokenizer(text)` prepends it (Llama 3's `<|begin_of_text|> $A`). Shared by the LLM families'
    `tiny.py` (one builder for every byte-level tiny tokenizer; a VLM's can reuse it)."""
    from tokenizers import AddedToken, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(BPE_CORPUS, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    if bos_token:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A", special_tokens=[(bos_token, tok.token_to_id(bos_token))]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def save_byte_level_tokenizer(
    out: Path,
    special_tokens: list[str],
    chat_template: str,
    specials: dict[str, str | None],
    added_tokens: list[str] = (),  # type: ignore[assignment]
    model_max_length: int = 2048,
) -> Tokenizer:
    """`build_byte_level_bpe` written into `out` as tokenizer.json + tokenizer_config.json with the chat
    template and the special-token roles in `specials` (bos_token, eos_token, pad_token: token or None)."""
    out.mkdir(parents=True, exist_ok=True)
    tok = build_byte_level_bpe(special_tokens, added_tokens, bos_token=specials.get("bos_token"))
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        **specials,
        "padding_side": "right",
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tok
