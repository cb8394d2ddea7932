"""Which stages run in the launcher's own interpreter: an evaluation stage whose config starts one process."""
import pytest
import yaml

from lora_pipeline.config.params import ROOT, read_yaml, validate
from lora_pipeline.launch.launcher import IN_LAUNCHER, STAGES, in_launcher_config, local_command
from lora_pipeline.launch.machine import starts_one_process

CONFIGS = ROOT / "configs" / "accelerate"


@pytest.mark.parametrize("name, one", [("cpu", True), ("single_gpu", True), ("cpu_ddp", False), ("multi_gpu", False),
                                       ("multi_gpu_2", False), ("multi_node", False), ("fsdp2", False),
                                       ("deepspeed_zero3", False)])
def test_only_a_config_of_one_process_on_one_machine_starts_one(name, one):
    assert starts_one_process(yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())) is one


def test_a_config_that_names_one_process_of_several_machines_or_a_distributed_type_starts_more():
    assert starts_one_process({})  # accelerate's defaults: one process
    assert not starts_one_process({"num_processes": 1, "distributed_type": "MULTI_GPU"})
    assert not starts_one_process({"num_processes": 2, "num_machines": 2})


def test_the_stages_run_in_the_launcher_are_launched_stages_with_an_accelerate_config_and_not_train():
    # train keeps accelerate's launcher: a SIGTERM saves a checkpoint that the launcher reports
    assert IN_LAUNCHER and "train" not in IN_LAUNCHER
    assert all(stage in STAGES and STAGES[stage][1] is not None for stage in IN_LAUNCHER)


def test_an_evaluation_runs_in_the_launcher_only_as_one_process_launched_here_alone():
    params = validate(read_yaml(ROOT / "params.yaml"))  # eval.accelerate_config cpu: one process
    for stage in ("evaluate_base", "evaluate"):
        assert in_launcher_config(stage, params, local_command(stage, params))["use_cpu"] is True
    assert in_launcher_config("train", params, local_command("train", params)) is None
    # a Slurm node's launch of eval.nodes 2 (launcher.node_command) joins the other node's process
    command = local_command("evaluate", params)
    at = command.index("-m")
    two_nodes = command[:at] + ["--multi_gpu", "--num_machines", "2", "--num_processes", "2", "--machine_rank", "0"]
    assert in_launcher_config("evaluate", params, two_nodes + command[at:]) is None
    multi = params.model_copy(update={"eval": params.eval.model_copy(update={"accelerate_config": "cpu_ddp"})})
    assert in_launcher_config("evaluate", multi, local_command("evaluate", multi)) is None
