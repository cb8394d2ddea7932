"""Bad values in params.yaml: the validate stage refuses each, naming the dotted key, the value and what is allowed."""
import importlib.util
import re
import subprocess
import sys

import pytest
import torch
import yaml

from conftest import ROOT, copy_repo, run_env
from helpers import DELETE, shipped
from lora_pipeline.config.params import ParamsError
from lora_pipeline.data.splitting import MIN_TEST_ROWS
from lora_pipeline.validation.all_checks import validate_all

HAS_FLASH_ATTN = torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    """The stage runs at the repository root; paths in params.yaml are relative to it."""
    monkeypatch.chdir(ROOT)


def case(changes: dict, key: str, value: str, *marks):
    """A bad params change, the key its error must name, and a fragment of that line that shows the value."""
    return pytest.param(changes, key, value, id=f"{key}={value}", marks=marks)


no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
GPT_OSS = {"model.source": "tiny-gpt-oss", "quantization.method": "mxfp4-dequantize", "lora.lora_dropout": 0.0}

BAD = [
    # schema: missing, wrong type, out of range, unknown keys
    case({"lora.r": DELETE}, "lora.r", "Field required"),
    case({"split.seed": "abc"}, "split.seed", "'abc'"),
    case({"lora.r": "eight"}, "lora.r", "'eight'"),
    case({"lora.r": 0}, "lora.r", "greater than or equal to 1 (got 0)"),
    case({"lora.r": 100000}, "lora.r", "less than or equal to 4096 (got 100000)"),
    case({"lora.lora_dropout": 1.5}, "lora.lora_dropout", "less than 1 (got 1.5)"),
    case({"train.sft.learning_rate": -1e-4}, "train.sft.learning_rate", "greater than 0 (got -0.0001)"),
    case({"train.sft.max_length": 5}, "train.sft.max_length", "(got 5)"),
    case({"eval.batch_size": 0}, "eval.batch_size", "(got 0)"),
    case({"data.max_rows": -1}, "data.max_rows", "(got -1)"),
    case({"data.format": "jsonl"}, "data.format", "'jsonl'"),
    case({"model.dtype": "fp8"}, "model.dtype", "'fp8'"),
    case({"train.compile_layers": "max-autotune"}, "train.compile_layers", "'max-autotune'"),
    case({"train.flex_block_mask": "sometimes"}, "train.flex_block_mask", "'sometimes'"),
    case({"train.host_syncs": "never"}, "train.host_syncs", "'never'"),
    case({"train.sft.dataloader_num_workers": -1}, "train.sft.dataloader_num_workers", "(got -1)"),
    case({"register.log_mode": "weights"}, "register.log_mode", "'weights'"),
    case({"split.test_size": 0}, "split.test_size", "(got 0)"),
    case({"split.test_size": 2.5}, "split.test_size", "allowed: a fraction below 1 or a whole row count (got 2.5)"),
    case({"eval.languages": []}, "eval.languages", "at least one language code (got [])"),
    case({"eval.mgsm.path": "hub", "eval.mgsm.languages": []}, "eval.mgsm.languages", "(got [])"),
    case({"lora.target_modules": []}, "lora.target_modules", "or all-linear) (got [])"),
    case({"optimizer": {"lr": 1}}, "optimizer", "allowed: ['data', 'model'"),
    case({"data.sorce": "builtin"}, "data.sorce", "allowed: ['source'"),
    case({"train.accelerate_config": "../../../etc/passwd"}, "train.accelerate_config", "not a path"),
    case({"train.accelerate_config": "nope"}, "train.accelerate_config", "configs/accelerate/nope.yaml"),
    # library fields: misspelt or owned by the train stage
    case({"lora.rank": 16}, "lora.rank", "did you mean lora.r?"),
    case({"train.sft.learning_rat": 1e-4}, "train.sft.learning_rat", "did you mean train.sft.learning_rate?"),
    case({"train.sft.output_dir": "out"}, "train.sft.output_dir", "sets it itself"),
    case({"train.sft.lr_scheduler_type": "cosinus"}, "train.sft.lr_scheduler_type", "'cosinus'"),
    case({"train.accelerate_config": "fsdp2"}, "train.accelerate_config",
         "(FSDP, the model sharded over GPUs) needs a CUDA GPU,"),
    case({"train.accelerate_config": "deepspeed_zero3"}, "train.accelerate_config",
         "needs a CUDA GPU and the deepspeed package (requirements-gpu.txt)"),
    case({"train.sft.gradient_checkpointing_kwargs": {"every_n_layers": 0}}, "train.sft.gradient_checkpointing_kwargs",
         "every_n_layers must be a whole number of layers, at least 1 (got 0)"),
    case({"train.sft.train_sampling_strategy": "balanced"}, "train.sft.train_sampling_strategy", "'batch_rebalance'"),
    # split against the rows the data set yields (data.builtin_rows: 2000)
    case({"split.test_size": 5000}, "split.test_size", "5000"),
    case({"split.test_size": 2000}, "split.test_size", "leaves 2000 test and 0 train rows of at most 2000"),
    case({"split.test_size": 1}, "split.test_size", "leaves 1 test and 1999 train rows"),
    case({"split.test_size": 0.0005}, "split.test_size", "0.0005 leaves 1 test and 1999 train rows"),
    case({"data.source": "hub", "data.name": "org/rows", "data.max_rows": 300, "split.test_size": 300},
         "split.test_size", "of at most 300"),
    # files and language codes
    case({"data.source": "local", "data.name": "../outside.jsonl"}, "data.name", "../outside.jsonl"),
    case({"data.source": "local", "data.name": "data/local/missing.jsonl"}, "data.name", "missing.jsonl"),
    case({"data.source": "hub", "data.name": "org/rows", "data.format": "alpaca", "data.columns": {"answer": "a"}},
         "data.columns.answer", "allowed: ['instruction', 'output', 'input', 'system', 'history']"),
    case({"model.source": "local", "model.name": "configs"}, "model.name", "configs is not a model folder"),
    case({"eval.languages": ["en", "xx"]}, "eval.languages", "unknown codes ['xx']"),
    case({"eval.mgsm.path": "hub", "eval.mgsm.languages": ["de", "yy"]}, "eval.mgsm.languages", "['yy']"),
    # the base model's architecture
    case({"model.experts_implementation": "grouped_mm"}, "model.experts_implementation", "grouped_mm"),
    case({"lora.target_modules": ["q_proj", "qkv_proj"]}, "lora.target_modules", "['qkv_proj']"),
    case({"lora.target_modules": r".*\.c_attn"}, "lora.target_modules", r"'.*\.c_attn'"),
    case({"lora.target_parameters": ["mlp.experts.gate_up_proj"], "lora.lora_dropout": 0.0},
         "lora.target_parameters", "has no MoE experts"),
    case({**GPT_OSS, "lora.target_parameters": ["mlp.experts.up_proj"]}, "lora.target_parameters",
         "['mlp.experts.up_proj']"),
    case({**GPT_OSS, "lora.target_modules": ["gate_proj"]}, "lora.target_modules", "['gate_proj']"),
    case({**GPT_OSS, "model.tiny.hidden_size": 48}, "model.tiny.hidden_size", "48 is not a multiple of 32"),
    # quantization against the base model, the other params and this machine
    case({"quantization.method": "fp8"}, "quantization.method", "'fp8'"),
    case({"quantization.compute_dtype": "int4"}, "quantization.compute_dtype", "'int4'"),
    case({"quantization.method": "mxfp4-dequantize"}, "quantization.method", "has no MXFP4 weights"),
    case({**GPT_OSS, "quantization.method": "none"}, "quantization.method", "none, but the base model stores MXFP4"),
    case({**GPT_OSS, "quantization.method": "nf4"}, "quantization.method", "nf4, but the base model stores MXFP4"),
    case({"quantization.method": "nf4", "train.accelerate_config": "fsdp2"}, "quantization.method", "fsdp2 (FSDP)"),
    case({"quantization.method": "int8", "train.accelerate_config": "deepspeed_zero3"}, "quantization.method",
         "deepspeed_zero3 (DEEPSPEED)"),
    case({**GPT_OSS, "train.accelerate_config": "deepspeed_zero3"}, "quantization.method",
         "python -m lora_pipeline.families.gpt_oss.mxfp4_checkpoint dequantize models/base FOLDER"),
    case({"quantization.method": "int8", "quantization.compute_dtype": "bfloat16"}, "quantization.compute_dtype",
         "applies to method nf4 only (got method int8)"),
    case({"quantization.method": "nf4", "quantization.compute_dtype": "float16", "model.dtype": "bfloat16"},
         "quantization.compute_dtype", "float16 for a bfloat16 model"),
    case({"quantization.method": "nf4", "quantization.compute_dtype": "float32", "train.sft.bf16": True},
         "quantization.compute_dtype", "runs the 4-bit layers' matmuls in bfloat16"),
    case({"merge.save_format": "mxfp4"}, "merge.save_format", "(qwen2) is not gpt-oss"),
    case({"merge.save_format": "fp8"}, "merge.save_format", "'fp8'"),
    # metrics the gate can read
    case({"register.gate_metric": "compliance.overall"}, "register.gate_metric", "'compliance.overall'"),
    case({"register.gate_metric": "eval.compliance.ja"}, "register.gate_metric", "'eval.compliance.ja'"),
    case({"register.gate_metric": "eval.test.los"}, "register.gate_metric", "'eval.test.los'"),
    case({"register.gate_metric": "eval.accuracy.mgsm.overall"}, "register.gate_metric", "mgsm.overall"),
    # names MLflow's registry and tracking store refuse, in MLflow's words
    case({"register.model_name": "my model/v2"}, "register.model_name", "Names cannot contain '/' or ':'"),
    case({"register.model_name": "team:model"}, "register.model_name", "Names cannot contain '/' or ':'"),
    case({"register.model_name": " "}, "register.model_name", "Missing value for required parameter 'name'"),
    case({"register.model_name": ".."}, "register.model_name", "must not resolve to other names"),
    case({"register.model_name": "it's \"v2\""}, "register.model_name", "holds both quote characters"),
    case({"register.experiment": ""}, "register.experiment", "Invalid experiment name: ''"),
    case({"register.experiment": "x" * 501}, "register.experiment", "exceeds the maximum length of 500"),
    # this machine
    case({"train.sft.bf16": True}, "train.sft.bf16", "bf16 True", no_gpu),
    case({"train.sft.fp16": True}, "train.sft.fp16", "fp16 True", no_gpu),
    case({"train.accelerate_config": "multi_gpu"}, "train.accelerate_config",
         "multi_gpu starts 8 processes on this machine (num_processes 8), one per GPU, but this machine has no "
         "CUDA GPU", no_gpu),
    case({"train.accelerate_config": "multi_gpu_2"}, "train.accelerate_config", "multi_gpu_2 starts 2 processes",
         no_gpu),
    case({"train.accelerate_config": "multi_node"}, "train.accelerate_config",
         "starts 8 processes on this machine (num_processes 16 / num_machines 2)", no_gpu),
    case({"model.attn_implementation": "flash_attention_2"}, "model.attn_implementation", "flash_attention_2",
         pytest.mark.skipif(HAS_FLASH_ATTN, reason="this machine runs flash attention")),
    # the launch: several nodes need Slurm; a node's GPUs each need a process
    case({"train.nodes": 2}, "train.nodes", "2 nodes need launch.launcher slurm"),
    case({"eval.nodes": 3}, "eval.nodes", "3 nodes need launch.launcher slurm"),
    case({"launch.launcher": "slurm", "launch.slurm.gpus_per_node": 8}, "launch.slurm.gpus_per_node",
         "8 GPUs per node, but train.accelerate_config cpu starts 1 process per node"),
    case({"launch.launcher": "slurm", "launch.slurm.gpus_per_node": 2, "train.accelerate_config": "multi_gpu_2",
          "eval.accelerate_config": "cpu"}, "launch.slurm.gpus_per_node", "eval.accelerate_config cpu starts 1"),
    case({"launch.launcher": "slurm", "launch.slurm.time": "5"}, "launch.slurm.save_before_limit",
         "300 s is not less than launch.slurm.time 5 (300 s)"),
    case({"launch.slurm.save_before_limit": -1}, "launch.slurm.save_before_limit", "(got -1)"),
    case({"launch.launcher": "pbs"}, "launch.launcher", "'pbs'"),
    case({"train.nodes": 0}, "train.nodes", "(got 0)"),
    # the global batch: a share for each process, the accumulation derived from it
    case({"train.global_batch_size": -1}, "train.global_batch_size", "(got -1)"),
    case({"train.global_batch_size": 3, "train.accelerate_config": "cpu_ddp"}, "train.global_batch_size",
         "3 is not a multiple of the 2 processes train.accelerate_config cpu_ddp starts"),
    case({"train.global_batch_size": 16, "train.sft.gradient_accumulation_steps": 2},
         "train.sft.gradient_accumulation_steps", "2 with train.global_batch_size: 16"),
]


@pytest.mark.parametrize("changes, key, value", BAD)
def test_bad_param_is_refused_naming_key_and_value(changes, key, value):
    with pytest.raises(ParamsError) as refused:
        validate_all(shipped(**changes))
    message = str(refused.value)
    line = next((text for text in message.splitlines() if re.search(rf"{re.escape(key)}[: ]", text)), None)
    assert line is not None, f"no line names {key}:\n{message}"
    assert value in line, f"the line for {key} does not show {value!r}:\n{message}"


def test_every_problem_is_reported_at_once():
    with pytest.raises(ParamsError) as refused:
        validate_all(shipped(**{"eval.languages": ["xx"], "quantization.method": "mxfp4-dequantize",
                                "train.sft.lr_scheduler_type": "cosinus"}))
    for key in ("eval.languages", "quantization.method", "train.sft.lr_scheduler_type"):
        assert key in str(refused.value)


@pytest.mark.parametrize("changes", [
    {},
    {"split.test_size": MIN_TEST_ROWS},
    {"split.test_size": 0.001},  # 2 of 2000 rows
    {"register.gate_metric": "eval.compliance.de"},
    {"register.gate_metric": "train.final_loss"},
    {"register.model_name": "it's my model v2", "register.experiment": "team/lora: run 2"},
    {"register.gate_metric": "eval.accuracy.mgsm.de", "eval.mgsm.path": "hub"},
    {"lora.target_modules": ["q_proj", "self_attn.v_proj", "down_proj"]},
    {"lora.target_modules": r".*\.(q|v)_proj"},
    {"lora.use_rslora": True, "train.sft.max_grad_norm": 0.5, "train.sft.lr_scheduler_type": "constant"},
    {**GPT_OSS, "model.experts_implementation": "grouped_mm",
     "lora.target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]},
    {"quantization.method": "nf4", "quantization.compute_dtype": "bfloat16", "quantization.double_quant": False},
    {"quantization.method": "int8", "train.accelerate_config": "cpu_ddp"},
    {"train.accelerate_config": "cpu_ddp"},  # use_cpu: true, 2 CPU processes
    {"train.global_batch_size": 16, "train.accelerate_config": "cpu_ddp"},
    {"train.global_batch_size": 7, "train.sft.per_device_train_batch_size": 2},  # 1 x GA 7
    {**GPT_OSS, "merge.save_format": "mxfp4"},
    {"merge.save_format": "model_dtype"},
    # a Hub model not fetched yet: its architecture is unknown, so checked only once fetch has it
    {"model.source": "hub", "model.name": "org/model", "quantization.method": "mxfp4-dequantize"},
], ids=lambda changes: ",".join(f"{k}={v}" for k, v in changes.items()) or "shipped")
def test_good_params_pass(changes):
    assert validate_all(shipped(**changes)).lora.r >= 1


def with_srun(tmp_path, monkeypatch):
    """PATH with an `srun` that accepts every job (validate asks `srun --test-only`), and no other Slurm command:
    the checks of the params themselves, whatever Slurm this machine reaches (tests/e2e/test_slurm.py asks a real
    one)."""
    (tmp_path / "srun").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))


def test_slurm_needs_srun_on_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ParamsError, match=r"launch\.launcher: slurm starts jobs with srun, which is not on PATH"):
        validate_all(shipped(**{"launch.launcher": "slurm"}))
    with_srun(tmp_path, monkeypatch)
    validate_all(shipped(**{"launch.launcher": "slurm", "train.nodes": 2, "eval.nodes": 2}))


def test_a_global_batch_is_shared_by_every_process_of_every_node(tmp_path, monkeypatch):
    with_srun(tmp_path, monkeypatch)
    nodes = {"launch.launcher": "slurm", "train.accelerate_config": "cpu_ddp", "train.nodes": 3,
             "train.global_batch_size": 16}
    with pytest.raises(ParamsError, match=r"train.global_batch_size: 16 is not a multiple of the 6 processes of "
                                          r"train.nodes 3 x 2 per node \(train.accelerate_config cpu_ddp\)"):
        validate_all(shipped(**nodes))
    validate_all(shipped(**{**nodes, "train.global_batch_size": 18}))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_gpu_configs_on_slurm_count_the_nodes_gpus_not_this_machines(tmp_path, monkeypatch):
    """A login node without a GPU launches 8-GPU processes on Slurm nodes with 8 GPUs each; locally it refuses."""
    gpu_nodes = {"train.accelerate_config": "multi_gpu", "eval.accelerate_config": "multi_gpu", "train.nodes": 2,
                 "train.sft.bf16": True}
    with pytest.raises(ParamsError, match="train.accelerate_config: multi_gpu starts 8 processes on this machine"):
        validate_all(shipped(**{**gpu_nodes, "train.nodes": 1}))
    with_srun(tmp_path, monkeypatch)
    validate_all(shipped(**gpu_nodes, **{"launch.launcher": "slurm", "launch.slurm.gpus_per_node": 8}))
    with pytest.raises(ParamsError, match="train.sft.bf16 / train.sft.fp16: mixed precision needs a CUDA GPU"):
        validate_all(shipped(**gpu_nodes, **{"launch.launcher": "slurm"}))  # CPU nodes


def test_local_model_is_checked_against_its_config(tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model("qwen2", num_hidden_layers=1).save_pretrained(tmp_path / "qwen2")
    local = {"model.source": "local", "model.name": str(tmp_path / "qwen2")}
    validate_all(shipped(**local))
    with pytest.raises(ParamsError, match=r"quantization\.method: mxfp4-dequantize, but the base model has no MXFP4"):
        validate_all(shipped(**local, **{"quantization.method": "mxfp4-dequantize"}))
    # a gpt-oss checkpoint whose config.json declares MXFP4, as openai/gpt-oss-20b's does
    config = AutoConfig.for_model("gpt_oss", num_hidden_layers=1, hidden_size=64, intermediate_size=64,
                                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
    config.quantization_config = {"quant_method": "mxfp4"}
    config.save_pretrained(tmp_path / "gpt-oss")
    local = {"model.source": "local", "model.name": str(tmp_path / "gpt-oss"), "lora.lora_dropout": 0.0}
    validate_all(shipped(**local, **{"quantization.method": "mxfp4-dequantize"}))
    with pytest.raises(ParamsError, match=r"quantization\.method: int8, but the base model stores MXFP4 weights"):
        validate_all(shipped(**local, **{"quantization.method": "int8"}))


def test_gpu_processes_are_counted_per_machine_against_the_gpus_present(monkeypatch):
    """On a machine with 2 GPUs (as NVML lists them): each machine's share of num_processes, against all GPUs
    or those its gpu_ids lists; CPU processes (use_cpu: true) are not counted."""
    from lora_pipeline.config import gpus
    from lora_pipeline.launch.machine import accelerate_config, gpu_count_problem
    from lora_pipeline.config.params import Train

    two = tuple(gpus.Gpu(f"GPU-{i}", "NVIDIA H100", (9, 0)) for i in range(2))
    monkeypatch.setattr(gpus, "nvml_gpus", lambda: (two, ()))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def problem(name, **changes):
        train = Train.model_validate({**shipped()["train"], "accelerate_config": name})
        return gpu_count_problem(train, {**accelerate_config(train), **changes})

    assert "multi_gpu starts 8 processes" in problem("multi_gpu")
    assert "this machine has 2 CUDA GPUs; allowed here: a copy with num_processes at most 2" in problem("multi_gpu")
    assert problem("multi_gpu_2") is None and problem("single_gpu") is None and problem("cpu_ddp") is None
    assert problem("multi_node", num_processes=4) is None  # 2 machines, 2 processes each
    assert "starts 4 processes on this machine (num_processes 8 / num_machines 2)" in problem("multi_node",
                                                                                               num_processes=8)
    assert "has 1 of the GPUs its gpu_ids lists (1,7) (2 CUDA GPUs in all)" in problem("multi_gpu_2", gpu_ids="1,7")
    assert problem("cpu_ddp", num_processes=8) is None


def test_bitsandbytes_missing_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # what `import bitsandbytes` meets without the package
    with pytest.raises(ParamsError, match=r"quantization\.method: nf4 needs the bitsandbytes package"):
        validate_all(shipped(**{"quantization.method": "nf4"}))
    validate_all(shipped())  # not needed unless asked for


def test_validate_stage_exits_naming_the_key(tmp_path):
    repo = copy_repo(tmp_path / "repo")
    (repo / "params.yaml").write_text(yaml.safe_dump(shipped(**{"lora.r": 0, "train.sft.lr_scheduler_type": "cosinus"}),
                                                     sort_keys=False))
    proc = subprocess.run([sys.executable, "-m", "stages.validate"], cwd=repo, env=run_env(), capture_output=True,
                          text=True)
    assert proc.returncode != 0 and "lora.r:" in proc.stderr and "(got 0)" in proc.stderr, proc.stderr
    assert not (repo / "data" / "params.ok").exists()


@pytest.mark.e2e
def test_bad_model_name_stops_the_run_at_validate(tmp_path):
    """The case of the issue: `dvc exp run -S` with a name MLflow's registry refuses stops at validate, naming the
    key and the rule, before any other stage runs."""
    repo = copy_repo(tmp_path / "repo")
    proc = subprocess.run(["dvc", "exp", "run", "-S", 'register.model_name="my model/v2"'], cwd=repo, env=run_env(),
                          capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "register.model_name: Invalid model name 'my model/v2'. Names cannot contain '/' or ':'." in output, output
    assert "Traceback" not in output, output
    assert not (repo / "data" / "params.ok").exists() and not (repo / "data" / "raw").exists()
