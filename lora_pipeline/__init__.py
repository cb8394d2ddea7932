"""Shared code of the LoRA fine-tuning pipeline, one folder per concern: config, data, model, train, launch, merge,
evaluate, registry, validation."""
