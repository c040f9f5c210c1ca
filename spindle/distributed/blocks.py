"""The repeated transformer blocks of a model, and regional compilation over them: one helper for
training (spindle.distributed.parallelize) and inference (spindle.infer.pipeline).

No model-library import: the blocks are found from the model's own declarations.
"""

from __future__ import annotations

from torch import nn

_BLOCK_LIST_NAMES = ("blocks", "transformer_blocks", "single_transformer_blocks", "layers")


def find_blocks(model: nn.Module, names: tuple[str, ...] = ()) -> list[nn.Module]:
    """The repeated transformer blocks of a diffusers or transformers model, found generically (no per-family code).

    `names` (class names, from a `ParallelPlan.blocks`) if given; else the model's own declaration
    (`_no_split_modules` / `_repeated_blocks`: class names of the blocks); else the children of
    ModuleList attributes named like blocks. Outermost matches only.
    """
    declared = set(getattr(model, "_no_split_modules", None) or ()) | set(
        getattr(model, "_repeated_blocks", None) or ()
    )
    wanted = set(names) or declared
    blocks: list[nn.Module] = []
    if wanted:
        inside: set[int] = set()
        for module in model.modules():
            if id(module) in inside or module is model:
                continue
            if type(module).__name__ in wanted:
                blocks.append(module)
                inside.update(id(m) for m in module.modules())
    if not blocks:
        for attr in _BLOCK_LIST_NAMES:
            children = getattr(model, attr, None)
            if isinstance(children, nn.ModuleList):
                blocks.extend(children)
    if not blocks:
        raise ValueError(
            f"cannot find the transformer blocks of {type(model).__name__}: it declares no `_no_split_modules` and has "
            f"no ModuleList named one of {_BLOCK_LIST_NAMES}"
        )
    return blocks


def compile_blocks(model: nn.Module, names: tuple[str, ...] = (), backend: str = "inductor") -> int:
    """Regional compilation: `torch.compile` each repeated block in place (`nn.Module.compile`, as
    diffusers' `compile_repeated_blocks` does), so parameter names stay unchanged (checkpoints,
    export) and one block's compiled code serves all of them. In training, after SP and activation
    checkpointing (the checkpoint wraps the compiled block) and before FSDP2 (dynamo skips FSDP2's
    hooks; torchtitan's order). -> the number of blocks compiled."""
    blocks = find_blocks(model, names)
    for block in blocks:
        block.compile(backend=backend)
    return len(blocks)
