"""Checks of the inputs that params.yaml names (files, folders, language codes), cheap enough to run first."""
from __future__ import annotations

import os
from pathlib import Path

from lora_pipeline.data import LOCAL_DIR, LOCAL_FORMATS
from lora_pipeline.metrics import LANGUAGE_NAMES, mgsm_files


def check_data(data) -> None:
    if data.source == "local":
        path = Path(data.name)
        if not Path(os.path.abspath(path)).is_relative_to(os.path.abspath(LOCAL_DIR)):
            raise ValueError(f"data.name: local data files live under {LOCAL_DIR}/ (a dependency of fetch, so "
                             f"editing one re-runs it); move {path} there")
        if not path.is_file():
            raise FileNotFoundError(f"data.name: local data file {path} does not exist")
        if path.suffix not in LOCAL_FORMATS:
            raise ValueError(f"data.name: {path} has suffix '{path.suffix}'; supported: {sorted(LOCAL_FORMATS)}")


def check_model(model) -> None:
    if model.source == "local" and not (Path(model.name) / "config.json").is_file():
        raise FileNotFoundError(f"model.name: {model.name} is not a model folder (no config.json)")


def check_eval(ev) -> None:
    mgsm_languages = ev.mgsm.languages if ev.mgsm.path else []
    unknown = [lang for lang in [*ev.languages, *mgsm_languages] if lang not in LANGUAGE_NAMES]
    if unknown:
        raise ValueError(f"eval.languages / eval.mgsm.languages: unknown codes {unknown}; "
                         f"known: {sorted(LANGUAGE_NAMES)}")
    if ev.mgsm.path and ev.mgsm.path != "hub":
        mgsm_files(ev.mgsm.path, ev.mgsm.languages)


def check_register(register) -> None:
    stage = register.gate_metric.split(".")[0]
    if stage not in ("train", "merge", "eval"):
        raise ValueError(f"register.gate_metric '{register.gate_metric}' must start with train., merge. or eval. "
                         "(the metrics file it comes from)")


# Fields the train stage sets itself: a value in params.yaml would be overridden, so it is refused.
STAGE_OWNED_SFT_FIELDS = {"output_dir", "save_strategy", "save_steps", "save_total_limit", "report_to", "use_cpu",
                          "include_num_input_tokens_seen", "dataloader_num_workers", "gradient_checkpointing_kwargs"}


# What LoRA papers and other tools call the fields that peft names otherwise.
FIELD_ALIASES = {"rank": "r", "alpha": "lora_alpha", "dropout": "lora_dropout", "target": "target_modules"}


def unknown_fields(given: dict, known: set[str], section: str, owner: str) -> list[str]:
    """One message per key of `given` that is not a field of `owner`, with the closest field name."""
    import difflib

    messages = []
    for key in given:
        if key not in known:
            alias = FIELD_ALIASES.get(key)
            close = [alias] if alias in known else difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"; did you mean {section}.{close[0]}?" if close else ""
            messages.append(f"{section}.{key}: not a {owner} field{hint}")
    return messages


def check_library_fields(train, lora) -> None:
    """train.sft and lora pass straight to trl.SFTConfig and peft.LoraConfig: every key must be one of their fields."""
    import dataclasses

    from peft import LoraConfig
    from trl import SFTConfig

    sft = train.sft.to_dict()
    problems = [f"train.sft.{key}: the train stage sets it itself; remove it" for key in sft
                if key in STAGE_OWNED_SFT_FIELDS]
    problems += unknown_fields({k: v for k, v in sft.items() if k not in STAGE_OWNED_SFT_FIELDS},
                               {f.name for f in dataclasses.fields(SFTConfig)}, "train.sft", "trl.SFTConfig")
    problems += unknown_fields(lora.to_dict(), {f.name for f in dataclasses.fields(LoraConfig)} - {"task_type"},
                               "lora", "peft.LoraConfig")
    if problems:
        raise ValueError("\n".join(problems))


def check_machine(model, train) -> None:
    """Settings this machine cannot run: mixed precision and flash attention need a GPU (flex attention falls back)."""
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        if train.sft.bf16 or train.sft.fp16:
            raise ValueError("train.sft.bf16 / train.sft.fp16: mixed precision needs a CUDA GPU and none is present; "
                             "set both to false to train on the CPU")
    elif model.attn_implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise ValueError("model.attn_implementation: flash_attention_2 needs the flash-attn package, which is not "
                         "installed; use flex_attention or sdpa")
