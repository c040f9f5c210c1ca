"""Compose the stages of a family and load its components from `model_index.json`.

`InferencePipeline.from_pretrained(root, family, options)`:
1. the family (resolved by the entry point, `spindle.api.load_pipeline`); its `inference_spec()` -> `InferenceSpec`.
2. every component the spec needs is loaded with the class model_index.json names
   (`["diffusers", "AutoencoderKLWan"]` -> `diffusers.AutoencoderKLWan.from_pretrained(root/vae)`).
3. stages: the family's BeforeDenoisingStage, the shared DenoisingStage and DecodingStage.
4. speed options (`spindle.engine_config.EngineConfig`): default-on exact ones (CFG batching, oneDNN VAE convolutions and
   feed-forward Linear + GELU; `exact=True` turns them off to reproduce diffusers bit for bit; on
   CPU, freed host memory is kept in the process, `spindle.cpu_allocator`, which changes no number),
   step caching (diffusers cache hooks, `spindle.infer.caches`), regional `torch.compile`, and the
   multi-process modes (Ulysses SP, CFG parallel).
"""

from __future__ import annotations

import importlib
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from spindle.contracts.request import Req
from spindle.contracts.stage import BeforeDenoisingStage, InferenceSpec, Stage
from spindle.distributed.blocks import compile_blocks
from spindle.engine_config import EngineConfig
from spindle.infer.stages import DecodingStage, DenoisingStage
from spindle.model_index import read_model_index

if TYPE_CHECKING:
    from diffusers import ModelMixin  # Any to mypy: diffusers is not followed (pyproject [tool.mypy])

    from spindle.contracts.family import DiTFamily
    from spindle.infer.offload import ModuleOffload

ALLOWED_LIBRARIES = ("diffusers", "transformers")
DTYPES = {  # the names `spindle.engine_config.DType` allows
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def pipeline_module(library: str) -> Any:
    """`diffusers.pipelines.<library>`, where model_index.json names a pipeline's own module as a component's library
    (LTX-2's `["ltx2", "LTX2TextConnectors"]`, as diffusers resolves it); None when diffusers has no such pipeline."""
    if not library.isidentifier():
        return None
    try:
        return importlib.import_module(f"diffusers.pipelines.{library}")
    except ImportError:
        return None


def load_component(root: Path, name: str, entry: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """Load `root/name` with the (library, class) pair model_index.json gives for it."""
    if not (isinstance(entry, (list, tuple)) and len(entry) == 2) or entry[0] is None:
        raise FileNotFoundError(f"{root}/model_index.json has no {name!r} component (entry {entry!r})")
    library, cls_name = entry
    if library not in ALLOWED_LIBRARIES and pipeline_module(library) is None:
        raise ValueError(f"component {name!r} comes from library {library!r}; Spindle loads {ALLOWED_LIBRARIES} only")
    module = importlib.import_module(library) if library in ALLOWED_LIBRARIES else pipeline_module(library)
    cls = getattr(module, cls_name, None)
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


def load_components(root: str | Path, spec: InferenceSpec, options: EngineConfig) -> dict[str, Any]:
    root = Path(root)
    index = read_model_index(root)
    spec.check_checkpoint(index)
    device = options.torch_device()
    out: dict[str, Any] = {}
    for name in (*spec.components, *spec.expert_components):
        if name in spec.component_loaders:
            from spindle.contracts.family import import_object

            out[name] = import_object(spec.component_loaders[name])(root / name)
            continue
        dtype = DTYPES[options.vae_dtype] if name == spec.vae_component else DTYPES[options.dtype]
        out[name] = load_component(root, name, index.get(name), device, dtype)
    out.update({key: index.get(key) for key in spec.pipeline_config})
    return out


def apply_offload(spec: InferenceSpec, components: dict[str, Any], options: EngineConfig) -> dict[str, ModuleOffload]:
    """The offload options (spindle.infer.offload) on the loaded components; -> the streams by component."""
    from spindle.infer.offload import enable_vae_tiling, offload_experts, offload_text_encoders, swap_blocks

    device = options.torch_device()
    out: dict[str, ModuleOffload] = {}
    if options.blocks_to_swap:
        for name in spec.denoiser_components:
            out[name] = swap_blocks(components[name], options.blocks_to_swap, device)
    if options.expert_offload:
        out.update(offload_experts(components, spec.denoiser_components, device))
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
        options: EngineConfig,
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
        self.family: DiTFamily | None = None  # the family record it was loaded with (run-time LoRA loading reads it)

    @property
    def transformer(self) -> ModelMixin:
        return self.components[self.spec.transformer_component]

    @property
    def before_denoising(self) -> BeforeDenoisingStage:
        return next(s for s in self.stages if isinstance(s, BeforeDenoisingStage))

    @property
    def denoising(self) -> DenoisingStage:
        return next(s for s in self.stages if isinstance(s, DenoisingStage))

    @property
    def decoding(self) -> DecodingStage:
        return next(s for s in self.stages if isinstance(s, DecodingStage))

    @classmethod
    def from_pretrained(
        cls, root: str | Path, family: DiTFamily, options: EngineConfig | None = None
    ) -> InferencePipeline:
        """Load the checkpoint at `root` with `family`'s inference spec (the entry point resolved the
        family: `spindle.api.load_pipeline`)."""
        from spindle.weight_files import check_weight_files

        options = options or EngineConfig()  # validated when built
        root = Path(root)
        check_weight_files(root)  # a damaged file is named here, not as a bare SafetensorError mid-load
        spec: InferenceSpec = family.inference_spec()
        components = load_components(root, spec, options)
        if options.lora is not None:
            from spindle.infer.lora import apply_lora_file

            apply_lora_file(family, components, options.lora, options.lora_scale)
        pipeline = cls.build(spec, components, options, root=root)
        pipeline.family = family
        return pipeline

    @classmethod
    def build(
        cls, spec: InferenceSpec, components: dict[str, Any], options: EngineConfig, root: Path | None = None
    ) -> InferencePipeline:
        transformer = components[spec.transformer_component]
        experts = {name: components[name] for name in spec.expert_components}
        denoisers = [transformer, *experts.values()]
        if options.keep_freed_memory and options.torch_device().type == "cpu":
            from spindle.cpu_allocator import keep_freed_memory

            keep_freed_memory()
        mesh, cfg_group = None, None
        if options.world_size_needed > 1:
            mesh, cfg_group = setup_parallel(denoisers, options, spec)
        denoising = DenoisingStage(
            transformer,
            spec,
            cfg_batch=options.batch_cfg,
            cfg_group=cfg_group,
            sp=options.sp,
            ring=options.ring,
            experts=experts,
        )
        if options.cache not in (None, "auto"):  # "auto": DiffusionGenerator calibrates on the first request
            denoising.set_cache(options.cache, options.cache_threshold, options.cache_options)
        if options.attention_backend != "native":
            from spindle.ops.dit_attention import apply_dit_backend

            for model in denoisers:
                apply_dit_backend(model, options.attention_backend)
        if options.compile:
            for model in denoisers:
                compile_blocks(model, backend=options.compile_backend)  # regional compile: training's helper too
        vae = components[spec.vae_component]
        if not options.exact:
            from spindle.infer.speedups import memoize_constant_inputs, onednn_conv3d, onednn_linear_gelu

            for model in denoisers:
                memoize_constant_inputs(spec.request_constant_modules(model, compiled=options.compile))
            if options.onednn_vae and options.torch_device().type == "cpu":
                onednn_conv3d(vae)
            if options.fast_mlp and not options.compile and options.torch_device().type == "cpu":
                # (compiled blocks: inductor makes its own choice of GEMM and fusion)
                for model in denoisers:
                    onednn_linear_gelu(model, spec.linear_gelu_pairs(model))
        offloads = apply_offload(spec, components, options)
        stages: list[Stage] = [spec.make_before_denoising(components), denoising, DecodingStage(vae, spec, components)]
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


def setup_parallel(transformers: list[torch.nn.Module], options: EngineConfig, spec: InferenceSpec) -> tuple[Any, Any]:
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

        for transformer in transformers:  # every denoiser (a two-expert model's both) splits its sequence
            config: Any = transformer.config  # a diffusers model: its config
            enable_sequence_parallel(transformer, mesh.cp, plan=spec.sequence_parallel_plan(config))
    cfg_group = mesh.dp.get_group() if options.cfg_parallel else None
    return mesh, cfg_group
