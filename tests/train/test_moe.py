"""Qwen3-MoE on one process: step-1 parity with stock transformers (token loss + router aux loss, grad
norm), aux loss and expert load in metrics.jsonl, checkpoint conversion (per-expert <-> fused, errors
naming the key), export into stock transformers in the input's layout."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from spindle.api import load_job_config
from spindle.testing.causal_lm_conformance import STEP_ONE_TEXT
from spindle.testing.causal_lm_conformance import stock as lm_stock
from tests.conftest import lm_overrides, lm_train, one_step_metrics

RTOL = 1e-5


def test_step_one_expert_load_counts_every_routing_once(tiny_qwen3_moe, lm_step_one):
    """Step 1's loss, aux loss and grad norm equal stock transformers' with output_router_logits: the
    conformance suite (tests/conformance/test_causal_lm_conformance.py, the family's stock_outputs). The
    same run's expert load: every (token, top-k) routing of both MoE layers counted once, the row's
    padding (seq_len 32) not at all."""
    model, tok = lm_stock(tiny_qwen3_moe)
    ids = torch.tensor([[*tok(STEP_ONE_TEXT).input_ids, tok.eos_token_id]])
    assert ids.shape[1] < 32
    out = model(ids, labels=ids, output_router_logits=True)
    assert model.config.router_aux_loss_coef * out.aux_loss.item() > 1e-3 * out.loss.item(), "aux must matter"
    m = lm_step_one("qwen3_moe")
    routed = ids.shape[1] * model.config.num_experts_per_tok * 2
    assert sum(m["moe_tokens_per_expert"]) == routed and len(m["moe_tokens_per_expert"]) == 8
    assert m["moe_load_imbalance"] >= 1.0


def test_padding_is_out_of_the_aux_loss_and_the_load_as_in_stock_transformers_with_attention_mask(
    tiny_qwen3_moe, tmp_path
):
    """`packing: false` rows of two documents of different lengths, one micro-batch: the padded row's
    pad positions must not count in the router statistics, as stock does when given `attention_mask`."""
    model, tok = lm_stock(tiny_qwen3_moe)
    texts = [STEP_ONE_TEXT, "the red circle"]
    docs = [[*tok(t).input_ids, tok.eos_token_id] for t in texts]
    seq_len = len(docs[0]) + 4  # both rows padded, the second by many positions
    ids = torch.tensor([d + [tok.pad_token_id] * (seq_len - len(d)) for d in docs])
    mask = torch.tensor([[1] * len(d) + [0] * (seq_len - len(d)) for d in docs])
    m = one_step_metrics(tiny_qwen3_moe, texts, tmp_path, seq_len=seq_len)
    out = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), output_router_logits=True)
    out.loss.backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    unmasked = model(ids, labels=ids, output_router_logits=True).aux_loss
    assert abs(float(unmasked) - float(out.aux_loss)) > 1e-3 * float(out.aux_loss), "padding must move the aux loss"
    assert m["aux_loss"] == pytest.approx(out.aux_loss.item(), rel=RTOL)
    assert m["loss"] == pytest.approx(out.loss.item(), rel=RTOL)
    assert m["grad_norm"] == pytest.approx(float(norm), rel=RTOL)
    routed = int(mask.sum()) * model.config.num_experts_per_tok * 2  # real tokens x top-k x MoE layers
    assert sum(m["moe_tokens_per_expert"]) == routed


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "padding_mask"])
def test_router_aux_loss_and_its_gradient_equal_transformers(masked):
    """spindle.ops.router_loss (what the patched forward uses) against transformers' own function."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from spindle.ops.router_loss import load_balancing_loss

    gen = torch.Generator().manual_seed(0)
    logits = [torch.randn(2 * 7, 8, generator=gen, requires_grad=True) for _ in range(3)]
    mask = torch.tensor([[1] * 7, [1] * 3 + [0] * 4]) if masked else None
    ours = load_balancing_loss(tuple(logits), 8, 2, mask)
    grads_ours = torch.autograd.grad(ours, logits)
    theirs = load_balancing_loss_func(tuple(logits), 8, 2, mask)
    grads_theirs = torch.autograd.grad(theirs, logits)
    assert float(ours) == pytest.approx(float(theirs), rel=RTOL)
    for a, b in zip(grads_ours, grads_theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=1e-7)


# ---------------------------------------------------------------- checkpoint conversion

# pairwise-distinct dims, so a transposed or mixed-up tensor cannot pass a shape check
HIDDEN, INTER, EXPERTS = 8, 6, 4
SMALL = dict(
    hidden_size=HIDDEN,
    moe_intermediate_size=INTER,
    num_experts=EXPERTS,
    num_experts_per_tok=2,
    intermediate_size=10,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=4,
)


@pytest.fixture(scope="module")
def small_moe(tmp_path_factory):
    from spindle.models.qwen3_moe.tiny import build_tiny as build_tiny_qwen3_moe

    return build_tiny_qwen3_moe(tmp_path_factory.mktemp("small") / "moe", seed=1, transformer=SMALL)


def rewrite(src, dst, edit):
    """Copy checkpoint folder `src` to `dst` with its weights passed through `edit(dict) -> dict`."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(src / "model.safetensors")
    save_file(edit(dict(weights)), dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def load_spindle(path):
    from spindle.registry import get_family
    from spindle.train.parts.experts import load_moe_model

    return load_moe_model(get_family("qwen3_moe"), path)


def fuse(weights):
    """Per-expert -> fused keys, by hand (independent of transformers' mapping)."""
    out = {k: v for k, v in weights.items() if ".experts." not in k}
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts"
        gate_up = [
            torch.cat([weights[f"{p}.{j}.gate_proj.weight"], weights[f"{p}.{j}.up_proj.weight"]]) for j in range(4)
        ]
        out[f"{p}.gate_up_proj"] = torch.stack(gate_up)
        out[f"{p}.down_proj"] = torch.stack([weights[f"{p}.{j}.down_proj.weight"] for j in range(4)])
    return out


def test_per_expert_to_fused_to_per_expert_round_trip_is_exact(small_moe):
    from safetensors.torch import load_file

    from spindle.models.qwen3_moe import conversion

    original = load_file(small_moe / "model.safetensors")
    assert conversion.expert_layout(small_moe) == conversion.PER_EXPERT
    model = load_spindle(small_moe)
    fused = model.state_dict()
    gate_up = fused["model.layers.1.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (EXPERTS, 2 * INTER, HIDDEN)
    assert torch.equal(gate_up[2, :INTER], original["model.layers.1.mlp.experts.2.gate_proj.weight"])
    assert torch.equal(gate_up[2, INTER:], original["model.layers.1.mlp.experts.2.up_proj.weight"])
    back = conversion.to_layout(model, {k: v for k, v in fused.items() if ".experts." in k}, conversion.PER_EXPERT)
    expert_keys = {k for k in original if ".experts." in k}
    assert set(back) == expert_keys
    assert all(torch.equal(back[k], original[k]) for k in expert_keys)


def test_fused_checkpoint_loads_as_it_is(small_moe, tmp_path):
    from safetensors.torch import load_file

    from spindle.models.qwen3_moe import conversion

    fused_dir = rewrite(small_moe, tmp_path / "fused", fuse)
    assert conversion.expert_layout(fused_dir) == conversion.FUSED
    a, b = load_spindle(small_moe).state_dict(), load_spindle(fused_dir).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    fused = load_file(fused_dir / "model.safetensors")
    assert conversion.to_layout(None, fused, conversion.FUSED) is fused


def test_wrong_expert_shape_raises_naming_the_key(small_moe, tmp_path):
    key = "model.layers.1.mlp.experts.3.up_proj.weight"
    bad = rewrite(small_moe, tmp_path / "bad", lambda w: {**w, key: w[key].t().contiguous()})
    with pytest.raises(ValueError, match=rf"{key} has shape \[{HIDDEN}, {INTER}\], expected \[{INTER}, {HIDDEN}\]"):
        load_spindle(bad)


def test_missing_expert_raises_naming_the_key(small_moe, tmp_path):
    gone = "model.layers.0.mlp.experts.2."
    bad = rewrite(small_moe, tmp_path / "bad", lambda w: {k: v for k, v in w.items() if not k.startswith(gone)})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.2\.\w+\.weight is missing"):
        load_spindle(bad)


def test_unrecognised_expert_tensor_raises_naming_the_key(small_moe, tmp_path):
    extra = "model.layers.0.mlp.experts.4.gate_proj.weight"  # a 5th expert in a 4-expert model
    bad = rewrite(
        small_moe, tmp_path / "bad", lambda w: {**w, extra: w["model.layers.0.mlp.experts.0.gate_proj.weight"].clone()}
    )
    with pytest.raises(ValueError, match=rf"unrecognised expert tensor {extra}"):
        load_spindle(bad)


# ---------------------------------------------------------------- export


# The per-expert layout (what stock save_pretrained writes) exports per-expert and loads in stock transformers:
# the conformance suite (test_export_loads_in_stock_transformers_with_every_tensor_equal[qwen3_moe]).
def test_a_fused_checkpoint_exports_fused_and_loads_in_stock_transformers(small_moe, lm_corpus, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = rewrite(small_moe, tmp_path / "fused", fuse)
    trainer, result = lm_train(src, lm_corpus, tmp_path / "run", train__max_steps=2)
    written = {}
    for shard in result.export_dir.glob("*.safetensors"):
        written.update(load_file(shard))
    assert written.keys() == load_file(src / "model.safetensors").keys()  # the input's layout, key for key
    # batched_mm: the CPU grouped_mm kernel needs 16-byte rows, which these odd test dims do not have
    loaded = AutoModelForCausalLM.from_pretrained(
        result.export_dir, dtype=torch.float32, experts_implementation="batched_mm"
    )
    trained, exported = trainer.model.state_dict(), loaded.state_dict()
    assert exported.keys() == trained.keys()
    assert all(torch.equal(exported[k], trained[k].detach()) for k in trained)
    base = load_spindle(small_moe).state_dict()
    assert not torch.equal(
        base["model.layers.0.mlp.experts.gate_up_proj"], trained["model.layers.0.mlp.experts.gate_up_proj"]
    )
    tok = AutoTokenizer.from_pretrained(result.export_dir)
    ids = loaded.generate(**tok("the red circle", return_tensors="pt"), max_new_tokens=3, do_sample=False)
    assert ids.shape[1] >= 4


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_offline_export_streams_the_experts_into_the_inputs_layout(layout, small_moe, lm_corpus, tmp_path):
    """`spindle export` of a MoE checkpoint builds no model: each layer's fused experts are read from the
    checkpoint and converted to the base's layout as they are written, the same bytes as the end-of-run
    export for every layout."""
    from safetensors.torch import load_file

    from spindle.cli import main

    src = small_moe if layout == "per_expert" else rewrite(small_moe, tmp_path / layout, fuse)
    _, result = lm_train(src, lm_corpus, tmp_path / "run", train__max_steps=2)
    out = tmp_path / "cli"
    with mock.patch("transformers.PreTrainedModel.from_pretrained", side_effect=AssertionError("model built")):
        assert main(["export", str(result.output_dir), "--out", str(out)]) == 0

    def weights(folder):
        return {k: v for shard in sorted(folder.glob("*.safetensors")) for k, v in load_file(shard).items()}

    streamed, in_run = weights(out), weights(result.export_dir)
    assert streamed.keys() == in_run.keys() == load_file(src / "model.safetensors").keys()
    assert all(torch.equal(streamed[k], in_run[k]) for k in in_run)


# ---------------------------------------------------------------- layout checks before launch


@pytest.mark.parametrize(
    "parallel,message",
    [
        ({"ep": 3, "dp_shard": 3}, r"parallel.ep=3 must divide the model's num_experts=8"),
        ({"ep": 2, "dp_shard": 3}, r"parallel.ep=2 must be >= 1 and divide parallel.dp_shard x parallel.sp = 3 x 1"),
        ({"ep": 2, "dp_shard": 2, "sp": 3}, r"heads \(num_attention_heads\), not divisible by parallel.sp=3"),
        # the shipped EP config started without --nproc: say how to launch it
        (
            {"ep": 2},
            r"parallel.ep=2 splits the experts over 2 processes, but this job has 1; run with --nproc 2 .*"
            r"or set parallel.ep=1",
        ),
    ],
)
def test_bad_expert_parallel_layouts_are_refused_before_launch(parallel, message, tiny_qwen3_moe, tmp_path):
    from spindle.api import check_job_plan

    world = parallel.get("dp_shard", 1) * parallel.get("sp", 1)
    overrides = {f"parallel__{k}": v for k, v in parallel.items()}
    overrides.update(train__global_batch_size=12, train__micro_batch_size=1)  # divisible by every dp size here
    cfg = load_job_config(None, lm_overrides(tiny_qwen3_moe, tmp_path, tmp_path / "o", **overrides))
    with pytest.raises(ValueError, match=message):
        check_job_plan(cfg, world)


def test_expert_parallel_on_a_dense_model_is_refused(tiny_qwen3, tmp_path):
    from spindle.api import check_job_plan
    from spindle.config import ConfigError

    cfg = load_job_config(
        None, lm_overrides(tiny_qwen3, tmp_path, tmp_path / "o", parallel__ep=2, parallel__dp_shard=2)
    )
    with pytest.raises(ConfigError, match=r"parallel\.ep=2: expert parallelism needs a mixture-of-experts model"):
        check_job_plan(cfg, 2)
