"""Checks of the inputs that params.yaml names (files, folders, language codes, the base model's modules, this
machine), cheap enough to run first; validate_all is everything the validate stage runs."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from lora_pipeline.data import check_data, split_rows
from lora_pipeline.formats import check_format
from lora_pipeline.languages import LANGUAGE_NAMES
from lora_pipeline.metrics import mgsm_files
from lora_pipeline.params import ROOT, ParamsError, StageParams, stage_view, validate

# A held-out figure (loss, compliance) from one row is a single sample, not an average: two rows is the least.
MIN_TEST_ROWS = 2


def validate_all(raw: dict, root: Path = ROOT) -> StageParams:
    """Everything the validate stage checks: the schema, each stage's declared keys, then every check below, with
    paths relative to the working directory (the repository root, where stages run); raises one ParamsError that
    lists each problem by its dotted key."""
    params = validate(raw)
    for stage in yaml.safe_load((root / "dvc.yaml").read_text())["stages"]:
        stage_view(params, stage, root)  # every key that dvc.yaml declares must exist in the schema
    view = stage_view(params, "validate", root)
    checks = [
        lambda: check_data(view.data),
        lambda: check_format(view.data),
        lambda: check_split(view.data, view.split),
        lambda: check_model(view.model),
        lambda: check_tiny(view.model),
        lambda: check_library_fields(view.train, view.lora),
        lambda: check_scheduler(view.train),
        lambda: check_machine(view.model, view.train, root),
        lambda: check_base_model(view.model, view.lora, root),
        lambda: check_quantization(view.model, view.quantization, view.train, root),
        lambda: check_save_format(view.model, view.merge, root),
        lambda: check_eval(view.eval),
        lambda: check_register(view.register),
        lambda: check_gate_metric(view.register, view.eval),
    ]
    problems = []
    for check in checks:
        try:
            check()
        except (ValueError, OSError) as exc:
            problems.append(str(exc))
    if problems:
        lines = [line for problem in problems for line in problem.splitlines()]
        raise ParamsError("params.yaml is invalid:\n" + "\n".join(f"  {line}" for line in lines))
    return view


def most_rows(data) -> int | None:
    """The most rows fetch can yield, known before it runs: data.builtin_rows, and data.max_rows of any source."""
    bounds = [n for n in (data.builtin_rows if data.source == "builtin" else 0, data.max_rows) if n]
    return min(bounds) if bounds else None


def held_out_rows(data, split) -> int | None:
    """Test rows that split.test_size leaves, where known before fetch; 0 where split would refuse it."""
    rows = most_rows(data)
    if rows is None:
        return int(split.test_size) if split.test_size >= 1 else None
    try:
        return len(split_rows(list(range(rows)), split.test_size, split.seed)[1])
    except ValueError:
        return 0


def check_split(data, split) -> None:
    test_rows = held_out_rows(data, split)
    if test_rows is not None and test_rows < MIN_TEST_ROWS:
        rows = most_rows(data)
        of = f" of at most {rows} (data.builtin_rows / data.max_rows)" if rows else ""
        raise ValueError(f"split.test_size: {split.test_size:g} leaves {test_rows} test rows{of}; allowed: a "
                         f"fraction below 1 or a whole row count that leaves at least {MIN_TEST_ROWS} test rows and "
                         "one to train")


def check_model(model) -> None:
    if model.source == "local" and not (Path(model.name) / "config.json").is_file():
        raise FileNotFoundError(f"model.name: {model.name} is not a model folder (no config.json)")


def check_tiny(model) -> None:
    """tiny-gpt-oss is stored in MXFP4, whose blocks need the widths to be multiples of the block size."""
    from lora_pipeline.mxfp4 import MXFP4_BLOCK

    if model.source != "tiny-gpt-oss":
        return
    for key in ("hidden_size", "intermediate_size"):
        value = getattr(model.tiny, key)
        if value % MXFP4_BLOCK:
            raise ValueError(f"model.tiny.{key}: {value} is not a multiple of {MXFP4_BLOCK}, which tiny-gpt-oss "
                             f"(MXFP4) needs; allowed: {MXFP4_BLOCK}, {2 * MXFP4_BLOCK}, ...")


@dataclass
class ModelLayout:
    """What LoRA can target in the base model: its type, leaf module and parameter names, whether it has MoE experts."""
    model_type: str
    modules: list[str]
    parameters: list[str]

    @property
    def has_experts(self) -> bool:
        return any(".experts." in name for name in self.parameters)


TINY_MODEL_TYPES = {"tiny-qwen2": "qwen2", "tiny-gpt-oss": "gpt_oss"}


def base_model_config(model, root: Path):
    """The base model's transformers config, without its weights: built from model.tiny, read from the local
    folder, or for a Hub model from models/base when dvc.lock shows fetch put that very model there; else None."""
    from transformers import AutoConfig

    if model.source in TINY_MODEL_TYPES:
        tiny = model.tiny
        return AutoConfig.for_model(
            TINY_MODEL_TYPES[model.source], vocab_size=tiny.vocab_size, hidden_size=tiny.hidden_size,
            intermediate_size=tiny.intermediate_size, num_hidden_layers=tiny.num_hidden_layers,
            num_attention_heads=tiny.num_attention_heads, num_key_value_heads=tiny.num_key_value_heads,
            num_local_experts=tiny.num_local_experts, num_experts_per_tok=tiny.num_experts_per_tok)
    folder = Path(model.name) if model.source == "local" else root / "models" / "base"
    if model.source == "hub":
        lock = root / "dvc.lock"
        fetched = (yaml.safe_load(lock.read_text()) or {}).get("stages", {}).get("fetch", {}) if lock.is_file() else {}
        fetched = fetched.get("params", {}).get("params.yaml", {})
        if any(fetched.get(f"model.{key}") != getattr(model, key) for key in ("source", "name", "revision")):
            return None  # models/base holds another model, or none yet
    if not (folder / "config.json").is_file():
        return None
    return AutoConfig.from_pretrained(folder, trust_remote_code=model.trust_remote_code)


def base_model_layout(model, root: Path = ROOT) -> ModelLayout | None:
    """The base model's module and parameter names, from its architecture built on the meta device (no memory).
    Importing the architecture's code takes seconds on every validate: the names are cached per config and
    transformers version (not for remote code, which can change under the same version)."""
    import hashlib
    from importlib.metadata import version

    config = base_model_config(model, root)
    if config is None:
        return None

    def names() -> dict:
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            built = AutoModelForCausalLM.from_config(config, trust_remote_code=model.trust_remote_code)
        # Only leaf modules: peft wraps layers (Linear, Embedding, ...), not the blocks that hold them.
        leaves = [name for name, module in built.named_modules() if not list(module.children())]
        return dataclasses.asdict(ModelLayout(config.model_type, leaves, [n for n, _ in built.named_parameters()]))

    key = hashlib.sha256(f"{version('transformers')}\n{config.to_json_string()}".encode()).hexdigest()[:20]
    return ModelLayout(**(names() if model.trust_remote_code else cached(f"layout-{key}.json", names)))


def matches(names: list[str], key: str) -> bool:
    """Whether peft's name matching finds `key` among module or parameter names: the name or its dotted tail."""
    return any(name == key or name.endswith("." + key) for name in names)


def check_base_model(model, lora, root: Path = ROOT) -> None:
    """Settings that the base model's architecture rules out: experts on a model without them, LoRA targets that
    name nothing in it."""
    layout = base_model_layout(model, root)
    if layout is None:
        return  # a Hub model not fetched yet: fetch and train check these against the real weights
    problems = []
    arch = f"the base model ({layout.model_type})"
    if model.experts_implementation != "eager" and not layout.has_experts:
        problems.append(f"model.experts_implementation: {model.experts_implementation}, but {arch} has no MoE "
                        "experts; allowed: eager")
    targets = lora.target_modules
    if isinstance(targets, str) and targets != "all-linear" and not any(re.fullmatch(targets, m)
                                                                        for m in layout.modules):
        problems.append(f"lora.target_modules: the regex '{targets}' matches no module of {arch}; allowed: all-linear, "
                        f"a regex or names such as {module_kinds(layout.modules)}")
    elif isinstance(targets, list):
        missing = [t for t in targets if not matches(layout.modules, t)]
        if missing:
            problems.append(f"lora.target_modules: {missing} name no module of {arch}; allowed: "
                            f"{module_kinds(layout.modules)}")
    missing = [t for t in lora.target_parameters if not matches(layout.parameters, t)]
    if missing:
        experts = "" if layout.has_experts else ", which has no MoE experts"
        problems.append(f"lora.target_parameters: {missing} name no parameter of {arch}{experts}; allowed: [] or "
                        f"parameters such as {module_kinds(layout.parameters, parameters=True)}")
    if problems:
        raise ValueError("\n".join(problems))


UNKNOWN = "unknown"
# Multi-process setups that shard each weight across processes: a bitsandbytes-quantized base is not sharded here.
SHARDED = {"FSDP", "DEEPSPEED"}


def base_stored_quantization(model, root: Path = ROOT) -> str | None:
    """The quant_method of the weights the base checkpoint stores (mxfp4 for gpt-oss), None for plain weights;
    UNKNOWN for a Hub model not fetched yet."""
    from lora_pipeline.modeling import stored_quantization

    if model.source in TINY_MODEL_TYPES:  # fetch writes tiny-gpt-oss in MXFP4, as openai/gpt-oss-20b ships
        return "mxfp4" if model.source == "tiny-gpt-oss" else None
    config = base_model_config(model, root)
    return UNKNOWN if config is None else stored_quantization(config)


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


def usable_gpus(config: dict) -> tuple[int, str]:
    """How many GPUs of this machine the config's processes can use (all, or those of its gpu_ids that exist), and
    that in words."""
    import torch

    count, ids = torch.cuda.device_count(), config.get("gpu_ids", "all")
    present = f"{count} CUDA GPU{'s' * (count != 1)}" if count else "no CUDA GPU"
    if ids in (None, "all") or not count:
        return count, present
    listed = [i.strip() for i in str(ids).split(",") if i.strip()]
    usable = sum(i.isdigit() and int(i) < count for i in listed)
    return usable, f"{usable} of the GPUs its gpu_ids lists ({ids}) ({present} in all)"


def gpu_count_problem(train, config: dict) -> str | None:
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
    return (f"train.accelerate_config: {train.accelerate_config} starts {here} process{'es' * (here != 1)} on this "
            f"machine ({counted}), one per GPU, but this machine has {have}; allowed here: {smaller}a config with "
            "use_cpu: true (cpu, cpu_ddp)")


def check_quantization(model, quantization, train, root: Path = ROOT) -> None:
    """quantization choices that the base model, the other params or this machine rule out."""
    from lora_pipeline.modeling import BITSANDBYTES, method_problem

    method, compute, problems = quantization.method, quantization.compute_dtype, []
    stored, distributed = base_stored_quantization(model, root), distributed_type(train, root)
    if stored != UNKNOWN and (problem := method_problem(method, stored)):
        problems.append(f"quantization.method: {problem}")
    if method in BITSANDBYTES:
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            problems.append(f"quantization.method: {method} needs the bitsandbytes package, which is not installed "
                            "(pip install -r requirements.txt); allowed here: none, mxfp4-dequantize")
        if distributed in SHARDED:
            problems.append(f"quantization.method: {method} with train.accelerate_config {train.accelerate_config} "
                            f"({distributed}): the bitsandbytes-quantized base is not sharded across processes here "
                            "(FSDP-QLoRA needs bnb_4bit_quant_storage and per-framework setup that the train stage "
                            "does not do); allowed: none, or a config with one replica per process (cpu, cpu_ddp, "
                            "single_gpu, multi_gpu, ...)")
    if method == "mxfp4-dequantize" and distributed == "DEEPSPEED":
        problems.append(f"quantization.method: mxfp4-dequantize with train.accelerate_config {train.accelerate_config} "
                        "(DEEPSPEED): transformers loads a quantized checkpoint without zero.Init, so every process "
                        "first dequantizes the whole model on the CPU (gpt-oss-20b on 2 processes: still loading "
                        "after 200 s); write a bf16 copy once (python -m lora_pipeline.mxfp4 dequantize models/base "
                        "FOLDER) and train that with model.source local, model.name FOLDER, quantization.method none; "
                        "or keep mxfp4-dequantize with fsdp2 or multi_gpu")
    if compute != "auto" and (problem := compute_dtype_problem(method, compute, model.dtype, train.sft)):
        problems.append(f"quantization.compute_dtype: {compute}{problem}")
    if problems:
        raise ValueError("\n".join(problems))


def compute_dtype_problem(method: str, compute: str, dtype: str, sft) -> str | None:
    """Why an explicit quantization.compute_dtype makes no sense with these params on this machine, or None."""
    import torch

    if method != "nf4":
        return f" applies to method nf4 only (got method {method}); allowed: auto"
    if sft.bf16 or sft.fp16:
        flag, autocast = ("bf16", "bfloat16") if sft.bf16 else ("fp16", "float16")
        if compute != autocast:
            return (f", but train.sft.{flag} runs the 4-bit layers' matmuls in {autocast} whatever it says; "
                    f"allowed: auto, {autocast}")
    elif compute == "float16" and dtype == "bfloat16":
        return (" for a bfloat16 model (model.dtype): activations beyond float16's range (65504) overflow; allowed: "
                "auto, bfloat16, float32")
    if compute == "bfloat16" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        return f", but this GPU ({torch.cuda.get_device_name()}) has no bfloat16; allowed here: auto, float16, float32"
    return None


def check_save_format(model, merge, root: Path = ROOT) -> None:
    """merge.save_format: mxfp4 stores gpt-oss's MoE experts, so it needs a gpt-oss base (checked here where the base's
    config is known before fetch; the merge stage checks models/base itself)."""
    from lora_pipeline.mxfp4_checkpoint import save_format_problem

    config = base_model_config(model, root)
    problem = save_format_problem(merge.save_format, config.model_type) if config is not None else None
    if problem:
        raise ValueError(problem)


def module_kinds(names: list[str], parameters: bool = False) -> list[str]:
    """Distinct names without layer numbers: the last part of each module name, or the owner.name of a parameter."""
    parts = 2 if parameters else 1
    return sorted({".".join(n.split(".")[-parts:]) for n in names if not n.split(".")[-1].isdigit()})


def check_eval(ev) -> None:
    languages = {"eval.languages": ev.languages, "eval.mgsm.languages": ev.mgsm.languages if ev.mgsm.path else []}
    problems = [f"{key}: unknown codes {unknown}; known: {sorted(LANGUAGE_NAMES)}"
                for key, codes in languages.items() if (unknown := [c for c in codes if c not in LANGUAGE_NAMES])]
    if problems:
        raise ValueError("\n".join(problems))
    if ev.mgsm.path and ev.mgsm.path != "hub":
        mgsm_files(ev.mgsm.path, ev.mgsm.languages)


def check_register(register) -> None:
    stage = register.gate_metric.split(".")[0]
    if stage not in ("train", "merge", "eval"):
        raise ValueError(f"register.gate_metric '{register.gate_metric}' must start with train., merge. or eval. "
                         "(the metrics file it comes from)")


def eval_metric_keys(ev) -> list[str]:
    """The figures of the fine-tuned model that stages/evaluate.py writes to metrics/eval.json for these params."""
    keys = ["test.loss", "test.perplexity", "compliance.overall", *(f"compliance.{lang}" for lang in ev.languages),
            "final_language_rate", "accuracy.builtin"]
    if ev.mgsm.path:
        keys += ["accuracy.mgsm.overall", *(f"accuracy.mgsm.{lang}" for lang in ev.mgsm.languages)]
    return keys


def check_gate_metric(register, ev) -> None:
    """An eval. gate metric must be a figure that evaluate writes with these params (train. and merge. figures are
    checked by register against the metrics files)."""
    stage, _, key = register.gate_metric.partition(".")
    if stage == "eval" and key not in (known := eval_metric_keys(ev)):
        raise ValueError(f"register.gate_metric: '{register.gate_metric}' is not a figure that evaluate writes with "
                         f"these eval params; allowed: {['eval.' + k for k in known]}")


# Fields the train stage sets itself: a value in params.yaml would be overridden, so it is refused.
STAGE_OWNED_SFT_FIELDS = {"output_dir", "save_strategy", "save_steps", "save_total_limit", "report_to", "use_cpu",
                          "include_num_input_tokens_seen", "dataloader_num_workers"}


# What LoRA papers and other tools call the fields that peft names otherwise.
FIELD_ALIASES = {"rank": "r", "alpha": "lora_alpha", "dropout": "lora_dropout", "target": "target_modules"}


def closest(name: str, known) -> str | None:
    """The known name that `name` most likely means: its alias, else the nearest spelling."""
    import difflib

    alias = FIELD_ALIASES.get(name)
    return alias if alias in known else next(iter(difflib.get_close_matches(name, sorted(known), n=1)), None)


def unknown_fields(given: dict, known: set[str], section: str, owner: str) -> list[str]:
    """One message per key of `given` that is not a field of `owner`, with the closest field name."""
    messages = []
    for key in given:
        if key not in known:
            close = closest(key, known)
            hint = f"; did you mean {section}.{close}?" if close else ""
            messages.append(f"{section}.{key}: not a {owner} field{hint}")
    return messages


def cached(name: str, compute):
    """compute(), a JSON value, kept in ~/.cache/lora-pipeline/<name> ($XDG_CACHE_HOME): what validate derives
    from the installed libraries, never an input or output of a stage. Written whole or not at all; a cache that
    cannot be read or written only costs the work again."""
    import json
    import os

    path = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lora-pipeline" / name
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    value = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(value))
        partial.replace(path)
    except OSError:
        pass
    return value


def library_fields() -> dict[str, list[str]]:
    """The field names of trl.SFTConfig and peft.LoraConfig, and transformers' scheduler names. Importing them
    loads peft (seconds: bitsandbytes and more) on every validate: they are cached per installed version of trl,
    peft and transformers."""
    from importlib.metadata import version

    def names() -> dict[str, list[str]]:
        from peft import LoraConfig
        from transformers import SchedulerType
        from trl import SFTConfig

        return {"trl.SFTConfig": sorted(f.name for f in dataclasses.fields(SFTConfig)),
                "peft.LoraConfig": sorted(f.name for f in dataclasses.fields(LoraConfig)),
                "transformers.SchedulerType": [s.value for s in SchedulerType]}

    key = "-".join(f"{package}{version(package)}" for package in ("trl", "peft", "transformers"))
    return cached(f"fields-{key}.json", names)


def check_library_fields(train, lora) -> None:
    """train.sft and lora pass straight to trl.SFTConfig and peft.LoraConfig: every key must be one of their fields."""
    fields = library_fields()
    sft = train.sft.to_dict()
    problems = [f"train.sft.{key}: the train stage sets it itself; remove it" for key in sft
                if key in STAGE_OWNED_SFT_FIELDS]
    problems += unknown_fields({k: v for k, v in sft.items() if k not in STAGE_OWNED_SFT_FIELDS},
                               set(fields["trl.SFTConfig"]), "train.sft", "trl.SFTConfig")
    problems += unknown_fields(lora.to_dict(), set(fields["peft.LoraConfig"]) - {"task_type"},
                               "lora", "peft.LoraConfig")
    if problems:
        raise ValueError("\n".join(problems))


def check_scheduler(train) -> None:
    name, known = train.sft.lr_scheduler_type, library_fields()["transformers.SchedulerType"]
    if name not in known:
        close = closest(name, known)
        hint = f"did you mean {close}? " if close else ""
        raise ValueError(f"train.sft.lr_scheduler_type: '{name}' is not a transformers scheduler; {hint}"
                         f"allowed: {known}")


def check_machine(model, train, root: Path = ROOT) -> None:
    """Settings this machine cannot run: mixed precision needs a GPU, flash attention a GPU and flash-attn (flex
    attention falls back to sdpa on a CPU), FSDP and DeepSpeed GPUs (and DeepSpeed its package), and an accelerate
    config a GPU for each process it starts here."""
    import importlib.util

    import torch

    problems = []
    gpu = torch.cuda.is_available()
    config = accelerate_config(train, root)
    distributed, lacking = config.get("distributed_type"), []
    sharded_without_gpu = distributed in SHARDED and not gpu  # the train stage's use_cpu: plain data parallel
    if sharded_without_gpu:
        lacking.append("a CUDA GPU")
    if distributed == "DEEPSPEED" and importlib.util.find_spec("deepspeed") is None:
        lacking.append("the deepspeed package (requirements-gpu.txt)")
    if lacking:
        problems.append(f"train.accelerate_config: {train.accelerate_config} ({distributed}, the model sharded over "
                        f"GPUs) needs {' and '.join(lacking)}, which this machine lacks; allowed here: cpu, cpu_ddp")
    if not sharded_without_gpu and (problem := gpu_count_problem(train, config)):
        problems.append(problem)  # e.g. multi_gpu without a GPU would train 8 processes over gloo
    if not gpu and (train.sft.bf16 or train.sft.fp16):
        problems.append(f"train.sft.bf16 / train.sft.fp16: mixed precision needs a CUDA GPU and none is present (got "
                        f"bf16 {train.sft.bf16}, fp16 {train.sft.fp16}); allowed here: both false, to train on the CPU")
    flash_attn = importlib.util.find_spec("flash_attn") is not None
    lacking = [need for need, present in (("a CUDA GPU", gpu), ("the flash-attn package", flash_attn)) if not present]
    if model.attn_implementation == "flash_attention_2" and lacking:
        problems.append(f"model.attn_implementation: flash_attention_2 needs {' and '.join(lacking)}, which this "
                        "machine lacks; allowed here: eager, sdpa, flex_attention")
    if problems:
        raise ValueError("\n".join(problems))
