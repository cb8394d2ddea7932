"""The CPU's instruction set pinned for every stage, so a CPU run computes the same bits on any x86-64 machine.

PyTorch's CPU kernels, MKL and oneDNN each pick their code by the instruction set of the CPU they run on, and
different code rounds differently: the same params gave other weights on an AVX-512 machine than on an AVX2 one.
Each library's own switch caps it at AVX2, which every x86-64 server CPU of the last decade has. The stages call
pin() before torch is imported (stages/__init__.py); LORA_PIPELINE_NATIVE_CPU=1 lets each library choose again.

Pinned processes also keep torch.compile's cache (Inductor) in a folder of their own: Inductor's cache key leaves out
ATEN_CPU_CAPABILITY, so a CPU kernel compiled for AVX2 in a pinned process and loaded by an unpinned one on an
AVX-512 machine corrupts the heap (torch 2.11; docs/reproducibility.md).
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import MutableMapping

PINNED = {
    "ATEN_CPU_CAPABILITY": "avx2",  # PyTorch's vectorized CPU kernels
    "MKL_CBWR": "AVX2",  # MKL's conditional numerical reproducibility: one code path on every AVX2 CPU
    "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN's kernels (mkldnn)
}
NATIVE_SWITCH = "LORA_PIPELINE_NATIVE_CPU"


PINNED_CACHE = "pinned_" + PINNED["ATEN_CPU_CAPABILITY"]  # the subfolder of Inductor's cache for pinned processes


def inductor_cache(environ: MutableMapping[str, str]) -> str:
    """Inductor's cache folder for a pinned process: PINNED_CACHE inside TORCHINDUCTOR_CACHE_DIR where that is set,
    else <temp dir>/torchinductor_<uid>_<PINNED_CACHE> beside torch's default."""
    base = environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not base:
        uid = os.getuid() if hasattr(os, "getuid") else "user"
        return os.path.join(tempfile.gettempdir(), f"torchinductor_{uid}_{PINNED_CACHE}")
    return base if base.rstrip(os.sep).endswith(PINNED_CACHE) else os.path.join(base, PINNED_CACHE)


def pin(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set the switches (over any value already set) and Inductor's cache folder for them unless NATIVE_SWITCH is 1;
    what was set."""
    if environ.get(NATIVE_SWITCH, "") == "1":
        return {}
    pinned = PINNED | {"TORCHINDUCTOR_CACHE_DIR": inductor_cache(environ)}
    environ.update(pinned)
    return pinned


def describe() -> str:
    """Which instruction set PyTorch's CPU kernels run (for the stage's record): e.g. 'AVX2 (pinned)'."""
    import torch

    pinned = os.environ.get(NATIVE_SWITCH, "") != "1" and all(os.environ.get(k) == v for k, v in PINNED.items())
    return f"{torch.backends.cpu.get_cpu_capability()} ({'pinned' if pinned else 'native'})"
