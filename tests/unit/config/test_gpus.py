"""The GPUs NVML lists, as CUDA_VISIBLE_DEVICES shows them to CUDA: what torch would count, without torch."""
import json
import os
import subprocess
import sys

import pytest
import torch

from lora_pipeline.config.gpus import nvml_gpus, visible_gpus, visible_indices

# The GPUs CUDA itself shows (torch.cuda.device_count() is NVML's count where NVML answers), by compute capability.
CUDA_SEES = ("import json, torch; print(json.dumps([list(torch.cuda.get_device_capability(i)) "
             "for i in range(torch._C._cuda_getDeviceCount())]))")
UUIDS = ["GPU-8932f937-d72c", "GPU-8933aa00-0000", "GPU-1234abcd-ffff"]


@pytest.mark.parametrize("visible, shown", [
    (None, [0, 1, 2]),
    ("", []),
    ("-1", []),
    ("2,0", [2, 0]),
    (" 1 , 2", [1, 2]),
    ("0,7,1", [0]),  # up to the first that names no GPU
    ("1gpu,2", [1, 2]),  # the leading digits, as strtoul reads them
    ("0,0", []),  # a GPU named twice: none
    ("GPU-1234,GPU-8932f", [2, 0]),  # UUIDs by a unique prefix
    ("GPU-893,GPU-1234", []),  # a prefix of two UUIDs names none
    ("GPU-", []),
    ("GPU-1234,1", [2]),  # after a UUID, an index names none
    ("1,GPU-1234", [1]),
])
def test_cuda_visible_devices_is_read_as_cuda_reads_it(visible, shown):
    assert visible_indices(visible, UUIDS) == shown


def test_the_gpus_listed_are_those_cuda_shows():
    """Without an NVIDIA driver, none; with one, for each CUDA_VISIBLE_DEVICES, those CUDA shows a process started
    with it, each of the compute capability torch reports."""
    gpus, _ = nvml_gpus()
    if not gpus:
        assert visible_gpus() == [] and torch.cuda.device_count() == 0
        return
    for visible in (None, "", "-1", "0", "1,0", "0,1", "0,0", "GPU-", gpus[0].uuid[:12], "GPU-none"):
        env = {key: value for key, value in os.environ.items() if key != "CUDA_VISIBLE_DEVICES"}
        env |= {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
        seen = subprocess.run([sys.executable, "-c", CUDA_SEES], env=env, capture_output=True, text=True, check=True)
        assert json.loads(seen.stdout) == [list(gpu.capability) for gpu in visible_gpus(env)], visible
