"""The accelerate configs parse as accelerate reads them, and say what their names promise."""
import pytest
from accelerate.commands.config.config_args import load_config_from_file

from conftest import ROOT

CONFIGS = sorted((ROOT / "configs/accelerate").glob("*.yaml"))
EXPECTED = {  # name: (distributed_type, num_machines, num_processes)
    "cpu": ("NO", 1, 1), "cpu_ddp": ("MULTI_GPU", 1, 2), "single_gpu": ("NO", 1, 1), "multi_gpu": ("MULTI_GPU", 1, 8),
    "multi_gpu_2": ("MULTI_GPU", 1, 2), "multi_node": ("MULTI_GPU", 2, 16), "fsdp2": ("FSDP", 1, 8),
    "deepspeed_zero3": ("DEEPSPEED", 1, 8),
}


def test_every_config_is_listed():
    assert {c.stem for c in CONFIGS} == set(EXPECTED)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_parses(path):
    config = load_config_from_file(str(path))
    distributed, machines, processes = EXPECTED[path.stem]
    assert (str(config.distributed_type).split(".")[-1], config.num_machines, config.num_processes) == \
        (distributed, machines, processes)
    if path.stem == "fsdp2":
        assert config.fsdp_config["fsdp_version"] == 2
    if path.stem == "deepspeed_zero3":
        assert config.deepspeed_config["zero_stage"] == 3
