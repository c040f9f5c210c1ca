"""Ulysses sequence parallelism for Gated DeltaNet linear-attention layers (Qwen3.5, Qwen3.5-MoE).

A Gated DeltaNet layer (transformers' `Qwen3_5GatedDeltaNet`) projects each token to queries/keys (`num_k_heads`
heads), values and an output gate (`num_v_heads` heads), and per-head `beta` (write strength) and `g` (log
decay); then a short depthwise causal convolution and the gated delta-rule recurrence run along the sequence,
per head; the gated RMSNorm and the output projection are per token again. Under Ulysses each rank holds a
contiguous chunk of the sequence (spindle/distributed/ulysses_attention.py), so, like softmax attention:

    per token, on this rank's chunk: projections, beta, g          [B, S/sp, H, D]
    all-to-all: q, k, v, beta, g                                   -> [B, H/sp, S, D] (whole sequence, H/sp heads)
    the convolution (this rank's channels of its weight) and the delta rule over the whole sequence
    all-to-all back                                                -> [B, S/sp, H, D]
    per token: gated norm, output projection

The depthwise convolution has one filter per channel (the q, k and v channels of each head), so a rank runs
the filters of the channels of its heads: the rows of `conv1d.weight` it slices, whose gradients sum over the
SP ranks like every other parameter's. When `sp` does not divide the key heads, the q/k heads are repeated
first (`kv_repeat`: each value head keeps reading the key head it reads on one process), and their filters
with them. The convolution and the recurrence are the model's own functions (`conv`, `delta_rule`: the
generated module's `causal_conv1d_fn` and `torch_chunk_gated_delta_rule`), so the kernels are the one-process
path's. Training rows only: no cache (generation runs on one process's full rows), no packing (the layers take
no document boundaries: data.packing is refused for these models).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from spindle.distributed.ulysses_attention import (
    LINEAR_HEADS,
    SequenceParallelContext,
    heads_to_seq,
    kv_repeat,
    seq_to_heads,
)


def _conv_channels(module: Any, repeat: int, rank: int, sp: int) -> torch.Tensor:
    """The rows of the layer's conv1d weight (channels laid out q | k | v, head by head) that this rank's heads
    use, in the order of its local q | k | v channels; q/k heads repeated `repeat` times."""
    k_heads = module.num_k_heads * repeat // sp  # this rank's (repeated) key heads
    v_heads = module.num_v_heads // sp
    dk, dv = module.head_k_dim, module.head_v_dim
    device = module.conv1d.weight.device
    # repeated key head j is the model's head j // repeat
    heads = torch.arange(rank * k_heads, (rank + 1) * k_heads, device=device) // repeat
    qk = (heads[:, None] * dk + torch.arange(dk, device=device)).flatten()
    v = torch.arange(rank * v_heads * dv, (rank + 1) * v_heads * dv, device=device) + 2 * module.key_dim
    return torch.cat([qk, qk + module.key_dim, v])


def gated_deltanet_forward(
    module: Any,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None,
    ctx: SequenceParallelContext,
    *,
    conv: Callable[..., torch.Tensor],
    delta_rule: Callable[..., tuple[torch.Tensor, Any]],
) -> torch.Tensor:
    """A Gated DeltaNet layer's forward on this rank's `[B, S/sp, hidden]` chunk, the convolution and the
    recurrence over the whole sequence of the SP group (module docstring); `attention_mask`: the 2-D padding
    mask of the chunk (transformers' `create_recurrent_attention_mask`) or None."""
    sp, group = ctx.size, ctx.group
    if attention_mask is not None:  # upstream's apply_mask_to_padding_states: padding tokens zeroed
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    batch, chunk, _ = hidden_states.shape
    repeat = kv_repeat(module.num_v_heads, module.num_k_heads, sp, LINEAR_HEADS)
    dk, dv = module.head_k_dim, module.head_v_dim

    q, k, v = module.in_proj_qkv(hidden_states).split([module.key_dim, module.key_dim, module.value_dim], dim=-1)
    q, k = (t.reshape(batch, chunk, module.num_k_heads, dk).repeat_interleave(repeat, dim=2) for t in (q, k))
    v = v.reshape(batch, chunk, module.num_v_heads, dv)
    z = module.in_proj_z(hidden_states).reshape(batch, chunk, module.num_v_heads, dv)
    beta = module.in_proj_b(hidden_states).sigmoid()
    # If the model is loaded in fp16, without the .float() here, A might be -inf (upstream's comment)
    g = -module.A_log.float().exp() * F.softplus(module.in_proj_a(hidden_states).float() + module.dt_bias)

    # [B, S/sp, H, D] -> [B, H/sp, S, D]: the whole sequence of this rank's heads
    q, k, v, beta, g = (
        seq_to_heads(t.transpose(1, 2), group, sp) for t in (q, k, v, beta.unsqueeze(-1), g.unsqueeze(-1))
    )
    seq = q.shape[2]
    local = [t.transpose(1, 2).reshape(batch, seq, -1) for t in (q, k, v)]  # [B, S, channels]
    widths = [t.shape[-1] for t in local]
    weight = module.conv1d.weight.squeeze(1)[_conv_channels(module, repeat, ctx.rank, sp)]
    bias = None if module.conv1d.bias is None else module.conv1d.bias[_conv_channels(module, repeat, ctx.rank, sp)]
    mixed = conv(torch.cat(local, dim=-1).transpose(1, 2), weight, bias, activation=module.activation)
    q, k, v = mixed.transpose(1, 2).split(widths, dim=-1)
    out, _ = delta_rule(
        q.reshape(batch, seq, -1, dk),
        k.reshape(batch, seq, -1, dk),
        v.reshape(batch, seq, -1, dv),
        g=g.squeeze(-1).transpose(1, 2),
        beta=beta.squeeze(-1).transpose(1, 2),
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=True,
    )
    out = heads_to_seq(out, group, sp)  # [B, S, H/sp, dv] -> [B, S/sp, H, dv]
    out = module.norm(out.reshape(-1, dv), z.reshape(-1, dv)).reshape(batch, chunk, -1)
    result: torch.Tensor = module.out_proj(out)
    return result
