"""The MoE router's load-balancing (aux) loss from router statistics that can be reduced over ranks.

transformers' `load_balancing_loss_func` (Switch Transformer eqs. 4-6, as Qwen3-MoE defines it) is a
function of three sums over every token of the micro-batch and every MoE layer:

    C_e = top-k assignments routed to expert e      (counts: no gradient)
    P_e = router probabilities of expert e            (differentiable)
    N   = tokens (rows of the router logits), x layers

    aux = num_experts * sum_e (C_e / N) * (P_e / N)

With sequence parallelism each rank of an SP group holds a slice of every row's tokens, so its own
sums cover a slice only: `router_statistics` computes this rank's sums (padding masked out as
upstream does with `attention_mask`), and `load_balancing_loss` all-reduces them over the SP group
before the formula, the probability sums through a *differentiable* all-reduce (its backward sums
every rank's gradient of the shared aux value, so each rank's router gets the whole row's gradient
for its own tokens). Without a group it is transformers' value on the local tokens (parity tested).

Pure torch: the patched transformers forward (spindle/models/qwen3_moe/generated/) and the MoE task's
expert-load metric (spindle/train/parts/experts.py) both use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class RouterStatistics:
    counts: torch.Tensor  # [layers, experts] float32 top-k assignments per layer (no grad)
    prob_sum: torch.Tensor  # [experts] float32 router probabilities summed over tokens and layers (grad)
    tokens: torch.Tensor  # [] float32 routed tokens summed over layers (padding excluded)


def router_statistics(
    gate_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int, mask: torch.Tensor | None = None
) -> RouterStatistics:
    """This rank's sums over the router logits of every MoE layer (`[tokens, experts]` each);
    `mask`: [rows, seq] (1 = real token, 0 = padding) in the logits' token order, or None (all real)."""
    device = gate_logits[0].device
    flat = None if mask is None else mask.reshape(-1).to(device=device, dtype=torch.float32)
    counts, prob_sum = [], torch.zeros(num_experts, dtype=torch.float32, device=device)
    for logits in gate_logits:
        probs = torch.softmax(logits.to(device).float(), dim=-1)
        selected = torch.topk(probs, top_k, dim=-1).indices.reshape(-1)
        weight = torch.ones_like(selected, dtype=torch.float32) if flat is None else flat.repeat_interleave(top_k)
        counts.append(torch.zeros(num_experts, dtype=torch.float32, device=device).scatter_add_(0, selected, weight))
        prob_sum = prob_sum + (probs.sum(dim=0) if flat is None else (probs * flat.unsqueeze(-1)).sum(dim=0))
    per_layer = torch.tensor(float(gate_logits[0].shape[0]), device=device) if flat is None else flat.sum()
    return RouterStatistics(torch.stack(counts).detach(), prob_sum, per_layer * len(gate_logits))


def load_balancing_loss(
    gate_logits: tuple[torch.Tensor, ...] | None,
    num_experts: int,
    top_k: int,
    mask: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """transformers' `load_balancing_loss_func` over the tokens of every rank of `group` (None: this
    rank's tokens only). Collective over `group`."""
    if gate_logits is None or not isinstance(gate_logits, tuple):
        return torch.zeros(())  # as upstream (which returns 0): no router logits, no aux loss
    stats = router_statistics(gate_logits, num_experts, top_k, mask)
    counts, prob_sum, tokens = stats.counts.sum(dim=0), stats.prob_sum, stats.tokens
    if group is not None and dist.get_world_size(group) > 1:
        from torch.distributed import _functional_collectives as funcol

        counts_tokens = torch.cat([counts, tokens.reshape(1)])
        dist.all_reduce(counts_tokens, group=group)
        counts, tokens = counts_tokens[:-1], counts_tokens[-1]
        prob_sum = funcol.all_reduce(prob_sum, "sum", group)  # autograd: backward all-reduces the gradient
    return num_experts * torch.sum((counts / tokens) * (prob_sum / tokens))
