"""Every writer of a standard checkpoint folder: diffusers pipelines, transformers models with their
tokenizer/processor, PEFT adapters, original (ComfyUI) LoRA layouts, streamed safetensors shards, the
dtype rules of an export and the `spindle.json` record. Tasks reach these through their family's
checkpoint adapter; `spindle.distributed.checkpoint` keeps resumable DCP only."""
