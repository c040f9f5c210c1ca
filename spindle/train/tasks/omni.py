"""The omni task: the VLM task (`VLMTask`) on an omni-modal checkpoint (Qwen2.5-Omni), training its thinker
(audio encoder + vision tower + decoder -> text) on audio/image/video conversations.

- Model: the family's sub-model class (`OmniFamily.model_class`), configured by its part of config.json
  (transformers' sub-config lookup) and fed only its own tensors: the talker and the speech decoder
  (`OmniFamily.untrained` prefixes) are never read, on either load path, so they take no memory or time
  on the training devices.
- Towers: the audio encoder is one more tower of the VLM task's input hook (a micro-batch without audio
  runs it on a few silent frames with weight zero, so data-parallel ranks run the same FSDP2
  collectives). FSDP2 wraps each encoder layer, vision block and decoder layer (`OmniFamily.blocks`: the
  model's `_no_split_modules` names the whole towers, which would make each tower one unit).
- SP: Ulysses splits the decoder's sequence only. The audio encoder runs whole on every SP rank, like
  the vision tower: it attends within windows of `n_window * 2` mel frames (a few seconds), so its cost
  grows linearly with the clip and is small next to the decoder's (docs/omni.md has the measurement).
- Export: the trained thinker under the checkpoint's names, written as the causal-LM task writes its
  folders, then completed (`finish_export`) with the untrained tensors copied from the input checkpoint
  as they are stored (same bytes, same dtype, in a file of their own), the input's whole config.json
  (its thinker part's dtype set to the export's), and the processor files and speaker table. The full
  model class (`Qwen2_5OmniForConditionalGeneration`) loads the folder.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from spindle.config import CausalLMJobConfig, ConfigError
from spindle.contracts.family import CausalLMFamily, OmniFamily
from spindle.contracts.parallel import ParallelPlan
from spindle.contracts.protocols import ParallelDimsLike
from spindle.export.omni import copy_untrained, write_full_config
from spindle.train.tasks.vlm import AUDIO_KEYS, VLMTask

if TYPE_CHECKING:
    from spindle.distributed.sharded_load import TensorSource
    from spindle.export.dtypes import ExportDtypes


MERGE_REFUSED = (
    "{key}: a merged omni export would need the talker and token2wav rewritten with it; export the adapters "
    "({off}) and merge them into the thinker when loading"
)


class OmniTask(VLMTask):
    name = "omni"
    export_files = (*VLMTask.export_files, "spk_dict.pt", "chat_template.json")
    # images, videos (their positions are in the rows, so no seconds-per-grid) and audio clips
    input_keys = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", *AUDIO_KEYS)

    family: OmniFamily

    @classmethod
    def check_plan(cls, cfg: CausalLMJobConfig, family: CausalLMFamily, dims: ParallelDimsLike) -> None:
        if not isinstance(family, OmniFamily):
            raise ConfigError(f"model {cfg.model.path} is a {family.name} {family.kind} model, not an omni model")
        super().check_plan(cfg, family, dims)
        if cfg.train.lora is not None and cfg.export.merge_lora:
            raise ConfigError(MERGE_REFUSED.format(key="export.merge_lora", off="export.merge_lora: false"))

    @classmethod
    def export_checkpoint(
        cls,
        family: CausalLMFamily,
        checkpoint: Path,
        model_path: Path,
        out: Path,
        dtype: str = "auto",
        merge: bool = False,
    ) -> Path:
        if merge:
            raise ConfigError(MERGE_REFUSED.format(key="--merge", off="without --merge"))
        return super().export_checkpoint(family, checkpoint, model_path, out, dtype)

    @classmethod
    def text_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        thinker: dict[str, Any] = config.get("thinker_config") or config
        return super().text_config(thinker)

    def model_config(self) -> Any:
        """The thinker's config (transformers reads the `thinker_config` part of the folder's config.json)."""
        cls: Any = self.family.model_cls()
        return cls.config_class.from_pretrained(self.cfg.model.path)

    def video_audio_layout(self) -> Callable[..., str] | None:
        return self.family.video_audio_layout_fn() if self.cfg.data.use_audio_in_video else None

    def input_plan(self) -> ParallelPlan:
        return ParallelPlan(
            "transformers", blocks=self.family.blocks, sequence_parallel_module=self.family.language_model
        )

    @classmethod
    def checkpoint_names(cls, family: CausalLMFamily, model: torch.nn.Module) -> dict[str, str]:
        """The VLM names under the sub-model's prefix (transformers adds it only to a model it loaded from the
        whole folder, not to the meta skeletons this is computed on)."""
        assert isinstance(family, OmniFamily), "the omni task's own family"
        # A MoE thinker's names are found with its conversion registered: transformers applies no mapping,
        # forward or reverse, to a class defined outside its package (the patchgen-generated thinker) unless one
        # is registered for its model type.
        adapter = family.adapter()
        with nullcontext() if adapter is None else adapter.loading(adapter.default_layout):
            names = super().checkpoint_names(family, model)
        return {k: family.prefix + v for k, v in names.items()}

    def named_sources(self) -> dict[str, TensorSource]:
        """The thinker's tensors only: the untrained sub-models' are not the model's and are never read."""
        sources = super().named_sources()
        return {k: v for k, v in sources.items() if not self.family.is_untrained(k)}

    @classmethod
    def finish_export(cls, family: CausalLMFamily, source: str | Path) -> Callable[[Path, ExportDtypes], None] | None:
        assert isinstance(family, OmniFamily), "the omni task's own family"

        def finish(folder: Path, dtypes: ExportDtypes) -> None:
            copy_untrained(Path(source), folder, family)
            write_full_config(Path(source), folder, dtypes)

        return finish
