"""Gemma 3 image-text models (transformers `model_type` "gemma3", `Gemma3ForConditionalGeneration`: gemma-3-4b,
12b and 27b), trained by the VLM task on image conversations (Gemma 3 takes no video).

What differs from the Qwen-VL families, and where it lives:

- Images (images.py, `IMAGES`): Gemma3ImageProcessor resizes each image to the tower's fixed size (no patch grid);
  the chat template's <start_of_image> becomes "\\n\\n<start_of_image>" + `mm_tokens_per_image` x
  <image_soft_token> + "<end_of_image>\\n\\n", as Gemma3Processor expands it; pan-and-scan crops are refused.
- Positions (rope.py): 1-D, the text positions (no multimodal RoPE).
- Attention: the image's soft tokens attend to each other both ways (the model's own mask from `token_type_ids`,
  which the task passes: `VLMFamily.token_type_ids`). Packing is refused: transformers' sliding-window mask of a
  packed row looks the image blocks up by in-document position, not by row position, so a later document's
  image tokens would get another block's mask (an unset data.packing resolves to one conversation per row).
- Ulysses SP is refused (before launch): Spindle's Ulysses attention builds a causal mask (windowed per document
  on the local layers) from the full row's positions, and has no bidirectional image blocks.
- The dummy vision forward of a text-only micro-batch (vision.py) runs the SigLIP tower and the projector on one
  blank image.
"""

from spindle.contracts.family import VLMFamily

FAMILY = VLMFamily(
    name="gemma3_vl",
    model_types=("gemma3",),
    # patchgen-generated with the text family's module (../gemma3/patches.py): the chunked loss from hidden states
    model_class="spindle.models.gemma3.generated.patched_modeling_gemma3:Gemma3ForConditionalGeneration",
    vision_tower="model.vision_tower",
    language_model="model.language_model",
    tower_order=("image",),
    parts={
        "vision": ("model.vision_tower.",),
        "aligner": ("model.multi_modal_projector.",),
        "language": ("model.language_model.", "lm_head."),
    },
    token_type_ids=True,
    packing_refused=(
        "transformers' sliding-window mask of a packed row looks Gemma 3's image-token blocks up by in-document "
        "position, so the bidirectional image attention of every document after the first would be wrong"
    ),
    sequence_parallel_refused=(
        "an image's soft tokens attend to each other both ways (the model's own mask, from token_type_ids), which "
        "Spindle's Ulysses attention (causal, its mask built from the full row's positions) does not implement"
    ),
)
