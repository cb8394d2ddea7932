"""The checks of the eval and register params against what evaluate measures: the languages and MGSM files eval
names, the metrics file register.gate_metric comes from, and the figures of metrics/eval.json it may name."""
from __future__ import annotations

from lora_pipeline.config.outputs import METRICS, gate
from lora_pipeline.config.params import LANGUAGE_NAMES
from lora_pipeline.evaluate.figures import written
from lora_pipeline.evaluate.scoring import mgsm_files


def check_eval(ev) -> None:
    languages = {"eval.languages": ev.languages, "eval.mgsm.languages": ev.mgsm.languages if ev.mgsm.path else []}
    problems = [f"{key}: unknown codes {unknown}; known: {sorted(LANGUAGE_NAMES)}"
                for key, codes in languages.items() if (unknown := [c for c in codes if c not in LANGUAGE_NAMES])]
    if problems:
        raise ValueError("\n".join(problems))
    if ev.mgsm.path and ev.mgsm.path != "hub":
        mgsm_files(ev.mgsm.path, ev.mgsm.languages)


def check_register(register) -> None:
    if register.gate_metric == "auto":
        return
    stage = register.gate_metric.split(".")[0]
    if stage not in METRICS:
        *first, last = [f"{prefix}." for prefix in METRICS]
        raise ValueError(f"register.gate_metric '{register.gate_metric}' must start with {', '.join(first)} or {last} "
                         "(the metrics file it comes from)")


def eval_metric_keys(ev) -> list[str]:
    """The figures of metrics/eval.json that register.gate_metric may name with these eval params: those of the
    catalogue that may gate (MGSM's only where eval.mgsm.path is set), a pattern's once per language."""
    return [key for key, figure in written(ev).items() if figure.may_gate]


def check_gate_metric(register, ev, data_source: str) -> None:
    """An eval. gate metric must be a figure that evaluate writes with these params (train. and merge. figures are
    checked by register against the metrics files; the data a reasoning, task or tool-call figure needs, by
    checks.check_gate_data)."""
    metric, _ = gate(register, data_source)
    stage, _, key = metric.partition(".")
    if stage == "eval" and key not in (known := eval_metric_keys(ev)):
        raise ValueError(f"register.gate_metric: '{metric}' is not a figure that evaluate writes with "
                         f"these eval params; allowed: {['eval.' + k for k in known]}")

