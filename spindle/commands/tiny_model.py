"""Write a tiny random checkpoint in the family's standard layout.

DiT families (wan, flux): a diffusers pipeline folder that stock diffusers loads
(`WanPipeline.from_pretrained(OUT)`). Language models (qwen3, llama, qwen3_moe, deepseek_v3, gpt_oss): a ~1M-parameter
transformers folder with a byte-level BPE tokenizer (any UTF-8 text round-trips, no <unk>) carrying the family's special
tokens and chat template (Qwen3: <|im_start|>/<|im_end|> turns, <think> handling; Llama 3:
<|begin_of_text|>, <|start_header_id|> turns, <|eot_id|>; DeepSeek-V3: <｜begin▁of▁sentence｜>, <｜User｜> /
<｜Assistant｜> turns, <｜end▁of▁sentence｜>; GPT-OSS: harmony <|start|>role<|message|>...<|end|> messages, the
assistant's final channel ending <|return|>) (`AutoModelForCausalLM.from_pretrained(OUT)`).
Tests, the demo and the benchmarks use them because real weights cannot be downloaded here.
"""

from __future__ import annotations

import argparse
import json

HELP = "write a tiny random checkpoint (diffusers or transformers folder) for tests and the demo"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from spindle.registry import family_names

    p.add_argument("family", choices=family_names(), help="model family")
    p.add_argument("out", help="output folder (a diffusers pipeline folder / a transformers model folder)")
    p.add_argument("--seed", type=int, default=0, help="seed for the random weights (default 0)")
    p.add_argument(
        "--transformer",
        type=json.loads,
        default=None,
        metavar="JSON",
        help="overrides for the transformer's config, e.g. '{\"num_layers\": 4}' (DiT), "
        "'{\"num_hidden_layers\": 2}' (language model)",
    )


def run(args: argparse.Namespace) -> int:
    from spindle.contracts.family import import_object
    from spindle.registry import get_family

    family = get_family(args.family)
    builder = import_object(family.required_code("tiny_model"))
    out = builder(args.out, seed=args.seed, transformer=args.transformer)
    print(f"wrote tiny {args.family} checkpoint to {out}")
    return 0
