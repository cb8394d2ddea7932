"""train.global_batch_size split into each process's micro-batch and gradient accumulation, for train and validate."""
from __future__ import annotations


def split_global_batch(global_batch_size: int, per_device_train_batch_size: int, gradient_accumulation_steps: int,
                       processes: int, processes_are: str) -> tuple[int, int]:
    """(micro-batch, gradient accumulation steps) of each of `processes` processes. global_batch_size 0: the
    train.sft values as given. Otherwise each process takes global_batch_size / processes sequences per optimizer step
    (its share, which must be whole), in micro-batches of the largest divisor of the share that is at most
    per_device_train_batch_size (the largest micro-batch the recipe was measured to fit), accumulated share /
    micro-batch times: global 16 with per_device 8 is 8 x 2 on 1 process, 8 x 1 on 2, 4 x 1 on 4, 2 x 1 on 8.
    `processes_are` names the processes in the error, e.g. "the 3 processes train.accelerate_config X starts"."""
    if not global_batch_size:
        return per_device_train_batch_size, gradient_accumulation_steps
    if gradient_accumulation_steps != 1:
        raise ValueError(
            f"train.sft.gradient_accumulation_steps: {gradient_accumulation_steps} with train.global_batch_size: "
            f"{global_batch_size}, which derives the accumulation from the processes; set "
            "train.sft.gradient_accumulation_steps: 1 (train.sft.per_device_train_batch_size caps the micro-batch), "
            "or train.global_batch_size: 0 to set micro-batch x accumulation per process yourself")
    if global_batch_size % processes:
        below = global_batch_size // processes * processes
        multiples = " or ".join(str(m) for m in (below, below + processes) if m)
        raise ValueError(
            f"train.global_batch_size: {global_batch_size} is not a multiple of {processes_are}, each of which "
            f"takes an equal share; allowed: a multiple of {processes} (e.g. {multiples}), a launch whose processes "
            "divide it, or 0 (the batch is train.sft.per_device_train_batch_size x gradient_accumulation_steps x "
            "processes)")
    share = global_batch_size // processes
    micro = max(size for size in range(1, min(share, per_device_train_batch_size) + 1) if share % size == 0)
    return micro, share // micro
