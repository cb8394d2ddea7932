"""What the stages write: files written atomically (a temporary path first, then one rename, so a crash never leaves
half a file), JSON Lines (one JSON object a line, UTF-8: the rows the data stages hand on, evaluate's transcripts), and
the metrics files and figures the stages declare once for their checks, register and the experiment table."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path


def write_text(path: str | Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_json(path: str | Path, data) -> None:
    """Indented JSON with sorted keys, so the same content gives the same bytes."""
    write_text(path, json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def replace_dir(staged: str | Path, dest: str | Path) -> None:
    """Move a fully written folder into place of `dest` (the old one is removed only once the new one is there)."""
    staged, dest = Path(staged), Path(dest)
    old = dest.with_name(f".{dest.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        os.replace(dest, old)
    os.replace(staged, dest)
    shutil.rmtree(old, ignore_errors=True)


def staging_dir(dest: str | Path) -> Path:
    """An empty sibling of `dest` to write into, then hand to replace_dir."""
    dest = Path(dest)
    staged = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    return staged


def write_jsonl(rows: list[dict], path: Path) -> None:
    write_text(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# The metrics files whose figures register logs, by the prefix those figures take in MLflow and register.gate_metric.
METRICS = {"train": Path("metrics/train.json"), "merge": Path("metrics/merge.json"), "eval": Path("metrics/eval.json")}
# The dvc.yaml stage that writes each.
WRITTEN_BY = {"train": "train", "merge": "merge", "eval": "evaluate"}
# The figures of lora_pipeline.merge.merged_checks.compare_logits (merged against adapted) that merge reports in
# metrics/merge.json, beside adapter_relative_effect and its weight check's `weights`
# (lora_pipeline.merge.merged_checks.WeightCheck), which gates.
MERGE_LOGIT_FIGURES = ("max_abs_logit_diff", "relative_logit_diff", "mean_relative_logit_diff", "top1_agreement")


# The default gate: the built-in task's measure (reasoning in the asked language) on its data, the held-out loss on
# any other, which every data set has.
BUILTIN_GATE, HELD_OUT_GATE = "eval.compliance.overall", "eval.test.loss"
# Figures only rows that ask for a reasoning language (and the built-in rows' answers) yield.
REASONING_FIGURES = ("eval.compliance.", "eval.final_language_rate", "eval.accuracy.builtin")
# Figures only held-out rows asked as they ask (no reasoning language) yield, by what such a row must hold
# (lora_pipeline.evaluate.task.row_yields), with those words for the check that refuses the gate.
ROW_FIGURES = {"eval.task.": ("text", "a reference answered in text"),
               "eval.tool_call.right_": ("call", "a tool call"),
               "eval.tool_call.no_call_when_none": ("no_call", "tools offered and an answer without a call")}


def gate(register, data_source: str) -> tuple[str, bool]:
    """(register.gate_metric, register.gate_greater_is_better) as they apply to this data: auto is the built-in
    data's compliance, other data's held-out loss; auto direction: lower is better for a loss or perplexity."""
    metric = register.gate_metric
    if metric == "auto":
        metric = BUILTIN_GATE if data_source == "builtin" else HELD_OUT_GATE
    greater = register.gate_greater_is_better
    if greater == "auto":
        greater = not metric.endswith(("loss", "perplexity"))
    return metric, greater
