"""The VLM task: a transformers image-text-to-text model (Qwen2.5-VL ...) trained on next-token loss
over image/video conversations. It is the causal-LM task (`CausalLMTask`: loading, activation
checkpointing, FSDP2 per block from `_no_split_modules` — vision blocks and decoder layers —, the summed
loss, export) with what vision adds:

- Data: `spindle.data.multimodal` rows (per-document 3-D RoPE positions with text positions in row 0,
  so packed documents never attend to each other; vision inputs in token order).
- Freezing: `train.freeze` names parts of the family (`VLMFamily.parts`: vision, aligner, language);
  their parameters get `requires_grad=False` before FSDP, so they carry no gradient and no optimizer
  state (the optimizer takes trainable parameters only). LoRA: `train.lora.parts` picks the parts whose
  blocks get adapters (default the language model; spindle/train/tasks/vlm_lora.py), and freezing leaves
  the adapters trainable.
- A hook on the language model's input (`VisionStep`), inside the model's own forward so FSDP2's root
  hooks stay in charge: (1) a micro-batch without an image (or video, or audio clip on an omni model)
  still runs that tower on a dummy input, its output added with weight zero, so every data-parallel
  rank runs the same FSDP2 collectives of the tower's blocks in forward and backward (no hang, no
  gradient change); the dummies keep the model's tower order (pre-hooks on each tower), so ranks
  holding different modalities run their towers' collectives in the same order; (2) under
  Ulysses SP, the full sequence's embeddings (vision filled back in) and positions (computed on whole
  documents, before the split) are cut to this rank's chunk, and the language model runs on the chunk.
  The vision tower's blocks run on this rank's chunk of the patches too (attention: an all-to-all over its
  heads), gathered before the mergers (spindle/distributed/vision_sequence_parallel.py), so its merged output
  is whole on every rank (a family without, `VLMFamily.vision_sequence_parallel` False: the whole tower on every
  rank). A family whose image tokens attend both ways (Gemma 3) gets the full rows' blocks to its attention
  (`mask_inputs`).
- Export: the causal-LM transformers folder plus the image processor's preprocessor_config.json; the
  tokenizer carries the chat template. `AutoModelForImageTextToText.from_pretrained` loads it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from spindle.config import CausalLMJobConfig, ConfigError, VLMJobConfig
from spindle.contracts.family import CausalLMFamily, VLMFamily, import_object
from spindle.contracts.parallel import ParallelPlan
from spindle.contracts.protocols import ParallelDimsLike
from spindle.distributed.mesh import is_main_process
from spindle.ops.varlen_attention import document_ids
from spindle.train.lora import is_lora_name
from spindle.train.parts.experts import PADDING_MASK_KEY
from spindle.train.tasks.base import resumable_loader
from spindle.train.tasks.causal_lm import (
    CausalLMTask,
    PreferenceInputs,
    RowsRun,
    causal_lm_log_probs,
    causal_lm_output,
)

if TYPE_CHECKING:
    from pathlib import Path

    from spindle.data.loader import ResumableLoader
    from spindle.data.multimodal import VisionProcessor
    from spindle.distributed.mesh import Mesh
    from spindle.distributed.sharded_load import TensorSource

log = logging.getLogger("spindle.train")

# The media inputs of a batch (spindle.data.multimodal.collate_vision), passed to the model as they are.
VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
AUDIO_KEYS = ("input_features", "feature_attention_mask")
# Which tower call each kind of input makes: images and videos each run the vision tower once per forward,
# audio clips the audio encoder once.
KIND_INPUT = {"image": "pixel_values", "video": "pixel_values_videos", "audio": "input_features"}


def checkpoint_names(model: torch.nn.Module) -> dict[str, str]:
    """{the model's state-dict name: its name in the checkpoint}: transformers renames VLM keys on load
    (`model.layers.*` -> `model.language_model.layers.*`, `visual.*` -> `model.visual.*`); its own reverse
    mapping (what `save_pretrained` applies) run on meta stand-ins gives the correspondence, unchanged
    names included."""
    from transformers.core_model_loading import revert_weight_conversion

    state = {k: torch.empty(v.shape, device="meta") for k, v in model.state_dict().items()}
    by_id = {id(t): k for k, t in state.items()}
    return {by_id[id(t)]: ck for ck, t in revert_weight_conversion(model, state).items() if id(t) in by_id}


def renamed_by_prefix(names: dict[str, str], key: str) -> str:
    """`key`, in none of `names` (a MoE's per-expert tensor: split from a fused one on export, fused on load),
    renamed as its module's tensors are: by the prefix rename (e.g. `thinker.model.` -> `model.language_model.`)
    of the longest prefix of `key` that `names` renames, a name's prefix being what precedes the dotted
    components it shares, at its end, with its rename."""
    best = ("", "")
    for name, rename in names.items():
        a, b = name.split("."), rename.split(".")
        common = 0
        while common < min(len(a), len(b)) and a[-1 - common] == b[-1 - common]:
            common += 1
        prefix = ".".join(a[: len(a) - common]) + "."
        if key.startswith(prefix) and len(prefix) > len(best[0]):
            best = (prefix, ".".join(b[: len(b) - common]) + "." if common < len(b) else "")
    return best[1] + key[len(best[0]) :]


def module_at(model: torch.nn.Module, dotted: str) -> torch.nn.Module:
    module: torch.nn.Module = model.get_submodule(dotted)
    return module


def dummy_vision(tower: Any, like: torch.Tensor) -> torch.Tensor:
    """Zero times a vision tower's output on its smallest input (one merged token), in the tower's dtype (as
    the model casts pixels)."""
    cfg = tower.config
    merge = int(getattr(tower, "spatial_merge_size", 1))
    patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    grid = torch.tensor([[1, merge, merge]], device=like.device)
    pixels = torch.zeros(merge**2, patch_dim, device=like.device, dtype=tower.dtype)
    out = tower(pixels, grid_thw=grid)
    # every output the model uses (deepstack features too: Qwen3-VL), so every parameter gets its gradient
    used = [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]
    zero: torch.Tensor = sum(t.sum() for t in used) * 0.0
    return zero


# mel frames of the dummy clip: the fewest that leave one token after the encoder's two stride-2 steps
DUMMY_AUDIO_FRAMES = 4


def dummy_audio(tower: Any, like: torch.Tensor) -> torch.Tensor:
    """Zero times an audio encoder's output on a clip of a few silent mel frames."""
    frames = torch.zeros(tower.config.num_mel_bins, DUMMY_AUDIO_FRAMES, device=like.device, dtype=tower.dtype)
    lengths = torch.tensor([DUMMY_AUDIO_FRAMES], device=like.device)
    out = tower(frames, feature_lens=lengths)
    zero: torch.Tensor = out.last_hidden_state.sum() * 0.0
    return zero


class VisionStep:
    """The towers' and the language model's input hooks (module docstring).

    `towers`: per kind of input (image, video, audio), the dummy forward of the tower that takes it;
    `order`: the order in which the model's forward runs its towers (`VLMFamily.tower_order`). The task
    calls `start` per micro-batch. A missing kind's dummy runs where the model would have run that tower:
    just before the next real tower call that comes after it in `order` (a pre-hook on each tower), or in
    the language-model hook for kinds after the last real one. So every rank runs its towers' FSDP2
    collectives in the same order whatever its micro-batch holds (two towers in different orders would
    pair one rank's audio all-gather with another's vision all-gather: a hang or wrong weights). The
    dummies' zero outputs join the embeddings in the language-model hook."""

    def __init__(
        self,
        towers: dict[str, Callable[[torch.Tensor], torch.Tensor]],
        order: tuple[str, ...],
        sp_rank: int,
        sp: int,
    ):
        self.towers, self.order = towers, order
        self.sp_rank, self.sp = sp_rank, sp
        self.plan: list[tuple[str, bool]] = []  # (kind, present) of this micro-batch's tower calls, in order
        self.zeros: list[torch.Tensor] = []
        self.in_dummy = False
        self.like = torch.zeros(())  # device of the dummy inputs

    def start(self, present: set[str], expected: set[str], like: torch.Tensor) -> None:
        """A micro-batch holding the kinds `present`, of a dataset with the kinds `expected`."""
        self.plan = [(k, k in present) for k in self.order if k in present or k in expected]
        self.zeros, self.like = [], like

    def run_dummies(self, until_real: bool) -> None:
        """The dummies of the plan's missing kinds up to its next real call (`until_real`), or all that are left."""
        while self.plan:
            kind, present = self.plan.pop(0)
            if present:
                if until_real:
                    return
                continue
            self.in_dummy = True
            try:
                self.zeros.append(self.towers[kind](self.like))
            finally:
                self.in_dummy = False

    def before_tower(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if not self.in_dummy:  # a real call: the missing kinds the model would have run first
            self.run_dummies(until_real=True)

    def __call__(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        embeds = kwargs["inputs_embeds"]
        self.run_dummies(until_real=False)
        for zero in self.zeros:
            # its FSDP2 all-gathers and reduce-scatters run, and nothing changes numerically
            embeds = embeds + zero.to(embeds.dtype)
        self.zeros = []
        if self.sp > 1:
            chunk = embeds.shape[1] // self.sp
            part = slice(self.sp_rank * chunk, (self.sp_rank + 1) * chunk)
            embeds = embeds[:, part]
            kwargs["position_ids"] = kwargs["position_ids"][..., part].contiguous()
            mask = kwargs.get("visual_pos_masks")
            if mask is not None:  # deepstack (Qwen3-VL): the vision features of this chunk's vision tokens
                order = mask.flatten().cumsum(0).view(mask.shape) - 1  # row-major index among vision tokens
                mine = order[:, part][mask[:, part]]
                kwargs["visual_pos_masks"] = mask[:, part]
                kwargs["deepstack_visual_embeds"] = [e[mine] for e in kwargs["deepstack_visual_embeds"]]
        kwargs["inputs_embeds"] = embeds
        return args, kwargs


class VLMTask(CausalLMTask):
    name = "vlm"
    config_class = VLMJobConfig
    export_files: tuple[str, ...] = (
        "preprocessor_config.json",
        "processor_config.json",
        "video_preprocessor_config.json",
    )
    # the batch keys the model's forward takes besides the token rows
    input_keys: tuple[str, ...] = VISION_KEYS

    cfg: VLMJobConfig
    family: VLMFamily

    def __init__(self, cfg: VLMJobConfig, family: VLMFamily, mesh: Mesh, device: torch.device, precision: str) -> None:
        if not isinstance(family, VLMFamily):
            raise ConfigError(f"model {cfg.model.path} is a {family.name} {family.kind} model, not a VLM")
        super().__init__(cfg, family, mesh, device, precision)
        self.vision_step: VisionStep | None = None
        self.dataset_kinds: set[str] = set()
        self._image_token_id: int | None = None  # read from the config at the first `mask_inputs`
        self._text_config: Any = None  # the decoder's config and attention, read at the first packed `mask_inputs`

    @classmethod
    def check_plan(cls, cfg: CausalLMJobConfig, family: CausalLMFamily, dims: ParallelDimsLike) -> None:
        super().check_plan(cfg, family, dims)
        assert isinstance(cfg, VLMJobConfig) and isinstance(family, VLMFamily), "the VLM task's own schema"
        if unknown := sorted(set(cfg.train.freeze) - set(family.parts)):
            raise ConfigError(
                f"train.freeze names {unknown}, which {family.name} models do not have; "
                f"their parts: {sorted(family.parts)}"
            )
        if cfg.data.use_audio_in_video and not getattr(family, "video_audio_layout", None):
            why = (
                "Spindle does not lay out a video's audio track for them yet"
                if family.audio_tower
                else "they do not take a video's audio track"
            )
            raise ConfigError(f"data.use_audio_in_video: {family.name} models: {why}; set it to false")
        if cfg.train.lora is not None:
            from spindle.train.tasks.vlm_lora import check_lora_parts

            check_lora_parts(family, cfg.train.lora, cfg.train.freeze)
        elif set(cfg.train.freeze) >= set(family.parts):
            raise ConfigError(f"train.freeze={cfg.train.freeze} freezes every part: nothing is left to train")

    @classmethod
    def text_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        text: dict[str, Any] = config.get("text_config") or config
        return text

    def video_audio_layout(self) -> Callable[..., str] | None:
        """The family's placeholder of a video with its audio track (data.use_audio_in_video); None: unused."""
        return None

    # ------------------------------------------------------------ set-up

    def lora_blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The modules of the parts `train.lora.parts` names (default: the language model's decoder layers);
        spindle/train/tasks/vlm_lora.py."""
        from spindle.distributed.blocks import find_blocks
        from spindle.train.tasks.vlm_lora import lora_regions

        assert self.cfg.train.lora is not None, "called for a LoRA run"
        blocks = find_blocks(model, self.parallel_plan().blocks)
        return lora_regions(self.family, model, blocks, self.cfg.train.lora.parts)

    def named_sources(self) -> dict[str, TensorSource]:
        """The checkpoint's tensors under the model's names (`checkpoint_names`)."""
        sources = super().named_sources()
        renamed = self.checkpoint_names(self.family, self.empty_model())
        taken = set(renamed.values())
        out = {name: sources[ck] for name, ck in renamed.items() if ck in sources}
        # Unmapped keys (a MoE checkpoint's per-expert tensors, which the MoE task fuses next) under the model's
        # name of their module; keys of no renamed module stay as they are, named by the check.
        inverse = {ck: name for name, ck in renamed.items()}
        out.update({renamed_by_prefix(inverse, k): v for k, v in sources.items() if k not in taken})
        return out

    def input_plan(self) -> ParallelPlan:
        # Ulysses SP replaces the language model's attention only; the vision tower keeps its own
        return ParallelPlan("transformers", sequence_parallel_module=self.family.language_model)

    def prepare_model(self, model: torch.nn.Module) -> None:
        """Before parallelizing, on either load path: `train.freeze` (frozen parts get no gradient, so no
        optimizer state), LoRA (the base task's), and the language model's pre-hook that fills the vision
        embeddings in (a dummy vision forward on a text-only micro-batch; the rank's chunk under SP)."""
        super().prepare_model(model)
        if (lora := self.cfg.train.lora) is not None:
            from spindle.train.tasks.vlm_lora import check_adapted_parts

            check_adapted_parts(self.family, model, lora.parts)
        # LoRA froze every base weight already; a frozen part's adapters (train.lora.parts) still train
        frozen = set(self.cfg.train.freeze)
        for name, param in model.named_parameters():
            if self.family.part_of(name) in frozen and not is_lora_name(name):
                param.requires_grad_(False)
        vision = module_at(model, self.family.vision_tower)
        if self.mesh.dims.sp > 1 and self.family.vision_sequence_parallel:  # its blocks on this rank's patches
            from spindle.distributed.vision_sequence_parallel import enable_vision_sequence_parallel

            enable_vision_sequence_parallel(vision, self.mesh.sp.get_group(), self.mesh.sp_rank, self.mesh.dims.sp)
        # the family's dummy on the whole model (it reaches the projector too), else Qwen-VL's on the tower
        dummy = (
            partial(import_object(self.family.vision_dummy), model)
            if self.family.vision_dummy
            else partial(dummy_vision, vision)
        )
        towers: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {kind: dummy for kind in ("image", "video")}
        modules = [vision]
        if self.family.audio_tower:
            modules.append(module_at(model, self.family.audio_tower))
            towers["audio"] = partial(dummy_audio, modules[-1])
        step = self.vision_step = VisionStep(towers, self.family.tower_order, self.mesh.sp_rank, self.mesh.dims.sp)
        for tower in modules:
            tower.register_forward_pre_hook(step.before_tower)
        module_at(model, self.family.language_model).register_forward_pre_hook(step, with_kwargs=True)

    def vision_processor(self) -> VisionProcessor:
        """The model's processor side (tokenizer, image / video / audio processing, RoPE positions) with the
        job's `data:` options."""
        from spindle.data.multimodal import VisionOptions, VisionProcessor

        data = self.cfg.data
        return VisionProcessor(
            self.cfg.model.path,
            self.tokenizer,
            self.model_config(),
            self.family.rope_index_fn(),
            VisionOptions(data.min_pixels, data.max_pixels, data.fps, data.max_frames),
            video_timestamps=self.family.video_timestamps,
            video_grid_seconds=self.family.video_grid_seconds,
            audio=bool(self.family.audio_tower),
            video_audio_layout=self.video_audio_layout(),
            audio_tokens=self.family.audio_tokens_fn(),
            images=self.family.image_layout(),
        )

    def preference_inputs(self) -> PreferenceInputs:
        """Preference pairs with media in their prompts (spindle.data.media_preference); the kinds of media read
        join `dataset_kinds` (the towers every rank runs, really or as a dummy)."""
        from spindle.data.media_preference import (
            collate_media_pairs,
            collate_media_sequences,
            media_pair_tokenizer,
            media_prompt_tokenizer,
            prompt_step_inputs,
        )

        processor = self.vision_processor()
        tokenize = media_pair_tokenizer(processor)

        def recording(example: dict[str, Any], file: Path) -> tuple[list[int], list[int], list[int], list[Any]]:
            out = tokenize(example, file)
            self.dataset_kinds |= {m.kind for m in out[3]}  # in place: a reference twin shares the set
            return out

        def recording_prompt(prompt: Any, file: Path) -> tuple[list[int], list[Any]]:
            ids, media = tokenize_prompt(prompt, file)
            self.dataset_kinds |= {m.kind for m in media}
            return ids, media

        def rollout_inputs(example: Any, rows: int) -> Callable[[int], dict[str, Any]]:
            step = prompt_step_inputs(processor, example.prompt_ids, example.media, rows, self.device)
            prompt = torch.tensor(example.prompt_ids, device=self.device).expand(rows, -1)

            def inputs(t: int) -> dict[str, Any]:
                # the prompt's forward reads its image blocks; the next tokens' attend causally (as generate() does)
                out = {**step(t), **(self.mask_inputs(prompt) if t == 0 else {})}
                assert self.vision_step is not None, "build_model installs the vision hook"
                # the prompt's forward runs its towers (and the dummies of the data's other kinds, as every rank
                # does in lockstep); the next tokens' forwards run none
                present = {k for k, key in KIND_INPUT.items() if key in out}
                self.vision_step.start(present, self.dataset_kinds if t == 0 else set(), out["position_ids"])
                return out

            return inputs

        tokenize_prompt = media_prompt_tokenizer(processor)
        return PreferenceInputs(
            recording,
            frozenset(processor.media_ids),
            partial(collate_media_pairs, processor=processor),
            partial(collate_media_sequences, processor=processor),
            tokenize_prompt=recording_prompt,
            rollout_inputs=rollout_inputs,
        )

    def build_reference(self, path: str | Path) -> tuple[CausalLMTask, torch.nn.Module]:
        twin, model = super().build_reference(path)
        assert isinstance(twin, VLMTask)
        twin.dataset_kinds = self.dataset_kinds  # the same set: the kinds the data holds, known once it is read
        return twin, model

    def document_loader(self) -> ResumableLoader:
        """This rank's micro-batches of the job's conversations (images, videos, audio) as token rows with
        per-document 3-D positions and the media inputs in token order."""
        from spindle.data.multimodal import build_conversation_dataset

        data = self.cfg.data
        processor = self.vision_processor()
        packing = self.packs(self.cfg, self.family)
        dataset = build_conversation_dataset(data.path, processor, data.seq_len, packing, data.skip_bad_samples)
        s = dataset.stats
        self.dataset_kinds = {k for k, n in (("image", s.images), ("video", s.videos), ("audio", s.audios)) if n}
        self._data_stats = {  # the run summary's data counts (and its epoch count from rows)
            "documents": s.documents,
            "rows": s.rows,
            "label_tokens": s.label_tokens,
            "images": s.images,
            "videos": s.videos,
            "audio_clips": s.audios,
            "truncated": s.truncated,
            "skipped": s.skipped,
        }
        if is_main_process():
            log.info(
                "data: %d conversations (%d images, %d videos, %d audio clips) -> %d rows of %d tokens (%s), "
                "%d label tokens; %d cut to seq_len, %d bad lines skipped",
                s.documents,
                s.images,
                s.videos,
                s.audios,
                s.rows,
                data.seq_len,
                "packed" if packing else "one conversation per row",
                s.label_tokens,
                s.truncated,
                s.skipped,
            )
        from spindle.data.multimodal import collate_conversations

        # each micro-batch padded to its longest row, a multiple of the SP degree (every SP rank an equal chunk)
        return resumable_loader(self, dataset, partial(collate_conversations, multiple=self.mesh.dims.sp))

    @classmethod
    def export_layout(
        cls, family: CausalLMFamily, model: torch.nn.Module, state: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The trained state under the checkpoint's names (the input's layout), as `save_pretrained` writes
        them. The names come from a meta skeleton of the model's own class: transformers' reverse mapping
        renames nothing on an FSDP2-wrapped model (its class is FSDP's subclass)."""
        from transformers import PreTrainedModel

        from spindle.distributed.sharded_load import empty_weights
        from spindle.export.transformers import unique_weights

        base: Any = next(
            c for c in type(model).__mro__ if issubclass(c, PreTrainedModel) and not c.__name__.startswith("FSDP")
        )
        with empty_weights():
            skeleton = base._from_config(model.config)
        names = cls.checkpoint_names(family, skeleton)
        # a tied parameter's second name (Gemma 3's lm_head.weight) is dropped first, as save_pretrained drops it:
        # renamed, it would no longer be known as the alias it is
        state = unique_weights(model, state)
        return {names.get(k) or renamed_by_prefix(names, k): v for k, v in state.items()}

    @classmethod
    def checkpoint_names(cls, family: CausalLMFamily, model: torch.nn.Module) -> dict[str, str]:
        """{the model's state-dict name: its name in the checkpoint} (`checkpoint_names`)."""
        return checkpoint_names(model)

    # ------------------------------------------------------------ step

    def mask_inputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> dict[str, Any]:
        """What the model's attention mask reads besides positions where the family's model builds its mask from
        `token_type_ids` (1 on image tokens; `VLMFamily.token_type_ids`: Gemma 3's image soft tokens attend to
        each other both ways); {} otherwise. With the rows' whole `position_ids` (a training forward), also:

        - under Ulysses SP, the full rows' image blocks (`ulysses_attention.BLOCKS_KWARG`), which the model's
          attention reads on every rank (the model builds no mask under SP);
        - rows of packed documents, the decoder's masks built here (spindle.ops.packed_block_masks: transformers'
          own sliding-window mask of a packed row looks the blocks up by in-document position)."""
        if not self.family.token_type_ids:
            return {}
        from spindle.ops.windowed_attention import block_ids

        if self._image_token_id is None:
            self._image_token_id = int(self.model_config().image_token_id)
        token_types = (input_ids == self._image_token_id).long()
        out: dict[str, Any] = {"token_type_ids": token_types}
        if position_ids is None:
            return out
        blocks = block_ids(token_types == 1)
        if self.mesh.dims.sp > 1:
            from spindle.distributed.ulysses_attention import BLOCKS_KWARG

            if blocks is not None:
                out[BLOCKS_KWARG] = blocks
        elif document_ids(position_ids) is not None:
            from spindle.ops.packed_block_masks import packed_block_masks

            if self._text_config is None:
                self._text_config = self.model_config().get_text_config()
                self._text_config._attn_implementation = self.attention(self.cfg, self.precision, self.family)
            config = self._text_config
            out["attention_mask"] = packed_block_masks(config, config._attn_implementation, position_ids, blocks)
        return out

    def media_inputs(
        self, batch: dict[str, torch.Tensor], input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> dict[str, Any]:
        """The media inputs of `batch` (on the device) and the mask inputs of its `input_ids` (`mask_inputs`, with
        the rows' `position_ids` where given) for the model's next forward, whose tower hooks are set for the kinds
        they hold (the dummies of the data's other kinds)."""
        vision = {k: batch[k].to(self.device) for k in self.input_keys if k in batch}
        vision.update(self.mask_inputs(input_ids, position_ids))
        assert self.vision_step is not None, "build_model installs the vision hook"
        present = {k for k, key in KIND_INPUT.items() if key in vision}
        self.vision_step.start(present, self.dataset_kinds, input_ids)
        return vision

    def scoring_inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The text rows' (the attention mask), each row's positions (the family's multimodal RoPE where it has
        one) and the rows' media inputs (`media_inputs`)."""
        ids = batch["input_ids"].to(self.device)
        position_ids = batch["position_ids"].to(self.device)
        return {
            **super().scoring_inputs(batch),
            "position_ids": position_ids,
            **self.media_inputs(batch, ids, position_ids),
        }

    def run_rows(
        self, model: torch.nn.Module, batch: dict[str, torch.Tensor], log_probs: bool = False, **model_kwargs: Any
    ) -> RowsRun:
        """Collective: the rows with their media through the model (the towers' dummy forwards where a kind is
        missing; under SP the language-model hook cuts embeddings and positions to this rank's chunk)."""
        ids = batch["input_ids"]
        keys = ("input_ids", "position_ids", "shift_labels", PADDING_MASK_KEY)
        rows = {k: batch[k].to(self.device) for k in keys if k in batch}
        vision = self.media_inputs(batch, rows["input_ids"], rows.get("position_ids"))
        if self.mesh.dims.sp > 1:
            # Labels (and the padding mask of task hooks) are cut here; input ids and positions stay whole (the
            # model fills the vision embeddings into the full sequence) and the language-model hook cuts
            # embeddings and positions.
            chunk = ids.shape[1] // self.mesh.dims.sp
            start = self.mesh.sp_rank * chunk
            for key in ("shift_labels", PADDING_MASK_KEY):
                if key in rows:
                    rows[key] = rows[key][:, start : start + chunk].contiguous()
        with self._autocast():
            if log_probs:
                kwargs: dict[str, Any] = {**vision, **self.model_kwargs(rows), **model_kwargs}
                out, logps = causal_lm_log_probs(model, rows, **kwargs)
                return RowsRun(out, rows, ids.shape[0], ids.numel(), logps)
            out = causal_lm_output(model, rows, **vision, **self.model_kwargs(rows), **model_kwargs)
        return RowsRun(out, rows, ids.shape[0], ids.numel())
