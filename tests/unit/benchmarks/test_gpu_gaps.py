"""benchmarks/gpu_gaps.py: the GPU's idle gaps between kernels, and the host op that ran during each."""
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_gaps  # noqa: E402  (benchmarks/)

pytestmark = pytest.mark.unit
Span = gpu_gaps.Span


def test_kernels_on_two_streams_overlap_into_one_busy_time_and_short_gaps_are_left_out():
    kernels = [Span("a", 0, 100), Span("b", 50, 150), Span("c", 155, 200), Span("d", 300, 400), Span("e", 320, 330)]
    assert gpu_gaps.busy(kernels) == [(0, 150), (155, 200), (300, 400)]
    assert gpu_gaps.idle_gaps(gpu_gaps.busy(kernels), min_us=10) == [(200, 300)]
    assert gpu_gaps.idle_gaps(gpu_gaps.busy(kernels), min_us=5) == [(150, 155), (200, 300)]


def test_a_gap_goes_to_the_innermost_host_op_running_in_its_middle_on_any_thread():
    kernels = [Span("k1", 0, 100), Span("k2", 1100, 1200), Span("k3", 2200, 2300), Span("k4", 2400, 2500)]
    host_ops = [
        Span("Optimizer.step#AdamW.step", 50, 1150, top="Optimizer.step#AdamW.step"),
        Span("aten::_foreach_add_", 400, 900, top="Optimizer.step#AdamW.step"),  # the gap 100-1100's middle: 600
        Span("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 1200, 2250,
             top="enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"),
        Span("aten::cat", 1500, 1600, top="enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"),  # not 1700
    ]
    table = gpu_gaps.gap_table(kernels, host_ops, steps=1, min_us=50)
    lines = table.splitlines()
    assert lines[0].startswith("GPU idle gaps: 1 steps, the GPU busy 0.4 ms a step of 2.5; 3 gaps of 50 us or more, "
                               "2.1 ms a step")
    rows = [line.split(None, 3) for line in lines[2:]]
    assert [(row[0], row[1], row[3]) for row in rows] == [
        ("1.00", "1", "aten::_foreach_add_  (in Optimizer.step#AdamW.step)"),
        ("1.00", "1", "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"),
        ("0.10", "1", gpu_gaps.NO_OP),  # 2300-2400: nothing recorded on the host
    ]


def test_the_op_at_a_moment_is_the_latest_started_of_those_still_running():
    ops = [Span("outer", 0, 1000, "outer"), Span("early", 10, 20, "outer"), Span("late", 900, 950, "outer"),
           Span("other thread", 850, 2000, "other thread")]
    found = gpu_gaps.host_ops_at(ops, [500, 15, 2500, 920, 960, 15])
    assert [op.name if op else None for op in found] == ["outer", "early", None, "late", "other thread", "early"]


def test_a_cpu_profile_gives_host_ops_with_their_top_level_op_and_no_kernel():
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    x = torch.randn(32, 32)
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        with record_function("the step"):
            x @ x
    kernels, host_ops = gpu_gaps.spans_from_profiler(profiler)
    assert kernels == []
    mm = next(op for op in host_ops if op.name == "aten::mm")
    assert mm.top == "the step" and mm.start <= mm.end
    assert gpu_gaps.gap_table(kernels, host_ops, steps=1) == "GPU idle gaps: no kernel was recorded"
