"""How much of a VLM training step is the vision tower: forward FLOPs of the vision tower per image and of
the language model per row, counted by torch's FlopCounterMode on the real transformers modules built
with fake tensors (Qwen2.5-VL-7B's shape from bench/train_vlm.py; no weight is allocated or downloaded).

Why: under `parallel.sp` the language model is split over the SP ranks; a vision tower run whole on every
rank would be duplicated work. This prints that work's share of a rank's step, per image size and images
per row (what spindle/distributed/vision_sequence_parallel.py splits: the blocks, their attention by an
all-to-all over the heads; bench/vision_sp.py measures it). Backward is ~2x forward for both parts, so the forward ratio is the step's.

    python bench/vlm_vision_share.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> None:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoConfig, AutoModelForImageTextToText

    from bench.train_vlm import PRESETS

    p = PRESETS["qwen2.5-vl-7b"]
    vision = {"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, **p["vision"]}
    config = AutoConfig.for_model(
        "qwen2_5_vl", text_config=p["text"], vision_config={**vision, "out_hidden_size": p["text"]["hidden_size"]}
    )
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    language = model.model.language_model

    def flops(fn) -> int:
        counter = FlopCounterMode(display=False)
        with fake, counter, torch.no_grad():
            fn()
        return counter.get_total_flops()

    seq = 8192
    with fake:
        embeds = torch.empty(1, seq, p["text"]["hidden_size"], dtype=torch.bfloat16)
        positions = torch.zeros(3, 1, seq, dtype=torch.long)
    lm = flops(lambda: language(inputs_embeds=embeds, position_ids=positions, use_cache=False))
    text = p["text"]
    lm += 2 * seq * text["hidden_size"] * text["vocab_size"]  # the head (not part of the decoder)
    # FlopCounterMode counts no CPU sdpa kernel: attention's two matmuls (4 S^2 H D), causal (half), per layer
    lm += text["num_hidden_layers"] * 2 * seq**2 * text["hidden_size"]
    patch_dim = 3 * 2 * 14 * 14

    def tower_flops(depth: int, full: list[int], h: int, w: int) -> int:
        """The tower's forward FLOPs at `depth` blocks (`full`: the full-attention ones), run for real: its
        window and sequence lengths come from the grid's values, which fake tensors do not carry."""
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        sub = type(config.vision_config)(
            **{**config.vision_config.to_dict(), "depth": depth, "fullatt_block_indexes": full}
        )
        tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(sub, dtype=torch.float32)
        grid = torch.tensor([[1, h, w]])
        pixels = torch.zeros(h * w, patch_dim)
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            tower(pixels, grid_thw=grid)
        return counter.get_total_flops()

    depth, full = p["vision"]["depth"], p["vision"]["fullatt_block_indexes"]
    rows = []
    for merged_tokens, (h, w) in ((256, (32, 32)), (1280, (64, 80))):  # grid in patches (h, w): 4 patches/token
        base = tower_flops(0, [], h, w)  # patch embedding + merger
        window = tower_flops(1, [], h, w) - base
        full_block = tower_flops(1, [0], h, w) - base
        v = base + (depth - len(full)) * window + len(full) * full_block
        # attention (uncounted on CPU, as above): windows of (window_size / patch_size)^2 patches, or the image
        n, hidden, per_window = h * w, p["vision"]["hidden_size"], (p["vision"]["window_size"] // 14) ** 2
        v += (depth - len(full)) * 4 * n * per_window * hidden + len(full) * 4 * n**2 * hidden
        for images in (1, seq // merged_tokens):
            share = images * v / (images * v + lm)
            rows.append(
                dict(
                    merged_tokens_per_image=merged_tokens,
                    images_per_row=images,
                    vision_tflops=round(images * v / 1e12, 2),
                    language_tflops=round(lm / 1e12, 2),
                    vision_share_sp1=round(share, 3),
                    # at sp=N every rank runs the whole tower and 1/N of the language model
                    vision_share_sp2=round(images * v / (images * v + lm / 2), 3),
                    vision_share_sp4=round(images * v / (images * v + lm / 4), 3),
                )
            )
    print(json.dumps(dict(model="Qwen2.5-VL-7B shape", seq_len=seq, rows=rows), indent=2))


if __name__ == "__main__":
    main()
