"""The CUDA GPUs this process may use, read from the NVIDIA driver's NVML library as nvidia-smi reads them: no torch
and no CUDA context, so validate counts them in milliseconds."""
from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    """A GPU (or MIG instance) as NVML describes it."""
    uuid: str
    name: str
    capability: tuple[int, int]  # CUDA compute capability: (8, 0) and later compute in bfloat16

    @property
    def has_bf16(self) -> bool:
        return self.capability >= (8, 0)


def _call(nvml, function: str, *args) -> None:
    if (status := getattr(nvml, function)(*args)) != 0:
        raise OSError(f"NVML {function} failed (status {status})")


def _text(nvml, function: str, handle) -> str:
    buffer = ctypes.create_string_buffer(96)
    _call(nvml, function, handle, buffer, ctypes.c_uint(len(buffer)))
    return buffer.value.decode()


@functools.cache
def nvml_gpus() -> tuple[tuple[Gpu, ...], tuple[Gpu, ...]]:
    """This machine's GPUs in NVML's order, and the MIG instances of those in MIG mode; empty where there is no NVML
    library (no NVIDIA driver) or it does not start."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        _call(nvml, "nvmlInit_v2")
    except OSError:
        return (), ()
    try:
        count, gpus, migs = ctypes.c_uint(), [], []
        _call(nvml, "nvmlDeviceGetCount_v2", ctypes.byref(count))
        for index in range(count.value):
            handle, major, minor = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_int()
            _call(nvml, "nvmlDeviceGetHandleByIndex_v2", ctypes.c_uint(index), ctypes.byref(handle))
            _call(nvml, "nvmlDeviceGetCudaComputeCapability", handle, ctypes.byref(major), ctypes.byref(minor))
            name, capability = _text(nvml, "nvmlDeviceGetName", handle), (major.value, minor.value)
            gpus.append(Gpu(_text(nvml, "nvmlDeviceGetUUID", handle), name, capability))
            slots = ctypes.c_uint()  # MIG instances: none on a GPU without MIG (the call fails there)
            if nvml.nvmlDeviceGetMaxMigDeviceCount(handle, ctypes.byref(slots)) != 0:
                continue
            for slot in range(slots.value):
                mig = ctypes.c_void_p()
                if nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, ctypes.c_uint(slot), ctypes.byref(mig)) == 0:
                    migs.append(Gpu(_text(nvml, "nvmlDeviceGetUUID", mig), f"{name} MIG", capability))
        return tuple(gpus), tuple(migs)
    except OSError:
        return (), ()
    finally:
        nvml.nvmlShutdown()


def visible_indices(visible: str | None, uuids: list[str]) -> list[int]:
    """The indices of the GPUs (their UUIDs: `uuids`) that CUDA_VISIBLE_DEVICES's value `visible` shows, by CUDA's
    rules: unset, all; else indices, or UUID prefixes (GPU-..., MIG-...) if the first entry is one, in its order up to
    the first that names none ("" and "-1" show none), and none at all if one is named twice."""
    if visible is None:
        return list(range(len(uuids)))
    entries = [entry.strip() for entry in visible.split(",")]
    prefix = next((p for p in ("GPU-", "MIG-") if entries[0].startswith(p)), None)
    shown = []
    for entry in entries:
        if prefix:
            named = entry.startswith(prefix) and len(entry) > len(prefix)  # CUDA shows nothing for a bare "GPU-"
            found = [index for index, uuid in enumerate(uuids) if named and uuid.startswith(entry)]
            index = found[0] if len(found) == 1 else -1
        else:  # CUDA reads the leading digits, as strtoul does: "1gpu" is 1
            digits = entry[:len(entry) - len(entry.lstrip("0123456789"))]
            index = int(digits) if digits and int(digits) < len(uuids) else -1
        if index < 0:
            break
        if index in shown:
            return []
        shown.append(index)
    return shown


def visible_gpus(environ=os.environ) -> list[Gpu]:
    """The GPUs a CUDA program started with this environment sees (torch.cuda.device_count() of them), in
    CUDA_VISIBLE_DEVICES's order; [] on a machine without an NVIDIA driver."""
    gpus, migs = nvml_gpus()
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    listed = migs if visible is not None and visible.strip().startswith("MIG-") else gpus
    return [listed[i] for i in visible_indices(visible, [gpu.uuid for gpu in listed])]
