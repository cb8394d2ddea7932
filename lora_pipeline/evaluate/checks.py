"""The checks of the eval and register params against what evaluate measures: the languages and MGSM files eval
names, the metrics file register.gate_metric comes from, and the figures of metrics/eval.json it may name."""
from __future__ import annotations

from lora_pipeline.config.outputs import METRICS, gate
from lora_pipeline.config.params import LANGUAGE_NAMES, flat_keys
from lora_pipeline.evaluate.scoring import eval_figures, loss_figures, mgsm_files


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


# Figures of metrics/eval.json that register.gate_metric may not name: counts and the demo's check.
NOT_GATES = {"test.tokens", "demo_reasoning_is_german", "task.questions", "tool_call.questions",
             "tool_call.calls_expected", "tool_call.answers_expected"}


def eval_metric_keys(ev) -> list[str]:
    """The figures of the fine-tuned model that evaluate writes to metrics/eval.json for these params (those of
    held-out rows with a user language and an answer, and of rows asked as they ask: text answers, tool calls and
    tool rows answered without a call, too), less NOT_GATES."""
    heldout = [{"reasoning_language": lang, "reasoning_detected": lang, "user_language": lang, "final_detected": lang,
                "correct": True} for lang in ev.languages]
    heldout += [{"reference": "a", "answer": "a", "exact_match": True, "rouge_l": 1.0, "chrf": 100.0},
                {"reference_calls": [{"name": "f", "arguments": {}}], "right_call": True, "right_name": True},
                {"reference_calls": [], "no_call": True}]
    mgsm = {lang: [True] for lang in ev.mgsm.languages} if ev.mgsm.path else {}
    figures = flat_keys(eval_figures(ev.languages, loss_figures(0.0, 0), heldout, mgsm, None))
    return [key for key in figures if key not in NOT_GATES]


def check_gate_metric(register, ev, data_source: str) -> None:
    """An eval. gate metric must be a figure that evaluate writes with these params (train. and merge. figures are
    checked by register against the metrics files; the data a reasoning, task or tool-call figure needs, by
    checks.check_gate_data)."""
    metric, _ = gate(register, data_source)
    stage, _, key = metric.partition(".")
    if stage == "eval" and key not in (known := eval_metric_keys(ev)):
        raise ValueError(f"register.gate_metric: '{metric}' is not a figure that evaluate writes with "
                         f"these eval params; allowed: {['eval.' + k for k in known]}")

