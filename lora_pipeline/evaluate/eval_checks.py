"""The check of the eval params against what evaluate reads: the languages and MGSM files eval names (the gate's
checks: lora_pipeline.registry.gate)."""
from __future__ import annotations

from lora_pipeline.config.params import LANGUAGE_NAMES
from lora_pipeline.evaluate.scoring import mgsm_files


def check_eval(ev) -> None:
    languages = {"eval.languages": ev.languages, "eval.mgsm.languages": ev.mgsm.languages if ev.mgsm.path else []}
    problems = [f"{key}: unknown codes {unknown}; known: {sorted(LANGUAGE_NAMES)}"
                for key, codes in languages.items() if (unknown := [c for c in codes if c not in LANGUAGE_NAMES])]
    if problems:
        raise ValueError("\n".join(problems))
    if ev.mgsm.path and ev.mgsm.path != "hub":
        mgsm_files(ev.mgsm.path, ev.mgsm.languages)
