"""The CPU's code paths pinned for every stage, so a CPU run computes the same bits on any x86-64 machine.

PyTorch's CPU kernels, MKL and oneDNN each pick their code by the CPU they run on, and different code rounds
differently: the same params gave other weights on an AVX-512 machine than on an AVX2 one, and on an Intel CPU than
on an AMD one. PyTorch's kernels and oneDNN are capped at AVX2, which every x86-64 server CPU of the last decade has.
MKL runs its vendor-independent code: at MKL_CBWR=AVX2 its vector math (exp, log, sin, cos, which PyTorch takes from
MKL) and so attention take Intel-only code on Intel CPUs. MKL's matrix products also round by how many threads
split them, so a process that computes on the CPU runs a fixed number of threads, whatever the machine has. The
stages call pin() before torch is imported (stages/__init__.py); LORA_PIPELINE_NATIVE_CPU=1 lets each library choose
again.

Pinned processes also keep torch.compile's cache (Inductor, with the Triton kernels it builds) in a folder of their own:
Inductor's cache key leaves out ATEN_CPU_CAPABILITY, so a CPU kernel compiled for AVX2 in a pinned process and loaded
by an unpinned one on an AVX-512 machine corrupts the heap (torch 2.11; docs/reproducibility.md). That folder is in the
machine's cache (config.cache.cache_root), not the temp dir: it outlasts experiments and reboots, and a Slurm node
reaches it where home directories are shared, so an experiment pays no compile another has paid.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from lora_pipeline.config.cache import cache_root

PINNED = {
    "ATEN_CPU_CAPABILITY": "avx2",  # PyTorch's vectorized CPU kernels
    "MKL_CBWR": "COMPATIBLE",  # MKL's conditional numerical reproducibility: one code path on every vendor's CPU
    "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN's kernels (mkldnn)
}
NATIVE_SWITCH = "LORA_PIPELINE_NATIVE_CPU"
# Threads per process on the CPU: two for a run of one process, one each for a run of several, so that a run's
# processes compute alike on one machine or on several (a two-core machine's worth either way).
THREADS_ALONE, THREADS_EACH = 2, 1
GPU_DEVICES = (Path("/dev/nvidia0"), Path("/dev/kfd"))  # NVIDIA's and AMD's (ROCm) first device nodes


PINNED_CACHE = "pinned_" + PINNED["ATEN_CPU_CAPABILITY"]  # the subfolder of Inductor's cache for pinned processes


def inductor_cache(environ: MutableMapping[str, str]) -> str:
    """Inductor's cache folder for a pinned process: PINNED_CACHE inside TORCHINDUCTOR_CACHE_DIR where that is set,
    else <cache_root>/torchinductor/<PINNED_CACHE>."""
    base = environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not base:
        return str(cache_root(environ) / "torchinductor" / PINNED_CACHE)
    return base if base.rstrip(os.sep).endswith(PINNED_CACHE) else os.path.join(base, PINNED_CACHE)


def computes_on_cpu(environ: Mapping[str, str]) -> bool:
    """Whether this process computes on the CPU: accelerate said so (a use_cpu config), no GPU is visible to CUDA, or
    the machine has none. Told without importing torch."""
    if environ.get("ACCELERATE_USE_CPU", "").lower() == "true" or environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
        return True
    return not any(device.exists() for device in GPU_DEVICES)


def cpu_threads(environ: Mapping[str, str]) -> int:
    """The threads a process on the CPU runs: THREADS_ALONE, or THREADS_EACH in a run of several (WORLD_SIZE, set by
    torchrun for each process)."""
    return THREADS_ALONE if int(environ.get("WORLD_SIZE") or 1) == 1 else THREADS_EACH


def pin(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set the switches (over any value already set), the thread count where the process computes on the CPU, and
    Inductor's cache folder for them, unless NATIVE_SWITCH is 1; what was set."""
    if environ.get(NATIVE_SWITCH, "") == "1":
        return {}
    pinned = PINNED | {"TORCHINDUCTOR_CACHE_DIR": inductor_cache(environ)}
    if computes_on_cpu(environ):
        threads = str(cpu_threads(environ))
        # MKL_DYNAMIC off: MKL would otherwise run fewer threads than asked on a machine with fewer cores
        pinned |= {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "MKL_DYNAMIC": "FALSE"}
    environ.update(pinned)
    return pinned


def describe() -> str:
    """Which instruction set PyTorch's CPU kernels run, on how many threads (for the stage's record): e.g.
    'AVX2 (pinned), 2 threads'."""
    import torch

    pinned = os.environ.get(NATIVE_SWITCH, "") != "1" and all(os.environ.get(k) == v for k, v in PINNED.items())
    return (f"{torch.backends.cpu.get_cpu_capability()} ({'pinned' if pinned else 'native'}), "
            f"{torch.get_num_threads()} threads")
