"""The model: loading it (quantization, attention, LoRA, Liger), chat templates, MXFP4 checkpoints and experts, the
tiny models, the checks of the params against it."""
