"""The processes of a launch (accelerate, torchrun) as evaluation sees them: this one's rank and the group's size, and
gathering every process's results."""
from __future__ import annotations

import torch


def launch_state():
    """accelerate's state of this process. Without a GPU the processes of a multi-process launch join over gloo
    (cpu=True, as the train stage's do); otherwise each would take itself for the only one."""
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


def process_group() -> tuple[int, int]:
    """(rank, world size) of the launch this process is part of; (0, 1) outside one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def gather(items: list) -> list:
    """Every process's `items`, concatenated in rank order (the items themselves outside a launch)."""
    _, world = process_group()
    if world == 1:
        return items
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, items)
    return [item for part in gathered for item in part]
