"""What the stages write and set themselves, declared once for the stages, their checks and the experiment table."""
from __future__ import annotations

from pathlib import Path

# The metrics files whose figures register logs, by the prefix those figures take in MLflow and register.gate_metric.
METRICS = {"train": Path("metrics/train.json"), "merge": Path("metrics/merge.json"), "eval": Path("metrics/eval.json")}
# The dvc.yaml stage that writes each.
WRITTEN_BY = {"train": "train", "merge": "merge", "eval": "evaluate"}
