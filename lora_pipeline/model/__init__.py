"""The model: loading it (quantization, attention, LoRA, Liger), chat templates, the
tiny models, the checks of the params against it."""
