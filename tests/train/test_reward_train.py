"""`train.objective: reward` end to end: Spindle's trainer (the Reward part on the causal-LM task, which builds the
family's ForSequenceClassification with a fresh score head keyed on train.seed) against `trl.RewardTrainer`; the
export is a standard sequence-classification folder stock transformers loads and scores with the trained model's
scores; the same folder as a GRPO reward model (`spindle.train.rewards.reward_model`)."""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset  # TRL's own dependency
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from trl import RewardConfig, RewardTrainer

from spindle.config import ConfigError
from spindle.registry import all_families
from spindle.train.metrics import read_metrics
from spindle.train.objectives.reward import ScoreHead
from tests.conftest import lm_overrides, lm_train
from tests.train.test_preference_trl_parity import LINES, SEQ_LEN, grad_norm
from tests.train.test_vlm_dpo import write_image_pairs

SEED = 7
PAIRS = [{**line, "margin": 0.5 * i} for i, line in enumerate(LINES["standard"])]
VLM_SEQ = 96  # tokens of an image pair's longest sequence and more


def pairs_file(tmp_path, lines):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def reward_overrides(n: int, **values):
    return {
        "train__objective": "reward",
        "train__seed": SEED,
        "data__seq_len": SEQ_LEN,
        "data__shuffle": False,
        "train__global_batch_size": n,
        "train__micro_batch_size": n,
        **values,
    }


def trl_reward_step_one(model_path, lines, tmp_path):
    """TRL's first-step loss and grad norm on the stock classification model with Spindle's initial head."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=1, dtype=torch.float32)
    ScoreHead(SEED).init(model)  # the head the run starts from (its values: a generator keyed on train.seed)
    args = RewardConfig(
        output_dir=str(tmp_path / "trl"),
        report_to=[],
        bf16=False,
        use_cpu=True,
        per_device_train_batch_size=len(lines),
        max_length=SEQ_LEN,
    )
    trainer = RewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(lines), processing_class=tokenizer)
    loss = trainer.compute_loss(trainer.model, next(iter(trainer.get_train_dataloader())))
    loss.backward()
    return loss.detach(), grad_norm(model)


def test_step_one_equals_trl_and_the_export_scores_in_stock_transformers(tiny_qwen3, tmp_path):
    data = pairs_file(tmp_path, PAIRS)
    trainer, _ = lm_train(tiny_qwen3, data, tmp_path / "run", **reward_overrides(len(PAIRS), train__max_steps=3))
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    loss, norm = trl_reward_step_one(tiny_qwen3, PAIRS, tmp_path)
    assert metrics[0]["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert metrics[0]["grad_norm"] == pytest.approx(norm.item(), rel=1e-5)
    assert {"accuracy", "margin", "mean_reward"} <= set(metrics[0])
    assert metrics[2]["loss"] < metrics[0]["loss"]  # it trains

    export = tmp_path / "run" / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForSequenceClassification"]
    assert len(config["id2label"]) == 1 and config["pad_token_id"] is not None
    assert not (export / "generation_config.json").exists()  # a scoring model, not a generating one
    stock = AutoModelForSequenceClassification.from_pretrained(export, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(export)
    texts = [PAIRS[0]["prompt"] + PAIRS[0]["chosen"], PAIRS[1]["prompt"] + PAIRS[1]["rejected"]]
    batch = tokenizer(texts, padding=True, padding_side="right", return_tensors="pt")
    trained = trainer.model
    trained.eval()
    with torch.no_grad():
        ours = trained(**batch).logits[:, 0]
        theirs = stock(**batch).logits[:, 0]
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)
    assert not torch.equal(theirs[0], theirs[1])

    # the same folder as a GRPO reward (`grpo.rewards: [FOLDER]`)
    from spindle.train.rewards.reward_model import RewardModel

    scorer = RewardModel(str(export), batch_size=2, device=torch.device("cpu"))
    prompts = [PAIRS[0]["prompt"], PAIRS[1]["prompt"]]
    completions = [PAIRS[0]["chosen"], PAIRS[1]["rejected"]]
    assert scorer(completions, prompts, {}) == pytest.approx(theirs.tolist(), rel=1e-5, abs=1e-6)
    # a prompt with an image: the folder's tokenizer would score its text alone; refused naming what to use instead
    image_prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}]
    with pytest.raises(ValueError, match=r"scores text only, and this prompt carries image parts; .* reward function"):
        scorer([[{"role": "assistant", "content": "a cat"}]], [image_prompt], {})
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": line["prompt"]}) + "\n" for line in PAIRS))
    lm_train(
        tiny_qwen3,
        prompts_file,
        tmp_path / "grpo",
        train__objective="grpo",
        data__seq_len=SEQ_LEN,
        train__global_batch_size=len(PAIRS),
        train__micro_batch_size=len(PAIRS),
        train__max_steps=1,
        train__log_every=1,
        grpo__num_generations=2,
        grpo__max_new_tokens=4,
        grpo__rewards=f"[{export}]",
        checkpoint__export=False,
    )
    (grpo,) = read_metrics(tmp_path / "grpo")
    samples = [json.loads(line) for line in (tmp_path / "grpo" / "samples" / "grpo.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * len(PAIRS)
    rescored = scorer([s["completion"] for s in samples], [s["prompt"] for s in samples], {})
    assert [s["reward"] for s in samples] == pytest.approx(rescored, rel=1e-5, abs=1e-6)
    assert grpo["reward/export"] == pytest.approx(sum(rescored) / len(rescored), rel=1e-5, abs=1e-6)


def test_llama_on_the_full_load_path_equals_trl(tiny_llama, tmp_path):
    """Another family, and `model.sharded_load: false` (the whole model loaded by transformers, then the head set):
    the same initial head, so the same first step as TRL's."""
    data = pairs_file(tmp_path, PAIRS)
    lm_train(
        tiny_llama,
        data,
        tmp_path / "run",
        **reward_overrides(len(PAIRS), train__max_steps=1, model__sharded_load=False),
    )
    (first,) = read_metrics(tmp_path / "run")
    loss, norm = trl_reward_step_one(tiny_llama, PAIRS, tmp_path)
    assert first["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert first["grad_norm"] == pytest.approx(norm.item(), rel=1e-5)
    config = json.loads((tmp_path / "run" / "export" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]


MOE_FAMILIES = [f.name for f in all_families() if f.kind == "causal_lm" and f.adapter() is not None]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_mixture_of_experts_reward_model_equals_trl_and_exports_in_the_input_layout(
    family, tiny_checkpoint, tmp_path
):
    """MoE families (fused experts loaded from the checkpoint's own layout; no router aux loss, as the stock
    ForSequenceClassification and TRL have none): step 1 equals `trl.RewardTrainer`, and the export is the family's
    sequence-classification folder that stock transformers loads with every tensor present and scores as trained."""
    model = tiny_checkpoint(family)
    data = pairs_file(tmp_path, PAIRS)
    trainer, _ = lm_train(model, data, tmp_path / "run", **reward_overrides(len(PAIRS), train__max_steps=1))
    (first,) = read_metrics(tmp_path / "run")
    loss, norm = trl_reward_step_one(model, PAIRS, tmp_path)
    assert first["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert first["grad_norm"] == pytest.approx(norm.item(), rel=1e-4)
    stock, info = AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "run" / "export", dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    batch = AutoTokenizer.from_pretrained(model)([line["prompt"] + line["chosen"] for line in PAIRS], padding=True,
                                                return_tensors="pt")  # fmt: skip
    trainer.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(stock.eval()(**batch).logits, trainer.model(**batch).logits, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_expert_parallel_equals_one_process(tiny_checkpoint, tmp_path):
    """qwen3_moe with parallel.ep=2 (each rank half the experts) over dp_shard=2: one process's losses and grad
    norms over 3 steps."""
    from tests.conftest import lm_train_cli

    model = tiny_checkpoint("qwen3_moe")
    lines = [*PAIRS, {"prompt": "Best pet:", "chosen": " a cat", "rejected": " a rock", "margin": 0.25}]
    data = pairs_file(tmp_path, lines)
    values = reward_overrides(4, train__micro_batch_size=2, train__max_steps=3, checkpoint__export=False)
    lm_train(model, data, tmp_path / "one", **values)
    lm_train_cli(model, data, tmp_path / "ep2", 2, parallel__dp_shard=2, parallel__ep=2, **values)
    for a, b in zip(read_metrics(tmp_path / "one"), read_metrics(tmp_path / "ep2"), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)


@pytest.fixture(scope="module")
def image_pairs(tmp_path_factory):
    """4 preference pairs with an image in each prompt (DPO's VLM pairs): (pairs.jsonl, its lines)."""
    return write_image_pairs(tmp_path_factory.mktemp("image_pairs"))


def stock_image_scores(model, processor, lines, folder, completion: str) -> torch.Tensor:
    """Each line's score of its prompt-and-`completion` conversation ("chosen" / "rejected") under the stock
    sequence-classification `model`: what the stock processor makes of the conversation and its image (input ids,
    pixel values, the image's grid or token types), one unpadded sequence at a time."""
    from PIL import Image

    scores = []
    for line in lines:
        image = Image.open(folder / line["prompt"][0]["content"][0]["image"]).convert("RGB")
        whole = processor.apply_chat_template(line["prompt"] + line[completion], tokenize=False)
        # the template wrote the BOS where the model has one (Gemma 3)
        inputs = processor(text=[whole], images=[image], return_tensors="pt", add_special_tokens=False)
        scores.append(model(**inputs).logits[0, 0])
    return torch.stack(scores)


def stock_image_reward_step(path, lines, folder):
    """Stock transformers' first reward step on image pairs: the family's ForSequenceClassification loaded from
    `path` with Spindle's initial head, in training mode (as Spindle's first step runs), the Bradley-Terry loss of
    its scores (`stock_image_scores`) backpropagated. -> (the model, its processor, the loss, the accuracy)."""
    from spindle.testing.vlm_conformance import stock_processor

    processor = stock_processor(path)
    stock = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, dtype=torch.float32, attn_implementation="sdpa"
    )
    ScoreHead(SEED).init(stock)
    stock.train()
    chosen = stock_image_scores(stock, processor, lines, folder, "chosen")
    rejected = stock_image_scores(stock, processor, lines, folder, "rejected")
    loss = -torch.nn.functional.logsigmoid(chosen - rejected).mean()
    loss.backward()
    return stock, processor, loss.item(), (chosen > rejected).float().mean().item()


@pytest.mark.parametrize("family", ["gemma3_vl", "qwen3_5"])
def test_an_image_reward_step_equals_stock_transformers_and_the_export_scores_alike(
    family, tiny_checkpoint, image_pairs, tmp_path
):
    """Gemma 3 (1-D positions, bidirectional image blocks from token_type_ids) and Qwen3.5 (3-D positions, Gated
    DeltaNet layers), pairs with an image in each prompt: the reward model is the family's ForSequenceClassification
    (fresh score head keyed on train.seed) and step 1's loss and grad norm equal the Bradley-Terry loss of the stock
    class loaded from the same folder with the same head, run on what the stock processor makes of each
    prompt-and-completion conversation (TRL's RewardTrainer takes no images). The export is the family's
    classification folder that stock transformers loads with every tensor and scores as the trained model does."""
    from spindle.testing.vlm_conformance import grad_norm

    data, lines = image_pairs
    path = tiny_checkpoint(family)
    values = reward_overrides(len(lines), train__max_steps=2, data__seq_len=VLM_SEQ)
    trainer, _ = lm_train(path, data, tmp_path / "run", **values)
    metrics = read_metrics(tmp_path / "run")
    assert metrics[1]["loss"] < metrics[0]["loss"]  # it trains

    stock, processor, loss, accuracy = stock_image_reward_step(path, lines, data.parent)
    assert metrics[0]["loss"] == pytest.approx(loss, rel=1e-5)
    assert metrics[0]["grad_norm"] == pytest.approx(grad_norm(stock), rel=1e-4)
    assert metrics[0]["accuracy"] == pytest.approx(accuracy)

    export = tmp_path / "run" / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == [type(stock).__name__]
    exported, info = AutoModelForSequenceClassification.from_pretrained(
        export, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    trainer.model.eval()
    with torch.no_grad():
        theirs = stock_image_scores(exported.eval(), processor, lines, data.parent, "chosen")
        ours = stock_image_scores(trainer.model, processor, lines, data.parent, "chosen")
        before = stock_image_scores(stock.eval(), processor, lines, data.parent, "chosen")
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)
    assert (theirs - before).abs().max() > 1e-4  # the trained head and model, not the starting ones


def test_an_image_reward_lora_exports_a_peft_classification_adapter_and_a_merged_folder(
    tiny_checkpoint, image_pairs, tmp_path
):
    """`train.lora` on Gemma 3's reward model: the language model's adapters (B = 0 at the start, so step 1 is the
    stock full-model step 1) and the fresh score head train. `lora/` is a PEFT SEQ_CLS adapter (head in
    modules_to_save) that stock `PeftModel.from_pretrained` puts on the family's ForSequenceClassification, `merged/`
    a standalone classification folder: both score the image conversations alike, and unlike the untrained model."""
    from peft import PeftModel

    data, lines = image_pairs
    path = tiny_checkpoint("gemma3_vl")
    values = reward_overrides(len(lines), train__max_steps=2, train__lr=1e-2, data__seq_len=VLM_SEQ)
    lm_train(path, data, tmp_path / "run", **values, train__lora={"rank": 4}, export__merge_lora=True)
    metrics = read_metrics(tmp_path / "run")
    base, processor, loss, _ = stock_image_reward_step(path, lines, data.parent)
    assert metrics[0]["loss"] == pytest.approx(loss, rel=1e-5)
    assert metrics[1]["loss"] < metrics[0]["loss"]
    export = tmp_path / "run" / "export"
    adapter = json.loads((export / "lora" / "adapter_config.json").read_text())
    assert adapter["task_type"] == "SEQ_CLS" and adapter["modules_to_save"] == ["score"]
    merged, info = AutoModelForSequenceClassification.from_pretrained(
        export / "merged", dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    with torch.no_grad():
        untrained = stock_image_scores(base.eval(), processor, lines, data.parent, "chosen")
        peft = PeftModel.from_pretrained(base, export / "lora").eval()
        via_peft = stock_image_scores(peft, processor, lines, data.parent, "chosen")
        via_merged = stock_image_scores(merged.eval(), processor, lines, data.parent, "chosen")
    torch.testing.assert_close(via_peft, via_merged, rtol=1e-5, atol=1e-5)
    assert (via_merged - untrained).abs().max() > 1e-3


@pytest.mark.slow
def test_an_image_reward_model_on_two_data_parallel_processes_equals_one_process(
    tiny_checkpoint, image_pairs, tmp_path
):
    """Gemma 3 image pairs on dp_shard=2 (each rank its half of the pairs, the vision tower and the score head
    sharded): one process's losses, grad norms and accuracies over 2 steps, and the same exported scores."""
    from spindle.testing.vlm_conformance import stock_processor
    from tests.conftest import lm_train_cli

    data, lines = image_pairs
    path = tiny_checkpoint("gemma3_vl")
    values = reward_overrides(4, train__micro_batch_size=2, train__max_steps=2, train__adam_eps=1e-4,
                              data__seq_len=VLM_SEQ)  # fmt: skip
    lm_train(path, data, tmp_path / "one", **values)
    lm_train_cli(path, data, tmp_path / "dp2", 2, parallel__dp_shard=2, **values)
    for a, b in zip(read_metrics(tmp_path / "one"), read_metrics(tmp_path / "dp2"), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert b["accuracy"] == pytest.approx(a["accuracy"])
    processor = stock_processor(path)

    def scores(run):
        model = AutoModelForSequenceClassification.from_pretrained(tmp_path / run / "export", dtype=torch.float32)
        with torch.no_grad():
            return stock_image_scores(model.eval(), processor, lines, data.parent, "chosen")

    torch.testing.assert_close(scores("dp2"), scores("one"), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("family", "why"),
    [("qwen2_5_vl", "defines no ForSequenceClassification for model_type 'qwen2_5_vl'"),
     ("qwen3_5_moe", "defines no ForSequenceClassification for model_type 'qwen3_5_moe'")],
)  # fmt: skip
def test_a_vision_language_family_without_a_classification_class_is_refused_naming_why(
    family, why, tiny_checkpoint, image_pairs, tmp_path
):
    with pytest.raises(ConfigError, match=why):
        lm_train(tiny_checkpoint(family), image_pairs[0], tmp_path / "run", **reward_overrides(4))


def test_image_reward_under_sequence_parallelism_is_refused_before_launch(
    tiny_checkpoint, image_pairs, tmp_path, spindle_cli
):
    """Qwen3.5 (whose SFT and DPO run under Ulysses SP): a reward model with images is refused at sp=2, naming why
    and the fix, before any process starts."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("{}\n")
    args = [f"{k.replace('__', '.')}={v}" for k, v in reward_overrides(4, data__seq_len=VLM_SEQ).items()]
    paths = [f"model.path={tiny_checkpoint('qwen3_5')}", f"data.path={image_pairs[0]}", f"train.output_dir={tmp_path}"]
    result = spindle_cli("train", cfg, *paths, *args, "parallel.sp=2", "--nproc", "2")
    assert result.returncode != 0
    assert "train.objective=reward on a vision-language model (qwen3_5)" in result.stderr, result.stderr[-2000:]
    assert "set parallel.sp: 1" in result.stderr


def test_lora_trains_the_adapters_and_the_new_head_and_exports_what_peft_and_transformers_load(tiny_qwen3, tmp_path):
    """`train.lora` on a reward model: the adapters (B = 0 at the start, so step 1 is TRL's full-model step 1) and
    the fresh score head train, the rest stays frozen. The export's `lora/` is a PEFT SEQ_CLS adapter with the head
    in modules_to_save that stock `PeftModel.from_pretrained` puts on the base's ForSequenceClassification; its
    `merged/` a standalone classification folder: both score every sequence alike, and unlike the untrained model."""
    from peft import PeftModel

    data = pairs_file(tmp_path, PAIRS)
    values = reward_overrides(len(PAIRS), train__max_steps=3, train__lr=1e-2, export__merge_lora=True)
    lm_train(tiny_qwen3, data, tmp_path / "run", **values, train__lora={"rank": 4})
    metrics = read_metrics(tmp_path / "run")
    loss, _ = trl_reward_step_one(tiny_qwen3, PAIRS, tmp_path)
    assert metrics[0]["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    export = tmp_path / "run" / "export"
    adapter = json.loads((export / "lora" / "adapter_config.json").read_text())
    assert adapter["task_type"] == "SEQ_CLS" and adapter["modules_to_save"] == ["score"]

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    texts = [line["prompt"] + line[key] for line in PAIRS for key in ("chosen", "rejected")]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    merged = AutoModelForSequenceClassification.from_pretrained(export / "merged", dtype=torch.float32).eval()
    base = AutoModelForSequenceClassification.from_pretrained(
        tiny_qwen3, num_labels=1, pad_token_id=merged.config.pad_token_id, dtype=torch.float32
    )
    ScoreHead(SEED).init(base)  # the untrained head, for the "it trained" comparison below
    with torch.no_grad():
        untrained = base.eval()(**batch).logits[:, 0]
        peft = PeftModel.from_pretrained(base, export / "lora").eval()
        via_peft, via_merged = peft(**batch).logits[:, 0], merged(**batch).logits[:, 0]
    torch.testing.assert_close(via_peft, via_merged, rtol=1e-5, atol=1e-5)
    assert (via_merged - untrained).abs().max() > 1e-3


@pytest.mark.slow
def test_two_process_layouts_equal_one_process(tiny_qwen3, tmp_path):
    """dp_shard=2 (real gloo processes, each rank its half of the pairs; the score head sharded, initialised the same
    from its keyed generator) and Ulysses sp=2 (each rank a chunk of every row; a row's score comes from the rank
    holding its last token) give one process's losses, grad norms and accuracies over 3 steps, and the same exported
    model."""
    from tests.conftest import lm_train_cli

    lines = [*PAIRS, {"prompt": "Best pet:", "chosen": " a cat", "rejected": " a rock", "margin": 0.25}]
    data = pairs_file(tmp_path, lines)
    # lr 3e-5, not the default 1e-4: at 1e-4 the loss saturates by step 3 (0.95 -> 0.08) and each step multiplies
    # the layouts' fp32 summation-order differences ~20x (a 1e-7 grad norm difference at step 1 was 1.6e-5 at step
    # 3 on an AVX-512 CPU); at 3e-5 the loss still falls every step and the differences stay ~1e-7
    values = reward_overrides(4, train__micro_batch_size=2, train__max_steps=3, train__adam_eps=1e-4, train__lr=3e-5)
    lm_train(tiny_qwen3, data, tmp_path / "one", **values)
    layouts = {"dp_shard2": {"parallel__dp_shard": 2}, "sp2": {"parallel__sp": 2}}
    for name, layout in layouts.items():
        lm_train_cli(tiny_qwen3, data, tmp_path / name, 2, **layout, **values)
    one = read_metrics(tmp_path / "one")
    assert one[0]["loss"] > one[1]["loss"] > one[2]["loss"]  # the weights move: the steps compare trained states
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    batch = tokenizer([line["prompt"] + line["chosen"] for line in lines], padding=True, return_tensors="pt")

    def scores(run):
        model = AutoModelForSequenceClassification.from_pretrained(tmp_path / run / "export", dtype=torch.float32)
        with torch.no_grad():
            return model.eval()(**batch).logits[:, 0]

    for name in layouts:
        for a, b in zip(one, read_metrics(tmp_path / name), strict=True):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), name
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), name
            assert b["accuracy"] == pytest.approx(a["accuracy"]), name
        torch.testing.assert_close(scores(name), scores("one"), rtol=1e-5, atol=1e-6, msg=name)


def test_a_killed_run_resumes_exactly(tiny_qwen3, tmp_path):
    """`spindle train` SIGKILLed as step 3 begins, then `checkpoint.resume: auto`: the score head and its optimizer
    state come back from the step-2 checkpoint, not from a fresh initialisation, so steps 3-4 equal the
    uninterrupted run's."""
    from tests.conftest import run_spindle, spindle_train_killed

    data = pairs_file(tmp_path, PAIRS)
    values = reward_overrides(len(PAIRS), checkpoint__every_steps=1, checkpoint__export=False, train__max_steps=4)
    lm_train(tiny_qwen3, data, tmp_path / "full", **values)
    spindle_train_killed(tmp_path / "cut", lm_overrides(tiny_qwen3, data, tmp_path / "cut", **values), at_step=3)
    lm_train(tiny_qwen3, data, tmp_path / "cut", **{**values, "checkpoint__resume": "auto"})
    # `spindle export` of a reward checkpoint is refused, naming the run's own export (it writes ForCausalLM folders)
    proc = run_spindle("export", tmp_path / "cut", "--out", tmp_path / "offline")
    assert proc.returncode != 0 and "reward model's checkpoint" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "offline").exists()
    full, cut = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "cut")
    assert [m["step"] for m in cut] == [1, 2, 3, 4]  # resumed at 3: the killed run logged 1-2
    for a, b in zip(full, cut, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6)
