"""Shared code of the LoRA fine-tuning pipeline: params schema, data, models, metrics."""
