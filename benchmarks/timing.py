"""Seconds a call of a GPU (or CPU) function takes, for the check scripts: CUDA events on a GPU, wall time on a CPU."""
import time

import torch


def seconds_per_call(fn, device: torch.device, repeat: int = 20) -> float:
    """fn() once to warm up, then the mean of `repeat` calls."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000 / repeat
    begin = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - begin) / repeat
