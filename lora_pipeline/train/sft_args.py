"""The trl.SFTConfig arguments the train stage sets itself, and so the fields train.sft may not set."""
from __future__ import annotations

from pathlib import Path


def train_sft_args(output_dir: Path, checkpoint_steps: int, on_gpu: bool) -> dict:
    """The trl.SFTConfig arguments the train stage sets itself, whatever train.sft says."""
    return {
        "output_dir": str(output_dir),
        "use_cpu": not on_gpu,  # with a MULTI_GPU launch on a CPU this makes the processes one DDP group over gloo
        "save_strategy": "steps" if checkpoint_steps else "no",
        "save_steps": checkpoint_steps or 500,
        "save_total_limit": 2,  # the newest complete checkpoint survives a kill while the next one is written
        "report_to": "none",  # rank 0's LiveMetrics sends the per-step figures to MLflow (lora_pipeline.train.tracking)
        "include_num_input_tokens_seen": "non_padding",
    }


# Fields train.sft may not set: the train stage would override them.
STAGE_OWNED_SFT_FIELDS = frozenset(train_sft_args(Path(), 0, False))
