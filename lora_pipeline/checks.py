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
