"""What the stages write: files written atomically (a temporary path first, then one rename, so a crash never leaves
half a file), JSON Lines (one JSON object a line, UTF-8: the rows the data stages hand on, evaluate's transcripts), and
the metrics files whose figures register logs (each evaluation figure: lora_pipeline.evaluate.figures; the gate's rule:
lora_pipeline.registry.gate)."""
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
