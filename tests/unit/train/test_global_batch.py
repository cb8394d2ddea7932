"""train.global_batch_size: its split into micro-batch and accumulation per process, and the SFTConfig it gives."""
import pytest
import yaml

from conftest import ROOT
from lora_pipeline.train.global_batch import split_global_batch

WHERE = "the processes of the test"


@pytest.mark.parametrize("global_batch, per_device, processes, split", [
    (16, 8, 1, (8, 2)),  # gpt-oss-20b's recipe: the seed's global batch on any GPU count
    (16, 8, 2, (8, 1)),
    (16, 8, 4, (4, 1)),
    (16, 8, 8, (2, 1)),
    (16, 8, 16, (1, 1)),
    (16, 4, 1, (4, 4)),  # a smaller per_device set by hand, kept where it divides the share
    (16, 3, 1, (2, 8)),  # 3 does not divide 16: the largest divisor below it
    (12, 8, 1, (6, 2)),
    (24, 5, 2, (4, 3)),
    (7, 8, 1, (7, 1)),
    (7, 2, 1, (1, 7)),
])
def test_global_batch_is_split_into_the_largest_micro_batch_that_divides_each_share(global_batch, per_device,
                                                                                     processes, split):
    micro, accumulation = split_global_batch(global_batch, per_device, 1, processes, WHERE)
    assert (micro, accumulation) == split
    assert micro * accumulation * processes == global_batch and micro <= per_device


@pytest.mark.parametrize("processes", [1, 2, 3, 8])
def test_global_batch_zero_keeps_train_sft_as_given(processes):
    assert split_global_batch(0, 16, 1, processes, WHERE) == (16, 1)
    assert split_global_batch(0, 4, 3, processes, WHERE) == (4, 3)


def test_a_global_batch_the_processes_cannot_share_is_refused_naming_the_numbers():
    with pytest.raises(ValueError) as refused:
        split_global_batch(16, 8, 1, 3, "the 3 processes train.accelerate_config multi_gpu_3 starts")
    assert str(refused.value).startswith("train.global_batch_size: 16 is not a multiple of the 3 processes "
                                         "train.accelerate_config multi_gpu_3 starts")
    assert "a multiple of 3 (e.g. 15 or 18)" in str(refused.value)
    with pytest.raises(ValueError, match=r"is not a multiple of .*\(e\.g\. 16\)"):
        split_global_batch(8, 8, 1, 16, WHERE)  # fewer sequences than processes


def test_an_accumulation_set_beside_a_global_batch_is_refused_naming_both_keys():
    with pytest.raises(ValueError, match=r"^train.sft.gradient_accumulation_steps: 2 with train.global_batch_size: 16, "
                                         r".*set train.sft.gradient_accumulation_steps: 1"):
        split_global_batch(16, 8, 2, 1, WHERE)


def sft_section(**changes) -> dict:
    return {**yaml.safe_load((ROOT / "params.yaml").read_text())["train"]["sft"], **changes}


def test_sftconfig_gets_the_split_for_this_launchs_processes(tmp_path):
    """Through trl.SFTConfig as the train stage builds it, in this one process: the world size SFTConfig sees."""
    from lora_pipeline.train.training import sft_args

    args, levers = sft_args(sft_section(per_device_train_batch_size=8), tmp_path, 0, global_batch_size=16)
    assert args.world_size == 1
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (8, 2)
    assert (levers["per_device_train_batch_size"], levers["gradient_accumulation_steps"]) == (8, 2)
    assert levers["global_batch_size"] == 16 and levers["notes"] == []

    args, levers = sft_args(sft_section(per_device_train_batch_size=3), tmp_path, 0, global_batch_size=16)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 8)
    assert levers["notes"] == ["micro-batch 2: the largest divisor of each process's 16 sequences a step at most "
                               "train.sft.per_device_train_batch_size 3"]

    args, levers = sft_args(sft_section(gradient_accumulation_steps=3), tmp_path, 0)  # off: as train.sft says
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (16, 3)
    assert "global_batch_size" not in levers  # the default's training_info.json keeps its bytes

    with pytest.raises(ValueError, match="train.sft.gradient_accumulation_steps: 3 with train.global_batch_size: 16"):
        sft_args(sft_section(gradient_accumulation_steps=3), tmp_path, 0, global_batch_size=16)
