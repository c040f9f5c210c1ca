"""Per-rank memory of loading a model for training: sharded loading (meta build -> parallelize ->
each rank reads its shards) against the whole-model path (`model.sharded_load: false`), at several
world sizes (issue 26.5).

    python bench/load_memory.py                            # CPU: Wan-shaped DiT + Qwen3-shaped LLM, worlds 1 2 4
    python bench/load_memory.py --preset gpu --world 1     # Wan-14B / Qwen3-32B shapes, random bf16 weights, CUDA

Each (model, path, world) runs in its own spawned processes (gloo on CPU, nccl on CUDA), so every
figure is that configuration's own. Per rank it reports
  rss_before_gb    resident memory after the imports, before the trainer is built (the baseline)
  load_peak_gb     the peak resident memory (VmHWM) while building the trainer: model, load, parallelize
  step_peak_gb     the peak resident memory during the first optimizer step (VmHWM reset after load)
  cuda_load_gb / cuda_step_gb   torch.cuda.max_memory_allocated after load / during step 1 (CUDA only)
The model is trained fully (`--lora RANK`: LoRA adapters on the frozen base instead), fp32 master weights, one step of one sample per rank. The
checkpoints are random, written in bf16 in the standard layouts (a diffusers pipeline folder with a
sharded transformer; a transformers folder with sharded safetensors), tensor by tensor from a meta
model, so writing a 32B-shaped checkpoint never holds it in memory. Prints a table, writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import _common as common  # noqa: E402
from spindle.testing.multiprocess import spawn  # noqa: E402

GB = 1 << 30
SHARD_BYTES = 2 * GB
# name -> {kind: transformer / model config}. cpu: ~0.15B parameters each (0.6 GB fp32), so that 4 CPU ranks
# of the whole-model path fit in ~10 GB.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "cpu": {
        "wan": dict(
            num_attention_heads=12, attention_head_dim=64, ffn_dim=3072, num_layers=16, in_channels=16,
            out_channels=16, text_dim=64, freq_dim=256, rope_max_seq_len=1024,
        ),
        "qwen3": dict(
            hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
            num_key_value_heads=4, head_dim=64, vocab_size=32768, tie_word_embeddings=False,
        ),
    },
    # issue 26's measured case: a 0.34B-parameter Wan transformer (bf16 on disk, 1.3 GB in fp32); run it with
    # --lora --world 2 --models wan and compare with `--preset tiny` (the baseline the issue subtracts).
    "wan-0.34b": {
        "wan": dict(
            num_attention_heads=8, attention_head_dim=128, ffn_dim=4096, num_layers=20, in_channels=16,
            out_channels=16, text_dim=4096, freq_dim=256, rope_max_seq_len=1024,
        ),
    },
    "tiny": {
        "wan": dict(
            num_attention_heads=2, attention_head_dim=8, ffn_dim=32, num_layers=2, in_channels=16,
            out_channels=16, text_dim=4096, freq_dim=256, rope_max_seq_len=1024,
        ),
    },
    # Wan2.1-T2V-14B's transformer and Qwen3-32B's config.json shapes (text encoder and tokenizer stay tiny).
    "gpu": {
        "wan": dict(
            num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, num_layers=40, in_channels=16,
            out_channels=16, text_dim=4096, freq_dim=256, rope_max_seq_len=1024,
        ),
        "qwen3": dict(
            hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
            num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
        ),
    },
}  # fmt: skip


def write_random_shards(model: torch.nn.Module, folder: Path, weights_name: str, dtype: torch.dtype) -> None:
    """Random `dtype` weights for every parameter of a (meta) model, written shard by shard with a
    `*.safetensors.index.json`, holding at most one shard in memory."""
    from safetensors.torch import save_file

    stem = weights_name.removesuffix(".safetensors")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, weight_map, g = 0, {}, torch.Generator().manual_seed(0)
    names = [n for n, _ in model.named_parameters()]
    files: list[str] = []

    def flush() -> None:
        name = f"{stem}-{len(files) + 1:05d}.safetensors"
        save_file(shards[-1], str(folder / name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update(dict.fromkeys(shards[-1], name))
        shards[-1] = {}

    for name in names:
        p = model.get_parameter(name)
        t = torch.ones(p.shape, dtype=dtype) if p.ndim == 1 else (torch.randn(p.shape, generator=g) * 0.02).to(dtype)
        if size and size + t.numel() * t.element_size() > SHARD_BYTES:
            flush()
            size = 0
        shards[-1][name] = t
        size += t.numel() * t.element_size()
    flush()
    for old in folder.glob(f"{stem}*.safetensors"):
        if old.name not in files:
            old.unlink()
    total = sum((folder / f).stat().st_size for f in files)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / f"{weights_name}.index.json").write_text(json.dumps(index, indent=2))


def build_wan(out: Path, shape: dict[str, Any]) -> Path:
    """A Wan pipeline folder with a `shape`d transformer of random bf16 weights (tiny VAE and text encoder)."""
    from diffusers import WanTransformer3DModel

    from spindle.distributed.sharded_load import empty_weights
    from spindle.models.wan.tiny import WAN_TRANSFORMER
    from spindle.models.wan.tiny import build_tiny as build_tiny_wan

    tiny = {**shape, "num_layers": 1, "ffn_dim": 8, "num_attention_heads": 1, "attention_head_dim": 8}
    build_tiny_wan(out, transformer=tiny, text_encoder={"d_model": shape["text_dim"]})
    tdir = out / "transformer"
    with empty_weights():
        model = WanTransformer3DModel(**{**WAN_TRANSFORMER, **shape})
    for f in tdir.glob("*.safetensors"):
        f.unlink()
    model.register_to_config(_diffusers_version="bench")
    config = {k: v for k, v in dict(model.config).items() if not k.startswith("_")}
    (tdir / "config.json").write_text(json.dumps({"_class_name": "WanTransformer3DModel", **config}, indent=2))
    write_random_shards(model, tdir, "diffusion_pytorch_model.safetensors", torch.bfloat16)
    return out


def build_qwen3(out: Path, shape: dict[str, Any]) -> Path:
    """A Qwen3 folder with a `shape`d model of random bf16 weights (the tiny tokenizer)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from spindle.distributed.sharded_load import empty_weights
    from spindle.models.qwen3.tiny import build_tiny as build_tiny_qwen3

    build_tiny_qwen3(out, transformer={"num_hidden_layers": 1})
    config = AutoConfig.from_pretrained(out)
    for k, v in shape.items():
        setattr(config, k, v)
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    config.dtype = "bfloat16"
    with empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    for f in out.glob("model*.safetensors*"):
        f.unlink()
    config.save_pretrained(out)
    write_random_shards(model, out, "model.safetensors", torch.bfloat16)
    return out


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux)


def _worker(rank: int, world: int, overrides: list[str], out: str) -> None:
    from spindle.api import load_job_config, make_trainer

    cuda = torch.cuda.is_available()
    _reset_peak()
    row: dict[str, Any] = {"rank": rank, "rss_before_gb": _status_kb("VmRSS") / GB * 1024}
    trainer = make_trainer(load_job_config(None, overrides))
    row["load_peak_gb"] = _status_kb("VmHWM") / GB * 1024
    row["rss_after_load_gb"] = _status_kb("VmRSS") / GB * 1024
    if cuda:
        row["cuda_load_gb"] = torch.cuda.max_memory_allocated() / GB
        torch.cuda.reset_peak_memory_stats()
    _reset_peak()
    trainer.train_step()  # one optimizer step (no checkpoint or export: not what is measured)
    row["step_peak_gb"] = _status_kb("VmHWM") / GB * 1024
    row["rss_after_step_gb"] = _status_kb("VmRSS") / GB * 1024
    if cuda:
        row["cuda_step_gb"] = torch.cuda.max_memory_allocated() / GB
    Path(out, f"rank{rank}.json").write_text(json.dumps(row))


def job_overrides(kind: str, model: Path, data: Path, out: Path, sharded: bool, world: int, lora: int) -> list[str]:
    common_ = [
        *([f"train.lora.rank={lora}"] if lora else []),
        f"model.path={model}",
        f"model.sharded_load={sharded}",
        f"data.path={data}",
        f"train.output_dir={out}",
        "train.max_steps=1",
        f"train.global_batch_size={world}",
        "train.micro_batch_size=1",
        "train.keep_freed_memory=false",
        "checkpoint.resume=none",
    ]
    if torch.cuda.is_available():
        common_.append("train.mixed_precision=bf16")
    if kind == "wan":
        return [*common_, "model.max_text_length=16", "data.resolution=[32,32]", "data.num_frames=5"]
    return [*common_, "data.seq_len=128"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--models", nargs="+", default=["wan", "qwen3"], choices=["wan", "qwen3"])
    parser.add_argument("--world", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--lora", type=int, default=0, metavar="RANK", help="train LoRA adapters of this rank")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="extra job-config overrides")
    parser.add_argument("--paths", nargs="+", default=["sharded", "full"], choices=["sharded", "full"])
    parser.add_argument("--work", type=Path, default=None, help="folder for the checkpoints (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "load_memory.json")
    args = parser.parse_args()

    from spindle.data.synthetic import make_shapes_video_dataset, make_text_corpus

    work = args.work or Path(tempfile.mkdtemp(prefix="spindle-load-memory-"))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    rows = []
    if missing := [k for k in args.models if k not in PRESETS[args.preset]]:
        parser.error(
            f"--preset {args.preset} has no {' / '.join(missing)} shape; pass --models {' '.join(PRESETS[args.preset])}"
        )
    for kind in args.models:
        shape = PRESETS[args.preset][kind]
        model = work / kind
        if not (model / ("model_index.json" if kind == "wan" else "config.json")).is_file():
            (build_wan if kind == "wan" else build_qwen3)(model, shape)
        data = (
            make_shapes_video_dataset(work / "videos", num_videos=8, num_frames=5, size=(32, 32))
            if kind == "wan"
            else make_text_corpus(work / "text", num_docs=16, seed=0)
        )
        params = _count_params(model, kind)
        for world in args.world:
            for sharded in (p == "sharded" for p in args.paths):
                out = work / f"run-{kind}-{world}-{sharded}"
                out.mkdir(parents=True, exist_ok=True)
                overrides = [*job_overrides(kind, model, data, out / "train", sharded, world, args.lora), *args.set]
                spawn(_worker, world, overrides, str(out), backend=backend)
                ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
                row = {
                    "model": kind,
                    "params_b": params / 1e9,
                    "fp32_gb": params * 4 / GB,
                    "path": "sharded" if sharded else "full",
                    "lora_rank": args.lora,
                    "processes": world,
                    "ranks": ranks,
                    **{
                        f"max_{k}": max(r[k] for r in ranks)
                        for k in (
                            "rss_before_gb",
                            "load_peak_gb",
                            "rss_after_load_gb",
                            "step_peak_gb",
                            "rss_after_step_gb",
                            "cuda_load_gb",
                            "cuda_step_gb",
                        )
                        if k in ranks[0]
                    },
                }
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "ranks"}), flush=True)
    columns: list[common.Column] = [
        ("model", "model", "<7", ""),
        ("path", "path", "<9", ""),
        ("procs", "processes", ">6", ""),
        ("fp32 GB", "fp32_gb", ">9", ".2f"),
        ("before GB", "max_rss_before_gb", ">11", ".2f"),
        ("load peak GB", "max_load_peak_gb", ">14", ".2f"),
        ("step peak GB", "max_step_peak_gb", ">14", ".2f"),
    ]
    common.print_table(columns, rows)
    report = {
        "preset": args.preset,
        "lora_rank": args.lora,
        "overrides": args.set,
        "device": common.describe_device(),
        "rows": rows,
    }
    common.write_report(report, args.out)


def _count_params(model: Path, kind: str) -> int:
    from safetensors import safe_open

    folder = model / "transformer" if kind == "wan" else model
    total = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                n = 1
                for d in h.get_slice(k).get_shape():
                    n *= d
                total += n
    return total


if __name__ == "__main__":
    main()
