"""Gemma 3 image-text models (transformers `model_type` "gemma3", `Gemma3ForConditionalGeneration`: gemma-3-4b,
12b and 27b), trained by the VLM task on image conversations (Gemma 3 takes no video).

What differs from the Qwen-VL families, and where it lives:

- Images (images.py, `IMAGES`): Gemma3ImageProcessor resizes each image to the tower's fixed size (no patch grid);
  the chat template's <start_of_image> becomes "\\n\\n<start_of_image>" + `mm_tokens_per_image` x
  <image_soft_token> + "<end_of_image>\\n\\n", as Gemma3Processor expands it; pan-and-scan crops are refused.
- Positions (rope.py): 1-D, the text positions (no multimodal RoPE).
- Attention: the image's soft tokens attend to each other both ways (the model's own mask from `token_type_ids`,
  which the task passes: `VLMFamily.token_type_ids`): causal OR same image block, intersected with the window on
  the sliding layers. Packed rows: the task builds the decoder's masks itself (spindle.ops.packed_block_masks:
  per document, from row indices), as transformers' sliding-window mask of a packed row looks the image blocks up
  by in-document position; each document's mask is its unpacked one.
- Ulysses SP: the task passes the full rows' image blocks with the forward (ulysses_attention.BLOCKS_KWARG), and
  every layer runs spindle.ops.windowed_attention over the whole sequence of the rank's heads (window, documents
  and blocks), so a block cut by the sequence split still attends both ways. The SigLIP tower runs whole on every
  SP rank (`vision_sequence_parallel=False`): fixed-size images, 256 patches each on the released models.
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
    # under Ulysses SP every rank runs the whole SigLIP tower (fixed-size images; not a Qwen-VL tower)
    vision_sequence_parallel=False,
)
