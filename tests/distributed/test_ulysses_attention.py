"""Ulysses SP attention for LLMs on 2 real processes (spawned, gloo) equals one process.

One spawn runs every case (process start-up with torch + transformers is the slow part on 2
cores); rank 0 saves what it gathered and the tests compare it with references computed here:

- the attention function alone vs transformers' single-process sdpa attention (forward and the
  gradients of q, k, v): causal, packed documents (reference: each document attended on its own),
  GQA with fewer KV heads than sp;
- a tiny stock `Qwen3ForCausalLM` whose SP ranks each compute the loss of their own chunk vs the
  same model on the whole row in one process (packed row: transformers' own packed-sequence mask
  from position_ids): the loss and every parameter's gradient (SP ranks' gradients summed).
Each runs with the dense-mask sdpa inner attention and with Spindle's varlen inner function
(spindle/ops/varlen_attention.py: the full row's position ids, attention per document, no mask).

The same for the layers that are not plain softmax attention, on Spindle's patched classes of the families
(packed rows where the family packs): GPT-OSS (per-head sinks, the rank's slice of them; a sliding-window
layer; eager attention), Gemma 3 (a sliding-window layer under sdpa), both through
spindle/ops/windowed_attention.py; Qwen3.5's Gated DeltaNet layer (spindle/distributed/ulysses_linear_attention.py:
heads split, the convolution and the recurrence over the whole sequence), with one key head repeated over the
two ranks.
"""

from __future__ import annotations

import functools
import itertools
from pathlib import Path

import pytest
import torch

from spindle.testing.multiprocess import spawn

SP = 2
B, S, D = 2, 12, 8
DOCS = (5, 4, 3)  # packed document lengths: borders fall inside and across the 2 chunks of 6 tokens
# case -> (query heads, kv heads, packed, inner attention run over the full sequence)
ATTN_CASES = {
    "causal": (4, 4, False, "sdpa"),
    "packed": (4, 4, True, "sdpa"),
    "gqa_kv1": (4, 1, True, "sdpa"),
    # document mask as a flex BlockMask; forward only: torch's flex attention has no backward on CPU
    "packed_flex": (4, 2, True, "flex_attention"),
    "packed_varlen": (4, 4, True, "spindle_varlen"),
    "gqa_kv1_varlen": (4, 1, True, "spindle_varlen"),
    "causal_varlen": (4, 2, False, "spindle_varlen"),
}
FORWARD_ONLY = {"packed_flex"}
# case -> (kv heads, packed, inner attention)
MODEL_CASES = {
    "model_causal": (2, False, "sdpa"),
    "model_packed_kv1": (1, True, "sdpa"),
    "model_packed_kv1_varlen": (1, True, "spindle_varlen"),
    "model_packed_varlen": (2, True, "spindle_varlen"),
}
VOCAB = 64
WINDOW = 4  # shorter than a rank's chunk: the window reaches across the chunk border
# family case -> (packed, inner attention); the models: `family_model`
FAMILY_CASES = {
    "gpt_oss_sinks_window_packed": (True, "eager"),
    "gemma3_window_packed": (True, "sdpa"),
    "qwen3_5_gated_deltanet_kv1": (False, "sdpa"),  # one key head: repeated over the 2 ranks
    "qwen3_5_gated_deltanet_kv2": (False, "sdpa"),
}


def packed_positions() -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in DOCS]).expand(B, S)


def attn_inputs(heads: int, kv_heads: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    return {
        "q": torch.randn(B, heads, S, D, generator=g),
        "k": torch.randn(B, kv_heads, S, D, generator=g),
        "v": torch.randn(B, kv_heads, S, D, generator=g),
        "w": torch.randn(B, S, heads, D, generator=g),  # loss weights on the [B, S, H, D] output
    }


def attention_module(heads: int, kv_heads: int):
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    config = Qwen3Config(hidden_size=heads * D, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=D)
    config._attn_implementation = "sdpa"
    return Qwen3Attention(config, layer_idx=0)


def small_qwen3_model(kv_heads: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=8,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    return Qwen3ForCausalLM(config).float()


def family_model(case: str):
    """A small model of Spindle's patched class for the family `case` names (seeded)."""
    from transformers import Gemma3TextConfig, GptOssConfig
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    torch.manual_seed(0)
    shape = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2}
    heads = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
    if case.startswith("gpt_oss"):
        from spindle.models.gpt_oss.generated.patched_modeling_gpt_oss import GptOssForCausalLM

        config = GptOssConfig(
            **shape,
            **heads,
            num_local_experts=2,
            num_experts_per_tok=1,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            attn_implementation="eager",
        )
        model = GptOssForCausalLM(config)
        with torch.no_grad():  # distinct sinks per head: a rank with another head's sink would differ
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, 4))
        return model.float()
    if case.startswith("gemma3"):
        from spindle.models.gemma3.generated.patched_modeling_gemma3 import Gemma3ForCausalLM

        config = Gemma3TextConfig(
            **shape,
            **heads,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=8,
            attn_implementation="sdpa",
        )
        return Gemma3ForCausalLM(config).float()
    from spindle.models.qwen3_5.generated.patched_modeling_qwen3_5 import Qwen3_5ForCausalLM

    config = Qwen3_5TextConfig(
        **shape,
        **heads,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=int(case[-1]),
        linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention"],
        attn_implementation="sdpa",
    )
    return Qwen3_5ForCausalLM(config).float()


def lm_batch(packed: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    input_ids = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = input_ids.clone()
    labels[0, :3] = -100  # uneven valid tokens across the chunks
    shift = torch.cat([labels[:, 1:], torch.full((B, 1), -100)], dim=1)
    position_ids = packed_positions() if packed else torch.arange(S).expand(B, S)
    if packed:  # no target across a document border
        ends = torch.tensor(DOCS).cumsum(0) - 1
        shift[:, ends] = -100
    return {"input_ids": input_ids, "position_ids": position_ids.clone(), "shift_labels": shift}


def lm_loss_sum(model, batch) -> torch.Tensor:
    # use_cache=False: with a cache, transformers skips its packed-sequence mask (masking_utils)
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), batch["shift_labels"].flatten(), ignore_index=-100, reduction="sum"
    )


def _worker(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from spindle.distributed.ulysses_attention import (
        SequenceParallelContext,
        enable_sequence_parallel,
        register,
        shard_batch,
        ulysses_attention_forward,
    )

    # transformers compiles flex attention and its block mask with torch.compile's default backend, inductor: on a
    # CPU with a cold cache ~10 s of C++ code generation per rank, PyTorch's own work. What these cases check is
    # Spindle's exchange around the inner attention, so this rank process compiles with aot_eager (dynamo and
    # AOTAutograd trace as under inductor; the traced ops run as they are), as the conformance compile check does.
    torch.compile = functools.partial(torch.compile, backend="aot_eager")  # type: ignore[assignment]
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    chunk = slice(rank * S // world, (rank + 1) * S // world)
    results: dict = {}

    def gather(t: torch.Tensor, dim: int) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, dim=dim)

    register()
    for name, (heads, kv_heads, packed, inner) in ATTN_CASES.items():
        module = attention_module(heads, kv_heads)
        module._spindle_sequence_parallel = SequenceParallelContext(
            group=mesh.get_group(), size=world, rank=rank, inner=inner
        )
        x = attn_inputs(heads, kv_heads)
        grads = name not in FORWARD_ONLY
        q, k, v = (x[n][:, :, chunk].clone().requires_grad_(grads) for n in "qkv")
        pos = (packed_positions() if packed else torch.arange(S).expand(B, S))[:, chunk]
        o, _ = ulysses_attention_forward(module, q, k, v, None, scaling=D**-0.5, position_ids=pos)
        results[name] = {"out": gather(o.detach(), 1)}
        if grads:
            (o * x["w"][:, chunk]).sum().backward()
            results[name].update({f"d{n}": gather(t.grad, 2) for n, t in zip("qkv", (q, k, v), strict=True)})

    for name, (kv_heads, packed, inner) in MODEL_CASES.items():
        model = small_qwen3_model(kv_heads)
        enable_sequence_parallel(model, mesh, inner=inner)
        local = shard_batch(lm_batch(packed), rank, world)
        loss = lm_loss_sum(model, local)
        loss.backward()
        dist.all_reduce(loss.detach())
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        for g in grads.values():
            dist.all_reduce(g)  # SP ranks' gradients sum to the row's gradient
        results[name] = {"loss": loss.detach(), "grads": grads}

    for name, (packed, inner) in FAMILY_CASES.items():
        model = family_model(name)
        enable_sequence_parallel(model, mesh, inner=inner)
        local = shard_batch(lm_batch(packed), rank, world)
        loss = lm_loss_sum(model, local)
        loss.backward()
        dist.all_reduce(loss.detach())
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        for g in grads.values():
            dist.all_reduce(g)
        results[name] = {"loss": loss.detach(), "grads": grads}

    if rank == 0:
        torch.save(results, out)


@pytest.fixture(scope="module")
def sp_results(tmp_path_factory) -> dict:
    out = Path(tmp_path_factory.mktemp("ulysses")) / "results.pt"
    spawn(_worker, SP, str(out))
    return torch.load(out)


def reference_attention(heads: int, kv_heads: int, packed: bool) -> dict[str, torch.Tensor]:
    """transformers' sdpa attention in one process; packed: each document on its own."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = attention_module(heads, kv_heads)
    x = attn_inputs(heads, kv_heads)
    q, k, v = (x[n].clone().requires_grad_(True) for n in "qkv")
    bounds = torch.tensor((0, *DOCS)).cumsum(0).tolist() if packed else [0, S]
    parts = [
        sdpa_attention_forward(module, q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], None, scaling=D**-0.5)[0]
        for a, b in itertools.pairwise(bounds)
    ]
    o = torch.cat(parts, dim=1)
    (o * x["w"]).sum().backward()
    return {"out": o.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("case", list(ATTN_CASES))
@pytest.mark.slow
def test_sp_attention_equals_single_process_sdpa(sp_results, case):
    heads, kv_heads, packed, _ = ATTN_CASES[case]
    expected = reference_attention(heads, kv_heads, packed)
    for key in ("out",) if case in FORWARD_ONLY else ("out", "dq", "dk", "dv"):
        assert_close(sp_results[case][key], expected[key], f"{case} {key}")


@pytest.mark.slow
def test_packed_reference_differs_from_plain_causal(sp_results):
    """The packed case is a real test: attention across document borders would give other outputs."""
    plain = reference_attention(4, 4, packed=False)["out"]
    assert not torch.allclose(sp_results["packed"]["out"], plain, atol=1e-3)


@pytest.mark.parametrize("case", list(MODEL_CASES))
@pytest.mark.slow
def test_sp_model_loss_and_grads_equal_one_process(sp_results, case):
    kv_heads, packed, _ = MODEL_CASES[case]
    model = small_qwen3_model(kv_heads)
    loss = lm_loss_sum(model, lm_batch(packed))
    loss.backward()
    got = sp_results[case]
    assert_close(got["loss"], loss.detach(), f"{case} loss")
    for name, p in model.named_parameters():
        assert_close(got["grads"][name], p.grad, f"{case} grad {name}")


def test_shard_batch_splits_tokens_and_keeps_global_positions():
    from spindle.distributed.ulysses_attention import shard_batch

    ids = torch.arange(8).view(1, 8)
    labels = ids + 100
    parts = [shard_batch({"input_ids": ids, "labels": labels, "other": 5}, r, 2) for r in range(2)]
    assert parts[1]["input_ids"].tolist() == [[4, 5, 6, 7]]
    assert parts[1]["position_ids"].tolist() == [[4, 5, 6, 7]]
    # labels are shifted before the split: the last token of chunk 0 predicts the first of chunk 1
    assert parts[0]["shift_labels"].tolist() == [[101, 102, 103, 104]]
    assert parts[1]["shift_labels"].tolist() == [[105, 106, 107, -100]]
    assert "labels" not in parts[0] and parts[0]["other"] == 5


def test_shard_batch_names_seq_len_when_not_divisible():
    from spindle.distributed.ulysses_attention import shard_batch

    with pytest.raises(ValueError, match=r"seq_len=9.*parallel\.sp=2"):
        shard_batch({"input_ids": torch.zeros(1, 9, dtype=torch.long)}, 0, 2)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "sp", "match"),
    [
        (6, 6, 4, r"6 attention heads \(num_attention_heads\), not divisible by parallel\.sp=4"),
        (4, 2, 4, None),  # KV heads repeated 2x: fine
        (6, 4, 2, r"4 key/value heads \(num_key_value_heads\)"),  # not a GQA grouping at all
    ],
)
def test_check_layout(heads, kv_heads, sp, match):
    from spindle.distributed.ulysses_attention import check_layout

    config = {"num_attention_heads": heads, "num_key_value_heads": kv_heads}
    if match is None:
        check_layout(config, sp, seq_len=16)
    else:
        with pytest.raises(ValueError, match=match):
            check_layout(config, sp)


@pytest.mark.parametrize(
    ("layers", "match"),
    [
        ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4}, None),
        (
            {
                "layer_types": ["linear_attention", "full_attention"],
                "linear_num_value_heads": 4,
                "linear_num_key_heads": 1,
            },
            None,
        ),  # key heads repeated 4x
        (
            {"layer_types": ["linear_attention"], "linear_num_value_heads": 6, "linear_num_key_heads": 2},
            r"6 attention heads \(linear_num_value_heads\), not divisible by parallel\.sp=4",
        ),
        (
            {"layer_types": ["linear_attention"], "linear_num_value_heads": 8, "linear_num_key_heads": 3},
            r"3 key/value heads \(linear_num_key_heads\)",
        ),
        ({"layer_types": ["chunked_attention"]}, r"\['chunked_attention'\] layers \(layer_types\)"),
    ],
)
def test_check_layout_of_sliding_and_linear_attention_layers(layers, match):
    from spindle.distributed.ulysses_attention import check_layout

    config = {"num_attention_heads": 8, "num_key_value_heads": 2, **layers}
    if match is None:
        check_layout(config, 4)
    else:
        with pytest.raises(ValueError, match=match):
            check_layout(config, 4)


def test_kv_repeat_gives_each_rank_whole_matching_heads():
    from spindle.distributed.ulysses_attention import kv_repeat

    assert [kv_repeat(4, 1, 2), kv_repeat(8, 2, 4), kv_repeat(6, 3, 2), kv_repeat(8, 8, 2)] == [2, 2, 2, 1]


def test_check_layout_names_seq_len():
    from spindle.distributed.ulysses_attention import check_layout

    with pytest.raises(ValueError, match=r"data\.seq_len=30 is not divisible by parallel\.sp=4"):
        check_layout({"num_attention_heads": 8, "num_key_value_heads": 8}, 4, seq_len=30)


@pytest.mark.parametrize("case", list(FAMILY_CASES))
@pytest.mark.slow
def test_sp_family_layers_loss_and_grads_equal_one_process(sp_results, case):
    """Sinks, sliding windows (packed) and Gated DeltaNet under Ulysses: the loss and every parameter's gradient
    (the sinks', the conv filters' included) equal one process."""
    packed, _ = FAMILY_CASES[case]
    model = family_model(case)
    loss = lm_loss_sum(model, lm_batch(packed))
    loss.backward()
    got = sp_results[case]
    assert_close(got["loss"], loss.detach(), f"{case} loss")
    want = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert got["grads"].keys() == want.keys()
    for name, grad in want.items():
        assert_close(got["grads"][name], grad, f"{case} grad {name}")
