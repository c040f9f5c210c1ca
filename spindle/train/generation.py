"""Sampling completions from the model being trained (online objectives: GRPO's rollouts).

The policy generates on its live weights in the training processes: no second engine, no weight copy. Under
FSDP2 every rank runs the same number of forwards (a rank whose completions all ended keeps stepping until
every rank's have, or `max_new_tokens`), so the blocks' all-gathers pair up. The decoder runs with a KV cache
(transformers' `DynamicCache`), one token per forward after the prompt.

Each completion draws its tokens from its own generator, keyed on (seed, step, prompt, sample): the same
prompt gives the same completions whatever the layout, the rank or the micro-batch it lands in, and a resumed
run draws what the uninterrupted one did. The G completions of one prompt are generated together (same prompt
length: no padding inside the batch).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def rollout_generator(seed: int, step: int, prompt_index: int, sample: int) -> torch.Generator:
    """The RNG of one completion, keyed on (seed, step, the prompt's dataset index, the sample in its group)."""
    digest = hashlib.blake2b(f"{seed}:{step}:{prompt_index}:{sample}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


@dataclass
class Sampling:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0


def filter_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filtering of [rows, vocab] probabilities: the most likely tokens whose mass reaches `top_p` (the
    first always kept), renormalised."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the tokens ranked above each one
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)


@torch.no_grad()
def sample_group(
    model: torch.nn.Module,
    prompt_ids: list[int],
    generators: list[torch.Generator],
    sampling: Sampling,
    eos_ids: set[int],
    pad_id: int,
    device: torch.device,
    step_inputs: Callable[[int], dict[str, Any]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """len(generators) completions of one prompt. -> (token ids [G, T], mask [G, T]: 1 up to and including each
    completion's first end-of-sequence token, 0 after it, where `pad_id` fills). Collective over every process
    (they generate in lockstep: FSDP2's all-gathers pair up). The model must be in eval mode (a training-mode
    model with activation checkpointing refuses the cache). `step_inputs(t)`: the forward's other keyword
    arguments at step t (0: the prompt; a vision-language prompt's media and positions), none by default."""
    from transformers import DynamicCache

    rows = len(generators)
    ids = torch.tensor([prompt_ids] * rows, dtype=torch.long, device=device)
    # from the model's config: a sliding-window or hybrid (linear-attention) decoder gets its layers' own caches
    config = getattr(model, "config", None)
    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    out_tokens: list[torch.Tensor] = []
    done = torch.zeros(rows, dtype=torch.bool)
    step_input = ids
    for t in range(sampling.max_new_tokens):
        if _all_done(done, device):
            break
        extra = step_inputs(t) if step_inputs is not None else {}
        logits = model(input_ids=step_input, past_key_values=cache, use_cache=True, **extra).logits[:, -1]
        logits = logits.float().cpu()
        probs = filter_top_p(torch.softmax(logits / sampling.temperature, dim=-1), sampling.top_p)
        token = torch.stack([torch.multinomial(probs[i], 1, generator=g)[0] for i, g in enumerate(generators)])
        token = torch.where(done, torch.full_like(token, pad_id), token)
        out_tokens.append(token)
        done |= torch.isin(token, torch.tensor(sorted(eos_ids), dtype=torch.long))
        step_input = token.unsqueeze(1).to(device)
    if not out_tokens:
        empty = torch.zeros(rows, 0, dtype=torch.long)
        return empty, empty
    tokens = torch.stack(out_tokens, dim=1)
    mask = completion_mask(tokens, sorted(eos_ids)).long()
    return tokens.masked_fill(mask == 0, pad_id), mask


def _all_done(done: torch.Tensor, device: torch.device) -> bool:
    """Every rank's completions have ended (one small all-reduce per token under several processes)."""
    flag = torch.tensor([int(bool(done.all()))], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def completion_mask(completion_ids: torch.Tensor, eos_token_ids: list[int]) -> torch.Tensor:
    """[B, T] int mask of sampled completions [B, T]: 1 up to and including the first stop token, 0 after it (what
    was generated after a completion ended is never scored); a completion without one is kept whole (as TRL's
    GRPOTrainer masks its generations)."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=completion_ids.device))
    ended = is_eos.any(dim=1)
    eos_index = torch.full((is_eos.shape[0],), is_eos.shape[1], dtype=torch.long, device=completion_ids.device)
    eos_index[ended] = is_eos.int().argmax(dim=1)[ended]
    positions = torch.arange(is_eos.shape[1], device=completion_ids.device).expand(is_eos.shape[0], -1)
    return (positions <= eos_index.unsqueeze(1)).int()
