"""What the stages write and set themselves, declared once for the stages, their checks and the experiment table."""
from __future__ import annotations

from pathlib import Path

# The metrics files whose figures register logs, by the prefix those figures take in MLflow and register.gate_metric.
METRICS = {"train": Path("metrics/train.json"), "merge": Path("metrics/merge.json"), "eval": Path("metrics/eval.json")}
# The dvc.yaml stage that writes each.
WRITTEN_BY = {"train": "train", "merge": "merge", "eval": "evaluate"}
# The figures of lora_pipeline.logits.compare_logits (merged against adapted) that merge reports in metrics/merge.json,
# beside adapter_relative_effect and its weight check's `weights` (lora_pipeline.merge_check.WeightCheck), which gates.
MERGE_LOGIT_FIGURES = ("max_abs_logit_diff", "relative_logit_diff", "mean_relative_logit_diff", "top1_agreement")


def train_sft_args(output_dir: Path, checkpoint_steps: int, on_gpu: bool) -> dict:
    """The trl.SFTConfig arguments the train stage sets itself, whatever train.sft says."""
    return {
        "output_dir": str(output_dir),
        "use_cpu": not on_gpu,  # with a MULTI_GPU launch on a CPU this makes the processes one DDP group over gloo
        "save_strategy": "steps" if checkpoint_steps else "no",
        "save_steps": checkpoint_steps or 500,
        "save_total_limit": 2,  # the newest complete checkpoint survives a kill while the next one is written
        "report_to": "none",  # rank 0's LiveMetrics sends the per-step figures to MLflow (see lora_pipeline.tracking)
        "include_num_input_tokens_seen": "non_padding",
    }


# Fields train.sft may not set: the train stage would override them.
STAGE_OWNED_SFT_FIELDS = frozenset(train_sft_args(Path(), 0, False))


# The default gate: the built-in task's measure (reasoning in the asked language) on its data, the held-out loss on
# any other, which every data set has.
BUILTIN_GATE, HELD_OUT_GATE = "eval.compliance.overall", "eval.test.loss"
# Figures only rows that ask for a reasoning language (and the built-in rows' answers) yield.
REASONING_FIGURES = ("eval.compliance.", "eval.final_language_rate", "eval.accuracy.builtin")


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
