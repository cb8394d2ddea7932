"""The CPU's instruction set pinned for every stage, so a CPU run computes the same bits on any x86-64 machine.

PyTorch's CPU kernels, MKL and oneDNN each pick their code by the instruction set of the CPU they run on, and
different code rounds differently: the same params gave other weights on an AVX-512 machine than on an AVX2 one.
Each library's own switch caps it at AVX2, which every x86-64 server CPU of the last decade has. The stages call
pin() before torch is imported (stages/__init__.py); LORA_PIPELINE_NATIVE_CPU=1 lets each library choose again.
"""
from __future__ import annotations

import os
from collections.abc import MutableMapping

PINNED = {
    "ATEN_CPU_CAPABILITY": "avx2",  # PyTorch's vectorized CPU kernels
    "MKL_CBWR": "AVX2",  # MKL's conditional numerical reproducibility: one code path on every AVX2 CPU
    "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN's kernels (mkldnn)
}
NATIVE_SWITCH = "LORA_PIPELINE_NATIVE_CPU"


def pin(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set the switches (over any value already set) unless NATIVE_SWITCH is 1; what was set."""
    if environ.get(NATIVE_SWITCH, "") == "1":
        return {}
    environ.update(PINNED)
    return dict(PINNED)


def describe() -> str:
    """Which instruction set PyTorch's CPU kernels run (for the stage's record): e.g. 'AVX2 (pinned)'."""
    import torch

    pinned = os.environ.get(NATIVE_SWITCH, "") != "1" and all(os.environ.get(k) == v for k, v in PINNED.items())
    return f"{torch.backends.cpu.get_cpu_capability()} ({'pinned' if pinned else 'native'})"
