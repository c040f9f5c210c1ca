"""Compose the stages of a family and load its components from `model_index.json`.

`InferencePipeline.from_pretrained(root, family, options)`:
1. the family (resolved by the entry point, `spindle.api.load_pipeline`); its `inference_spec()` -> `InferenceSpec`.
2. every component the spec needs is loaded with the class model_index.json names
   (`["diffusers", "AutoencoderKLWan"]` -> `diffusers.AutoencoderKLWan.from_pretrained(root/vae)`).
3. stages: the family's BeforeDenoisingStage, the shared DenoisingStage and DecodingStage.
4. speed options (`EngineOptions`): default-on exact ones (CFG batching, oneDNN VAE convolutions and
   feed-forward Linear + GELU; `exact=True` turns them off to reproduce diffusers bit for bit; on
   CPU, freed host memory is kept in the process, `spindle.cpu_allocator`, which changes no number),
   step caching (diffusers cache hooks, `spindle.infer.caches`), regional `torch.compile`, and the
   multi-process modes (Ulysses SP, CFG parallel).
"""

from __future__ import annotations

import importlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from spindle.contracts.request import Req
from spindle.contracts.stage import BeforeDenoisingStage, InferenceSpec, Stage
from spindle.infer.stages import DecodingStage, DenoisingStage

if TYPE_CHECKING:
    from diffusers import ModelMixin  # Any to mypy: diffusers is not followed (pyproject [tool.mypy])

    from spindle.contracts.family import DiTFamily
    from spindle.infer.offload import ModuleOffload

ALLOWED_LIBRARIES = ("diffusers", "transformers")
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass
class EngineOptions:
    """How the engine runs a checkpoint (not what it generates; that is `SamplingParams`)."""

    device: str | None = None  # None: cuda if available, else cpu
    dtype: str = "float32"  # transformer + text encoder
    vae_dtype: str = "float32"
    exact: bool = False  # reproduce diffusers bit for bit: no CFG batching, memoization or oneDNN VAE / feed-forward
    cfg_batch: bool = True  # cond + uncond in one forward (off when exact)
    fast_vae: bool = True  # oneDNN for the VAE's 3-D convolutions on CPU (spindle.infer.speedups; off when exact)
    fast_mlp: bool = True  # on CPU, each feed-forward's Linear + GELU as one oneDNN call (speedups; off when exact)
    compile: bool = False  # torch.compile of the transformer's repeated blocks
    cache: str | None = None  # a step cache of spindle.infer.caches.CACHE_NAMES ("auto": calibrated)
    cache_threshold: float | None = None  # the policy's main knob (None: its default)
    cache_options: dict[str, Any] = field(default_factory=dict)  # more knobs of the policy's diffusers config
    min_psnr: float = 30.0  # cache="auto": the quality floor (dB against the uncached output)
    sp: int = 1  # Ulysses sequence-parallel degree (heads must divide it)
    ring: int = 1  # ring-attention degree: the sequence is split over ring x sp processes
    cfg_parallel: bool = False  # cond / uncond on different ranks (needs 2 x ring x sp processes)
    lora: str | None = None  # a LoRA file / folder applied to the transformer (spindle.infer.lora)
    lora_scale: float = 1.0
    # on CPU: keep freed host memory in the process (spindle.cpu_allocator; bit-identical, not turned off by exact)
    keep_freed_memory: bool = True
    # Offload (spindle.infer.offload; outputs unchanged): the last N transformer blocks live in host memory and
    # are streamed to the device with a one-block prefetch (0: off)
    blocks_to_swap: int = 0
    text_encoder_offload: bool = False  # text encoders on the host, on the device only while they encode
    vae_tiling: bool = False  # diffusers' enable_tiling (+ enable_slicing): VAE memory bounded by the tile

    def validate(self) -> None:
        from spindle.infer.caches import POLICIES, check_cache_options

        for name in ("dtype", "vae_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name} must be one of {sorted(DTYPES)}; got {getattr(self, name)!r}")
        if not isinstance(self.cache_options, dict):
            raise ValueError(f"cache_options must be a dict of knob -> value; got {self.cache_options!r}")
        check_cache_options(self.cache, self.cache_threshold, self.cache_options)
        if self.exact and (self.compile or self.cache is not None):
            raise ValueError(
                "exact=True reproduces diffusers bit for bit, so it cannot be combined with "
                f"{'compile' if self.compile else 'cache=' + repr(self.cache)}; drop one of them"
            )
        policy = POLICIES.get(self.cache) if self.cache is not None else None
        reason = policy.cfg_unavailable(self.cfg_batch, self.cfg_parallel) if policy is not None else None
        if reason is not None:
            raise ValueError(reason)  # early: the denoising stage (which checks it again) does not exist yet
        if self.cache == "auto" and self.world_size_needed > 1:
            raise ValueError(
                "cache='auto' calibrates in one process; pick the policy it printed for sp / ring / cfg_parallel"
            )
        if isinstance(self.min_psnr, bool) or not isinstance(self.min_psnr, (int, float)) or self.min_psnr <= 0:
            raise ValueError(f"min_psnr must be a number of dB > 0; got {self.min_psnr!r}")
        if not isinstance(self.lora_scale, (int, float)) or isinstance(self.lora_scale, bool):
            raise ValueError(f"lora_scale must be a number; got {self.lora_scale!r}")
        for name in ("sp", "ring"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
        self._validate_offload()

    def _validate_offload(self) -> None:
        n = self.blocks_to_swap
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"blocks_to_swap must be an integer >= 0 (0: off); got {n!r}")
        for name in ("text_encoder_offload", "vae_tiling"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false; got {getattr(self, name)!r}")
        if n and self.compile:
            # the compiled block would trace the hooks that swap its weights
            raise ValueError("blocks_to_swap cannot be combined with compile; drop one of them")

    @property
    def batch_cfg(self) -> bool:
        return self.cfg_batch and not self.exact

    @property
    def onednn_vae(self) -> bool:
        return self.fast_vae and not self.exact

    @property
    def world_size_needed(self) -> int:
        return self.sp * self.ring * (2 if self.cfg_parallel else 1)

    def torch_device(self) -> torch.device:
        if self.device is None:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


def read_model_index(root: str | Path) -> dict[str, Any]:
    path = Path(root) / "model_index.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: the model must be a diffusers pipeline folder with model_index.json"
        )
    index: dict[str, Any] = json.loads(path.read_text())
    return index


def load_component(root: Path, name: str, entry: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """Load `root/name` with the (library, class) pair model_index.json gives for it."""
    if not (isinstance(entry, (list, tuple)) and len(entry) == 2) or entry[0] is None:
        raise FileNotFoundError(f"{root}/model_index.json has no {name!r} component (entry {entry!r})")
    library, cls_name = entry
    if library not in ALLOWED_LIBRARIES:
        raise ValueError(f"component {name!r} comes from library {library!r}; Spindle loads {ALLOWED_LIBRARIES} only")
    cls = getattr(importlib.import_module(library), cls_name, None)
    if cls is None:
        raise ValueError(f"model_index.json names {library}.{cls_name} for {name!r}, which this {library} lacks")
    path = root / name
    if not path.is_dir():
        raise FileNotFoundError(f"component folder {path} not found (model_index.json lists {name!r})")
    loader: Any = cls  # a diffusers / transformers class: from_pretrained is theirs, not nn.Module's
    if isinstance(cls, type) and issubclass(cls, torch.nn.Module):
        obj = loader.from_pretrained(path, dtype=dtype)
        obj.to(device).eval().requires_grad_(False)
        return obj
    return loader.from_pretrained(path)


def load_components(root: str | Path, spec: InferenceSpec, options: EngineOptions) -> dict[str, Any]:
    root = Path(root)
    index = read_model_index(root)
    spec.check_checkpoint(index)
    device = options.torch_device()
    out = {}
    for name in spec.components:
        dtype = DTYPES[options.vae_dtype] if name == spec.vae_component else DTYPES[options.dtype]
        out[name] = load_component(root, name, index.get(name), device, dtype)
    return out


def apply_compile(transformer: ModelMixin) -> None:
    """Regional compilation: `torch.compile` each repeated block (diffusers `_repeated_blocks`)."""
    if getattr(transformer, "_repeated_blocks", None):
        transformer.compile_repeated_blocks()
        return
    blocks = [m for m in transformer.children() if isinstance(m, torch.nn.ModuleList)]
    if not blocks:
        raise ValueError(f"{type(transformer).__name__} has no repeated blocks to compile")
    for modules in blocks:
        for block in modules:
            block.compile()


def apply_offload(spec: InferenceSpec, components: dict[str, Any], options: EngineOptions) -> dict[str, ModuleOffload]:
    """The offload options (spindle.infer.offload) on the loaded components; -> the streams by component."""
    from spindle.infer.offload import enable_vae_tiling, offload_text_encoders, swap_blocks

    device = options.torch_device()
    out: dict[str, ModuleOffload] = {}
    if options.blocks_to_swap:
        name = spec.transformer_component
        out[name] = swap_blocks(components[name], options.blocks_to_swap, device)
    if options.text_encoder_offload:
        out.update(offload_text_encoders(components, device))
    if options.vae_tiling:
        enable_vae_tiling(components[spec.vae_component])
    return out


class InferencePipeline:
    """Stages + loaded components of one checkpoint. `run(req)` times each stage into `req.timings`."""

    def __init__(
        self,
        spec: InferenceSpec,
        components: dict[str, Any],
        stages: list[Stage],
        options: EngineOptions,
        root: Path | None = None,
        mesh: Any = None,
    ):
        self.spec = spec
        self.components = components
        self.stages = stages
        self.options = options
        self.root = root
        self.mesh = mesh
        self.device = options.torch_device()
        self.offloads: dict[str, ModuleOffload] = {}  # what `apply_offload` streams, by component

    @property
    def transformer(self) -> ModelMixin:
        return self.components[self.spec.transformer_component]

    @property
    def before_denoising(self) -> BeforeDenoisingStage:
        return next(s for s in self.stages if isinstance(s, BeforeDenoisingStage))

    @property
    def denoising(self) -> DenoisingStage:
        return next(s for s in self.stages if isinstance(s, DenoisingStage))

    @classmethod
    def from_pretrained(
        cls, root: str | Path, family: DiTFamily, options: EngineOptions | None = None
    ) -> InferencePipeline:
        """Load the checkpoint at `root` with `family`'s inference spec (the entry point resolved the
        family: `spindle.api.load_pipeline`)."""
        options = options or EngineOptions()
        options.validate()
        root = Path(root)
        spec: InferenceSpec = family.inference_spec()
        components = load_components(root, spec, options)
        if options.lora is not None:
            from spindle.infer.lora import apply_lora_file

            apply_lora_file(family, components, options.lora, options.lora_scale)
        return cls.build(spec, components, options, root=root)

    @classmethod
    def build(
        cls, spec: InferenceSpec, components: dict[str, Any], options: EngineOptions, root: Path | None = None
    ) -> InferencePipeline:
        transformer = components[spec.transformer_component]
        if options.keep_freed_memory and options.torch_device().type == "cpu":
            from spindle.cpu_allocator import keep_freed_memory

            keep_freed_memory()
        mesh, cfg_group = None, None
        if options.world_size_needed > 1:
            mesh, cfg_group = setup_parallel(transformer, options)
        denoising = DenoisingStage(
            transformer, spec, cfg_batch=options.batch_cfg, cfg_group=cfg_group, sp=options.sp, ring=options.ring
        )
        if options.cache not in (None, "auto"):  # "auto": DiffusionGenerator calibrates on the first request
            denoising.set_cache(options.cache, options.cache_threshold, options.cache_options)
        if options.compile:
            apply_compile(transformer)
        vae = components[spec.vae_component]
        if not options.exact:
            from spindle.infer.speedups import memoize_constant_inputs, onednn_conv3d, onednn_linear_gelu

            memoize_constant_inputs(spec.request_constant_modules(transformer, compiled=options.compile))
            if options.onednn_vae and options.torch_device().type == "cpu":
                onednn_conv3d(vae)
            if options.fast_mlp and not options.compile and options.torch_device().type == "cpu":
                # (compiled blocks: inductor makes its own choice of GEMM and fusion)
                onednn_linear_gelu(transformer, spec.linear_gelu_pairs(transformer))
        offloads = apply_offload(spec, components, options)
        stages: list[Stage] = [spec.make_before_denoising(components), denoising, DecodingStage(vae, spec)]
        pipeline = cls(spec, components, stages, options, root=root, mesh=mesh)
        pipeline.offloads = offloads
        return pipeline

    def run(self, req: Req) -> Req:
        def sync() -> None:  # stage timings on CUDA need the queued kernels finished
            if self.device.type == "cuda":
                torch.cuda.synchronize()

        for stage in self.stages:
            sync()
            start = time.perf_counter()
            req = stage(req)
            sync()
            req.timings[stage.name] = time.perf_counter() - start
        return req


# ---------------------------------------------------------------- multi-process helpers


def is_main_rank() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def setup_parallel(transformer: torch.nn.Module, options: EngineOptions) -> tuple[Any, Any]:
    """Mesh for the multi-process modes; -> (mesh, cfg process group or None).

    Mesh dims (spindle.distributed.mesh): `sp` = Ulysses degree, `ring` = ring-attention degree; the
    data dim `dp_shard` (size 2) carries the CFG branches when `cfg_parallel` (rank 0 of it: cond,
    rank 1: uncond). Sequence parallelism uses the same code as training:
    `spindle.distributed.context_parallel`.
    """
    from spindle.distributed.mesh import ParallelDims, build_mesh, init_distributed

    _, world = init_distributed()
    if world != options.world_size_needed:
        raise ValueError(
            f"sp={options.sp} x ring={options.ring}{' x 2 (cfg_parallel)' if options.cfg_parallel else ''} needs "
            f"{options.world_size_needed} processes, but the world size is {world}; launch with "
            f"--nproc {options.world_size_needed} (or torchrun --nproc-per-node {options.world_size_needed})"
        )
    dims = ParallelDims(dp_replicate=1, dp_shard=2 if options.cfg_parallel else 1, sp=options.sp, ring=options.ring)
    mesh = build_mesh(dims)
    if dims.cp_size > 1:
        from spindle.distributed.context_parallel import enable_sequence_parallel

        enable_sequence_parallel(transformer, mesh.cp)
    cfg_group = mesh.dp.get_group() if options.cfg_parallel else None
    return mesh, cfg_group
