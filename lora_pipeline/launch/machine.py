"""The accelerate config a training launches with, and whether the machines it runs on can run it: its processes,
GPUs, mixed precision and attention kernels, and the launch params (this machine, or Slurm nodes)."""
from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import yaml

from lora_pipeline.config.dvcfiles import ROOT
from lora_pipeline.config.gpus import visible_gpus
from lora_pipeline.model.base_checks import SHARDED


def accelerate_config(train, root: Path = ROOT) -> dict:
    """The accelerate config that train.accelerate_config names ({} if there is none)."""
    config = root / "configs" / "accelerate" / f"{train.accelerate_config}.yaml"
    return (yaml.safe_load(config.read_text()) or {}) if config.is_file() else {}


def distributed_type(train, root: Path = ROOT) -> str | None:
    """accelerate's distributed_type in the config that train.accelerate_config names (None if unreadable)."""
    return accelerate_config(train, root).get("distributed_type")


def processes_here(config: dict) -> int:
    """The processes `accelerate launch` starts on this machine: num_processes counts those of every machine, and
    each machine's launcher starts num_processes / num_machines of them (multi_node: 16 over 2 machines, 8 each)."""
    return int(config.get("num_processes", 1)) // max(int(config.get("num_machines", 1)), 1)


def training_processes(train, launch, root: Path = ROOT) -> tuple[int, str]:
    """The processes a training launch starts over all machines, and that in words: the accelerate config's
    num_processes, or on Slurm over several nodes, train.nodes x the config's processes per machine (as
    launcher.node_command launches them)."""
    config = accelerate_config(train, root)
    if on_slurm(launch) and train.nodes > 1:
        per_node = processes_here(config)
        total = train.nodes * per_node
        return total, (f"the {total} processes of train.nodes {train.nodes} x {per_node} per node "
                       f"(train.accelerate_config {train.accelerate_config})")
    total = int(config.get("num_processes", 1))
    return total, f"the {total} process{'es' * (total != 1)} train.accelerate_config {train.accelerate_config} starts"


def starts_one_process(config: dict) -> bool:
    """Whether `accelerate launch` with the config starts a single process (its one-process launcher) on one machine."""
    return (config.get("distributed_type", "NO") == "NO" and int(config.get("num_processes", 1)) == 1
            and int(config.get("num_machines", 1)) == 1)


def usable_gpus(config: dict) -> tuple[int, str]:
    """How many GPUs of this machine the config's processes can use (all, or those of its gpu_ids that exist), and
    that in words."""
    count, ids = len(visible_gpus()), config.get("gpu_ids", "all")
    present = f"{count} CUDA GPU{'s' * (count != 1)}" if count else "no CUDA GPU"
    if ids in (None, "all") or not count:
        return count, present
    listed = [i.strip() for i in str(ids).split(",") if i.strip()]
    usable = sum(i.isdigit() and int(i) < count for i in listed)
    return usable, f"{usable} of the GPUs its gpu_ids lists ({ids}) ({present} in all)"


def gpu_count_problem(train, config: dict, key: str = "train.accelerate_config") -> str | None:
    """Why the config starts more GPU processes on this machine than it has GPUs, or None. A config with use_cpu:
    true (accelerate's own key) runs CPU processes: with distributed_type MULTI_GPU, accelerate launch still starts
    num_processes of them (its multi-GPU launcher; `--cpu` would start one) and the train stage makes them one group
    over gloo, so GPUs are not counted for it."""
    if config.get("use_cpu"):
        return None
    here, (gpus, have) = processes_here(config), usable_gpus(config)
    if here <= gpus:
        return None
    machines = int(config.get("num_machines", 1))
    counted = f"num_processes {config.get('num_processes', 1)}"
    counted += f" / num_machines {machines}" if machines > 1 else ""
    smaller = f"a copy with num_processes at most {gpus} per machine, or " if gpus else ""
    return (f"{key}: {train.accelerate_config} starts {here} process{'es' * (here != 1)} on this "
            f"machine ({counted}), one per GPU, but this machine has {have}; allowed here: {smaller}a config with "
            "use_cpu: true (cpu, cpu_ddp)")


def on_slurm(launch) -> bool:
    """Whether the accelerator stages run on Slurm nodes (launch.launcher slurm) rather than on this machine."""
    return launch is not None and launch.launcher == "slurm"


def check_machine(model, train, root: Path = ROOT, launch=None) -> None:
    """Settings the machine that trains cannot run: mixed precision needs a GPU, flash attention a GPU and flash-attn
    (flex attention falls back to sdpa on a CPU), FSDP and DeepSpeed GPUs (and DeepSpeed its package), and an
    accelerate config a GPU for each process it starts here. On Slurm the nodes' GPUs are launch.slurm.gpus_per_node
    (check_launch), not this machine's."""
    @functools.cache
    def gpu() -> bool:
        return (on_slurm(launch) and launch.slurm.gpus_per_node > 0) or bool(visible_gpus())

    problems = []
    config = accelerate_config(train, root)
    distributed, lacking = config.get("distributed_type"), []
    sharded_without_gpu = distributed in SHARDED and not gpu()  # the train stage's use_cpu: plain data parallel
    if sharded_without_gpu:
        lacking.append("a CUDA GPU")
    if distributed == "DEEPSPEED" and importlib.util.find_spec("deepspeed") is None:
        lacking.append("the deepspeed package (requirements-gpu.txt)")
    if lacking:
        problems.append(f"train.accelerate_config: {train.accelerate_config} ({distributed}, the model sharded over "
                        f"GPUs) needs {' and '.join(lacking)}, which this machine lacks; allowed here: cpu, cpu_ddp")
    if not sharded_without_gpu and not on_slurm(launch) and (problem := gpu_count_problem(train, config)):
        problems.append(problem)  # e.g. multi_gpu without a GPU would train 8 processes over gloo
    if (train.sft.bf16 or train.sft.fp16) and not gpu():
        problems.append(f"train.sft.bf16 / train.sft.fp16: mixed precision needs a CUDA GPU and none is present (got "
                        f"bf16 {train.sft.bf16}, fp16 {train.sft.fp16}); allowed here: both false, to train on the CPU")
    if model.attn_implementation == "flash_attention_2":
        flash_attn = importlib.util.find_spec("flash_attn") is not None
        lacking = [need for need, present in (("a CUDA GPU", gpu()), ("the flash-attn package", flash_attn))
                   if not present]
        if lacking:
            problems.append(f"model.attn_implementation: flash_attention_2 needs {' and '.join(lacking)}, which "
                            "this machine lacks; allowed here: eager, sdpa, flex_attention")
    if problems:
        raise ValueError("\n".join(problems))


def check_eval_launch(ev, root: Path = ROOT, launch=None) -> None:
    """The evaluation stages run one whole model per process (each takes its share of the prompts): an accelerate
    config that shards the model does not fit them, nor one with more GPU processes than this machine has GPUs."""
    config = accelerate_config(ev, root)
    if config.get("distributed_type") in SHARDED:
        raise ValueError(f"eval.accelerate_config: {ev.accelerate_config} ({config['distributed_type']}) shards the "
                         "model over processes, but each evaluation process holds a whole model; allowed: cpu, "
                         "cpu_ddp, single_gpu, multi_gpu, multi_gpu_2")
    if not on_slurm(launch) and (problem := gpu_count_problem(ev, config, "eval.accelerate_config")):
        raise ValueError(problem)

