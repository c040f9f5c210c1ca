"""The conformance suite's checks for causal-LM families: what every language-model family must pass.

tests/conformance/test_causal_lm_conformance.py runs each check over every causal-LM family in the
registry, so a new family is tested by registering it. What a family declares for the suite: its
`CausalLMConformanceSpec` (its folder's conformance.py, spindle.testing.specs): tiny-checkpoint overrides, the stock forward's
loss arguments and outputs its step metrics equal, and the 2-process layouts it trains with.

Tolerances (fp32 CPU, CONTRIBUTING.md): the patched model class equals stock transformers (loss and
gradients 1e-5 relative, logits exactly); Spindle's step-1 loss and grad norm equal stock's (1e-5
relative); exported tensors equal the trained ones exactly; parallel layouts equal one process (loss,
grad norm 1e-5 relative; weights 1e-4 absolute after AdamW steps at lr 1e-3).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from spindle.contracts.family import CausalLMFamily
from spindle.testing.specs import lm_spec

TOL_RTOL, TOL_ATOL = 1e-5, 1e-6  # the patched class against stock transformers, same weights
RTOL = 1e-5  # Spindle's step metrics against stock transformers / one process
WEIGHT_ATOL = 1e-4  # exported weights of a parallel layout against one process after AdamW at lr 1e-3
STEP_ONE_TEXT = "the red circle moves left on a gray background . then the red circle moves right ."

# what every run of a layout test trains, the 1-process reference included: 4 steps, global batch 8 in
# micro-batches of 2, unpacked rows (text and chat documents: very different learned-token counts per row)
REFERENCE_RUN: dict[str, Any] = {"train__max_steps": 4, "train__micro_batch_size": 2, "data__packing": False}

# layout name (CausalLMConformanceSpec.parallel) -> (processes, dotted overrides)
LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "dp_shard2": (2, {"parallel__dp_shard": 2}),
    "sp2": (2, {"parallel__sp": 2, "parallel__dp_shard": 1}),
    "ep2": (2, {"parallel__ep": 2}),
    # FSDP2's CPU offload on the experts' own units as on the dense ones
    "ep2_cpu_offload": (2, {"parallel__ep": 2, "train__cpu_offload": True}),
}


def parallel_layouts(family: CausalLMFamily) -> list[str]:
    """The 2-process layouts the suite checks for `family`: its declared ones, plus ep2 where its task
    supports expert parallelism."""
    from spindle.train.tasks import get_task

    layouts = list(lm_spec(family).parallel)
    if get_task(family.task).supports_expert_parallel(family):
        layouts += [name for name in ("ep2", "ep2_cpu_offload") if name not in layouts]
    unknown = sorted(set(layouts) - set(LAYOUTS))
    assert not unknown, f"{family.name}: unknown conformance layouts {unknown}; known: {sorted(LAYOUTS)}"
    return layouts


# ---------------------------------------------------------------- the tiny checkpoint


def stock(path: Path) -> tuple[Any, Any]:
    """Stock transformers on a causal-LM folder: (the fp32 model, its tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)


def check_stock_load(family: CausalLMFamily, root: Path) -> None:
    """The tiny checkpoint is a standard transformers folder: AutoConfig reads one of the family's model
    types, AutoModelForCausalLM loads stock transformers' class of the name the family trains (~1M
    parameters), its tokenizer has a chat template and an eos token and knows the demo words, and the
    stock model generates from a chat prompt."""
    from transformers import AutoConfig

    model_type = AutoConfig.from_pretrained(root).model_type
    assert model_type in family.model_types, f"{family.name}: {root} has model_type {model_type!r}"
    model, tok = stock(root)
    expected = family.model_cls().__name__
    assert type(model).__name__ == expected and type(model).__module__.startswith("transformers."), (
        f"{family.name}: stock transformers loads {type(model).__module__}.{type(model).__name__}, not {expected}"
    )
    params = sum(p.numel() for p in model.parameters())
    assert 3e5 < params < 2e6, f"{family.name}: the tiny model has {params} parameters (expected ~1M)"
    assert tok.chat_template and tok.eos_token_id is not None, f"{family.name}: tokenizer without chat template/eos"
    assert tok.unk_token_id not in tok("the red circle moves left").input_ids, f"{family.name}: demo words are unk"
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "what colour"}], add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    ids = model.generate(**chat, max_new_tokens=3, do_sample=False)
    assert ids.shape[1] > chat["input_ids"].shape[1], f"{family.name}: the stock model generated nothing"


# ---------------------------------------------------------------- the patched class against stock


# the shape of the models compared class against class (tests/models/test_patched_models.py before the
# suite): a vocabulary of 1000 over a 12-token batch repeats few rows, and untied embeddings; with the tiny
# checkpoint's 182-token vocabulary and tied embeddings, an embedding row's gradient sums many
# contributions whose order the chunked loss changes (~2e-5 relative on single elements of the summed loss)
PAIR_SIZE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16, max_position_embeddings=128)
PAIR_CONFIG: dict[str, Any] = dict(
    PAIR_SIZE, num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False
)


def stock_and_patched(family: CausalLMFamily, root: Path) -> tuple[Any, Any]:
    """(stock transformers model, the family's training class) with the same random weights, fp32, eval
    mode (no dropout): the tiny checkpoint's config (its model type, MoE routing, ...) at PAIR_CONFIG's shape
    (with the family's `pair_overrides`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(root, **{**PAIR_CONFIG, **lm_spec(family).pair_overrides})
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    patched = family.model_cls()(config).eval()
    patched.load_state_dict(reference.state_dict())
    return reference, patched


def token_batch(vocab: int, seed: int = 0, batch: int = 2, seq: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) with a masked prompt in row 0 and padding at the end of row 1."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = input_ids.clone()
    labels[0, :4] = -100  # a masked prompt
    labels[1, -3:] = -100  # padding
    return input_ids, labels


def prefixed(prefix: str) -> Callable[[str], str]:
    """An `assert_close` message: `prefix` before torch's own description of the difference."""
    return lambda message: f"{prefix}: {message}"


def _loss_and_grads(model: Any, **kwargs: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(**kwargs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def check_same_loss_and_grads(
    family: CausalLMFamily,
    stock_model: Any,
    patched: Any,
    stock_kwargs: dict[str, Any],
    patched_kwargs: dict[str, Any],
    scale: float = 1.0,
) -> None:
    """The patched model's loss and every gradient equal stock's (rtol TOL_RTOL, atol TOL_ATOL), and its loss path
    builds no logits. `scale`: how many times the mean loss the compared one is (a sum over N tokens: N), by which
    its gradients and their float error grow, so the absolute tolerance grows by it too."""
    want, want_grads = _loss_and_grads(stock_model, **stock_kwargs)
    got, got_grads = _loss_and_grads(patched, **patched_kwargs)
    atol = TOL_ATOL * scale
    torch.testing.assert_close(got.loss, want.loss, rtol=TOL_RTOL, atol=atol, msg=prefixed(f"{family.name} loss"))
    assert got.logits is None, f"{family.name}: the loss path built [tokens, vocab] logits"
    assert got_grads.keys() == want_grads.keys(), f"{family.name}: {sorted(got_grads.keys() ^ want_grads.keys())}"
    for name, grad in want_grads.items():
        torch.testing.assert_close(
            got_grads[name], grad, rtol=TOL_RTOL, atol=atol, msg=prefixed(f"{family.name} {name} grad")
        )


@torch.no_grad()
def check_logits_and_generate(family: CausalLMFamily, stock_model: Any, patched: Any) -> None:
    """Without labels the patched model returns stock's logits exactly, `logits_to_keep=1` the last
    position's, and greedy generation the same tokens."""
    vocab = stock_model.config.vocab_size
    input_ids, _ = token_batch(vocab, seed=3)
    want, got = stock_model(input_ids=input_ids), patched(input_ids=input_ids)
    assert got.loss is None, f"{family.name}: a loss without labels"
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)
    last = patched(input_ids=input_ids, logits_to_keep=1).logits
    assert last.shape == (2, 1, vocab), f"{family.name}: logits_to_keep=1 gives {tuple(last.shape)}"
    torch.testing.assert_close(last, want.logits[:, -1:], rtol=TOL_RTOL, atol=TOL_ATOL)
    gen = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(patched.generate(input_ids, **gen), stock_model.generate(input_ids, **gen)), family.name


# ---------------------------------------------------------------- training against stock


def check_step_one(family: CausalLMFamily, root: Path, metrics: dict[str, Any], model: Any = None) -> None:
    """Spindle's first step over STEP_ONE_TEXT (one padded row, `one_step_metrics`) logs stock
    transformers' `model(ids, labels=ids, **stock_loss_kwargs)` loss, the grad norm of its backward and
    each declared stock output (1e-5 relative). `model`: the stock model to compare with (a stock PEFT
    model of a LoRA run; default: `stock(root)`)."""
    import pytest
    from transformers import AutoTokenizer

    model = stock(root)[0] if model is None else model
    tok = AutoTokenizer.from_pretrained(root)
    ids = torch.tensor([[*tok(STEP_ONE_TEXT).input_ids, tok.eos_token_id]])
    out = model(ids, labels=ids, **lm_spec(family).stock_loss_kwargs)
    out.loss.backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    want = {"loss": out.loss.item(), "grad_norm": float(norm)}
    want.update({name: getattr(out, name).item() for name in lm_spec(family).stock_outputs})
    got = {k: metrics[k] for k in want}
    assert got == pytest.approx(want, rel=RTOL), f"{family.name}: Spindle's step 1 {got} != stock {want}"


def check_export_round_trip(
    family: CausalLMFamily, base: Path, export: Path, trained: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The export holds the base checkpoint's tensor names (its layout) and loads in stock
    AutoModelForCausalLM with every tensor equal to the trained one (which differs from the base
    checkpoint's), and the loaded model generates; -> the loaded state dict."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def keys(folder: Path) -> set[str]:
        names: set[str] = set()
        for shard in folder.glob("*.safetensors"):
            with safe_open(shard, "pt") as f:
                names.update(f.keys())
        return names

    # the input's layout, key for key (e.g. per-expert MoE tensors stay per-expert)
    written, given = keys(export), keys(base)
    assert written == given, (
        f"{family.name}: the export's tensor names differ from the input's: {sorted(written ^ given)}"
    )
    loaded = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    exported = loaded.state_dict()
    assert exported.keys() == trained.keys(), f"{family.name}: {sorted(exported.keys() ^ trained.keys())}"
    for key, value in trained.items():
        assert torch.equal(exported[key], value.detach().cpu()), f"{family.name}: exported {key} != trained"
    base_state = stock(base)[0].state_dict()
    assert any(not torch.equal(base_state[k], trained[k]) for k in trained), f"{family.name}: training changed nothing"
    tok = AutoTokenizer.from_pretrained(export)
    prompt = tok("the red circle", return_tensors="pt")
    ids = loaded.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert ids.shape[1] == prompt["input_ids"].shape[1] + 4 or ids[0, -1] in loaded.generation_config.eos_token_id
    return exported


# ---------------------------------------------------------------- parallel layouts against one process


def exported_weights(run: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a run's transformers export (all its safetensors shards)."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for shard in sorted((run / "export").glob("*.safetensors")):
        weights.update(load_file(shard))
    return weights


def check_same_run(family: CausalLMFamily, a: Path, b: Path, *, weights: bool = True) -> None:
    """Two runs (output dirs) logged the same steps, losses and grad norms (RTOL) and each declared stock
    output (e.g. the MoE aux loss) and expert load; with `weights`, exported the same weights (WEIGHT_ATOL)."""
    import pytest

    from spindle.train.metrics import read_metrics

    ma, mb = read_metrics(a), read_metrics(b)
    assert [m["step"] for m in mb] == [m["step"] for m in ma] and ma, f"{family.name}: steps differ"
    for key in ("loss", "grad_norm", *lm_spec(family).stock_outputs):
        got, want = [m[key] for m in mb], [m[key] for m in ma]
        assert got == pytest.approx(want, rel=RTOL), f"{family.name} {key}: {got} != one process {want}"
    if "moe_tokens_per_expert" in ma[0]:
        assert [m["moe_tokens_per_expert"] for m in mb] == [m["moe_tokens_per_expert"] for m in ma], family.name
    if weights:
        wa, wb = exported_weights(a), exported_weights(b)
        assert wa.keys() == wb.keys() and wa, f"{family.name}: exported keys differ"
        worst = max(wa, key=lambda k: (wb[k] - wa[k]).abs().max().item())
        diff = (wb[worst] - wa[worst]).abs().max().item()
        assert diff <= WEIGHT_ATOL, f"{family.name}: exported {worst} differs by {diff:.3g} from one process"
