"""Where a profiled run leaves the GPU idle (train_throughput.py --profile): the gaps between kernels, by host op."""
from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass

NO_OP = "(no op recorded: Python between ops)"


@dataclass(frozen=True)
class Span:
    """A kernel, copy or host op, in microseconds on the profiler's clock; a host op knows the top-level op it runs
    in (itself for a top-level op)."""
    name: str
    start: float
    end: float
    top: str = ""


def busy(kernels: list[Span]) -> list[tuple[float, float]]:
    """The times some kernel or copy runs, on any stream, as disjoint sorted intervals."""
    merged: list[list[float]] = []
    for span in sorted(kernels, key=lambda s: s.start):
        if merged and span.start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], span.end)
        else:
            merged.append([span.start, span.end])
    return [(start, end) for start, end in merged]


def idle_gaps(intervals: list[tuple[float, float]], min_us: float) -> list[tuple[float, float]]:
    """The idle intervals of at least min_us between busy() intervals."""
    return [(end, start) for (_, end), (start, _) in zip(intervals, intervals[1:]) if start - end >= min_us]


def host_ops_at(host_ops: list[Span], moments: list[float]) -> list[Span | None]:
    """For each moment, of the host ops running then on any thread, the one that started last: the innermost, most
    recent thing the host was doing (None where none ran). One sweep over both in time order."""
    ops = sorted(host_ops, key=lambda op: op.start)
    running: list[tuple[float, int]] = []  # (-start, index): the latest-started op on top
    found: dict[float, Span | None] = {}
    next_op = 0
    for moment in sorted(set(moments)):
        while next_op < len(ops) and ops[next_op].start <= moment:
            heapq.heappush(running, (-ops[next_op].start, next_op))
            next_op += 1
        while running and ops[running[0][1]].end < moment:  # ended: it ran before every later moment too
            heapq.heappop(running)
        found[moment] = ops[running[0][1]] if running else None
    return [found[moment] for moment in moments]


def gap_table(kernels: list[Span], host_ops: list[Span], steps: int, min_us: float = 10.0, rows: int = 20) -> str:
    """The GPU's busy and idle time per step, and the idle time in gaps of min_us or more, grouped by the host op
    running in each gap's middle (and its top-level op) and sorted by the time lost. A step bound by the GPU's own
    work has few, short gaps; a long one names what the host did meanwhile: the data loader's next batch, the
    optimizer, a block mask built eagerly, a read of a value from the GPU."""
    if not kernels:
        return "GPU idle gaps: no kernel was recorded"
    intervals = busy(kernels)
    span_us = intervals[-1][1] - intervals[0][0]
    busy_us = sum(end - start for start, end in intervals)
    gaps = idle_gaps(intervals, min_us)
    lost: dict[tuple[str, str], list[float]] = defaultdict(list)
    for (start, end), op in zip(gaps, host_ops_at(host_ops, [(start + end) / 2 for start, end in gaps])):
        lost[(op.top, op.name) if op else ("", NO_OP)].append(end - start)
    per_step = max(steps, 1) * 1000
    lines = [f"GPU idle gaps: {steps} steps, the GPU busy {busy_us / per_step:.1f} ms a step of "
             f"{span_us / per_step:.1f}; {len(gaps)} gaps of {min_us:g} us or more, "
             f"{sum(end - start for start, end in gaps) / per_step:.1f} ms a step, by what the host ran meanwhile:",
             f"{'ms a step':>10} {'gaps':>6} {'longest ms':>10}  host op (in its top-level op)"]
    for (top, name), lengths in sorted(lost.items(), key=lambda item: -sum(item[1]))[:rows]:
        where = name if not top or top == name else f"{name}  (in {top})"
        lines.append(f"{sum(lengths) / per_step:>10.2f} {len(lengths):>6} {max(lengths) / 1000:>10.2f}  {where[:150]}")
    return "\n".join(lines)


def spans_from_profiler(profiler) -> tuple[list[Span], list[Span]]:
    """The kernels and copies (device events) and the host ops of a finished torch.profiler.profile."""
    from torch.autograd import DeviceType

    kernels, host_ops = [], []
    for event in profiler.events():
        if event.device_type == DeviceType.CPU:
            top = event
            while top.cpu_parent is not None:
                top = top.cpu_parent
            host_ops.append(Span(event.name, event.time_range.start, event.time_range.end, top.name))
        else:
            kernels.append(Span(event.name, event.time_range.start, event.time_range.end))
    return kernels, host_ops
