"""The checks of the params against the base model, before any weights load (model/loading.py loads it): that a
local model is a model folder (fetch and validate), and validate's checks of its config, module and parameter names
and stored quantization, and the params they rule out: LoRA targets, experts, quantization, save format."""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import re
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from lora_pipeline.config import dvcfiles
from lora_pipeline.config.cache import cached
from lora_pipeline.config.child import run_apart
from lora_pipeline.config.dvcfiles import ROOT
from lora_pipeline.config.gpus import visible_gpus
from lora_pipeline.families.gpt_oss.rules import MXFP4_EXPERTS, packing_problems, save_format_problem

# Multi-process setups that shard each weight across processes: a bitsandbytes-quantized base is not sharded here.
SHARDED = {"FSDP", "DEEPSPEED"}

TINY_MODEL_TYPES = {"tiny-qwen2": "qwen2", "tiny-gpt-oss": "gpt_oss"}

BITSANDBYTES = ("nf4", "int8")  # quantization.method values that freeze the base in 4/8 bits (QLoRA)


def stored_quantization(config) -> str | None:
    """The quant_method a checkpoint's config declares (e.g. mxfp4 for openai/gpt-oss-20b), None for plain weights;
    `config`: a transformers config or config.json's contents."""
    declared = config.get("quantization_config") if isinstance(config, dict) else getattr(config, "quantization_config",
                                                                                           None)
    if declared is None:
        return None
    method = declared.get("quant_method") if isinstance(declared, dict) else getattr(declared, "quant_method", None)
    return str(getattr(method, "value", method))


def method_problem(method: str, stored: str | None) -> str | None:
    """Why quantization.method cannot load a checkpoint that stores `stored` weights, or None if it can."""
    if method == "mxfp4-dequantize" and stored != "mxfp4":
        return ("mxfp4-dequantize, but the base model has no MXFP4 weights (its config.json declares no mxfp4 "
                "quantization_config); allowed: none, nf4, int8")
    if stored == "mxfp4" and method != "mxfp4-dequantize":
        return (f"{method}, but the base model stores MXFP4 weights, which load here only dequantized to 16 bits "
                "(they are not trainable, and MXFP4 compute needs a kernel from the Hub); allowed: mxfp4-dequantize")
    return None


def check_tiny(model) -> None:
    """tiny-gpt-oss is stored in MXFP4, whose blocks need the widths to be multiples of the block size."""
    if model.source != "tiny-gpt-oss":
        return
    from lora_pipeline.families.gpt_oss.mxfp4 import MXFP4_BLOCK

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


def base_config_file(model, root: Path) -> Path | None:
    """config.json of a local or Hub base model: in the local folder, or for a Hub model in models/base when dvc.lock
    shows fetch put that very model there; else (or for a tiny model, built from model.tiny) None."""
    if model.source in TINY_MODEL_TYPES:
        return None
    folder = Path(model.name) if model.source == "local" else root / "models" / "base"
    if model.source == "hub":
        fetched = dvcfiles.locked_params("fetch", root)
        if any(fetched.get(f"model.{key}") != getattr(model, key) for key in ("source", "name", "revision")):
            return None  # models/base holds another model, or none yet
    return folder / "config.json" if (folder / "config.json").is_file() else None


def base_config_json(model, root: Path) -> dict | None:
    """The base model's config.json as read (without transformers), None for a tiny model or where not known yet."""
    file = base_config_file(model, root)
    if file is None:
        return None
    try:
        config = json.loads(file.read_text())
    except ValueError as exc:
        raise ValueError(f"model.name: {file} is not a JSON model config ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"model.name: {file} is not a JSON model config (no object at its top)")
    return config


def base_model_config(model, root: Path):
    """The base model's transformers config, without its weights: built from model.tiny, or read from config.json
    (base_config_file); else None."""
    from transformers import AutoConfig

    if model.source in TINY_MODEL_TYPES:
        tiny = model.tiny
        return AutoConfig.for_model(
            TINY_MODEL_TYPES[model.source], vocab_size=tiny.vocab_size, hidden_size=tiny.hidden_size,
            intermediate_size=tiny.intermediate_size, num_hidden_layers=tiny.num_hidden_layers,
            num_attention_heads=tiny.num_attention_heads, num_key_value_heads=tiny.num_key_value_heads,
            num_local_experts=tiny.num_local_experts, num_experts_per_tok=tiny.num_experts_per_tok)
    file = base_config_file(model, root)
    return None if file is None else AutoConfig.from_pretrained(file.parent, trust_remote_code=model.trust_remote_code)


def base_model_type(model, root: Path = ROOT) -> str | None:
    """The base model's model_type (a tiny model's from its source, another's from its config.json, without
    transformers), None where not known yet."""
    if model.source in TINY_MODEL_TYPES:
        return TINY_MODEL_TYPES[model.source]
    config = base_config_json(model, root)
    return config.get("model_type") if config is not None else None


def built_layout(model_fields: dict, root: str) -> dict:
    """ModelLayout's fields for the base model (model_fields: the model section), from its architecture built on the
    meta device (no memory); run apart from validate (run_apart), which so imports neither torch nor transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    from lora_pipeline.config.params import Model

    model = Model.model_validate(model_fields)
    config = base_model_config(model, Path(root))
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(config, trust_remote_code=model.trust_remote_code)
    # Only leaf modules: peft wraps layers (Linear, Embedding, ...), not the blocks that hold them.
    leaves = [name for name, module in built.named_modules() if not list(module.children())]
    return dataclasses.asdict(ModelLayout(config.model_type, leaves, [n for n, _ in built.named_parameters()]))


def base_model_layout(model, root: Path = ROOT) -> ModelLayout | None:
    """The base model's module and parameter names (built_layout, in a child process). Importing the architecture's
    code takes seconds: the names are cached per config and transformers version (not for remote code, which can
    change under the same version)."""
    if model.source in TINY_MODEL_TYPES:  # its config follows from model.tiny
        described = f"{model.source}\n{model.tiny.model_dump_json()}"
    elif (file := base_config_file(model, root)) is None:
        return None
    else:
        described = file.read_text()

    def names() -> dict:
        return run_apart(built_layout, model.model_dump(mode="json"), str(root))

    key = hashlib.sha256(f"{version('transformers')}\n{described}".encode()).hexdigest()[:20]
    return ModelLayout(**(names() if model.trust_remote_code else cached(f"layout-{key}.json", names)))


def matches(names: list[str], key: str) -> bool:
    """Whether peft's name matching finds `key` among module or parameter names: the name or its dotted tail."""
    return any(name == key or name.endswith("." + key) for name in names)


def module_kinds(names: list[str], parameters: bool = False) -> list[str]:
    """Distinct names without layer numbers: the last part of each module name, or the owner.name of a parameter."""
    parts = 2 if parameters else 1
    return sorted({".".join(n.split(".")[-parts:]) for n in names if not n.split(".")[-1].isdigit()})


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


def base_stored_quantization(model, root: Path = ROOT) -> str | None:
    """The quant_method of the weights the base checkpoint stores (mxfp4 for gpt-oss), None for plain weights;
    UNKNOWN for a Hub model not fetched yet."""
    if model.source in TINY_MODEL_TYPES:  # fetch writes tiny-gpt-oss in MXFP4, as openai/gpt-oss-20b ships
        return "mxfp4" if model.source == "tiny-gpt-oss" else None
    config = base_config_json(model, root)
    return UNKNOWN if config is None else stored_quantization(config)


def check_quantization(model, quantization, train, distributed: str | None, root: Path = ROOT) -> None:
    """quantization choices that the base model, the other params, the accelerate config's distributed_type or this
    machine rule out."""
    method, compute, problems = quantization.method, quantization.compute_dtype, []
    stored = base_stored_quantization(model, root)
    if stored != UNKNOWN and (problem := method_problem(method, stored)):
        problems.append(f"quantization.method: {problem}")
    if method in BITSANDBYTES:
        if importlib.util.find_spec("bitsandbytes") is None:
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
                        "first dequantizes the whole model on the CPU, one copy per process, before training starts; "
                        "write a bf16 copy once (python -m lora_pipeline.families.gpt_oss.mxfp4_checkpoint dequantize "
                        "models/base FOLDER) "
                        "and train that with model.source local, model.name FOLDER, quantization.method none; "
                        "or keep mxfp4-dequantize with fsdp2 or multi_gpu")
    if compute != "auto" and (problem := compute_dtype_problem(method, compute, model.dtype, train.sft)):
        problems.append(f"quantization.compute_dtype: {compute}{problem}")
    if problems:
        raise ValueError("\n".join(problems))


def check_packed_experts(model, lora, train, distributed: str | None, root: Path = ROOT) -> None:
    """model.experts_implementation grouped_mm_mxfp4 (the frozen experts kept in MXFP4 while training) needs a gpt-oss
    base stored in MXFP4, LoRA that leaves the experts' weights alone, one replica per process, and at most as many
    layers kept in 16 bits (train.experts_kept_16bit) as the model has; what is not known before fetch (a Hub model's
    config) the train stage checks on the loaded weights."""
    kept, accelerate_config = train.experts_kept_16bit, train.accelerate_config
    if model.experts_implementation != MXFP4_EXPERTS:
        if kept:
            raise ValueError(f"train.experts_kept_16bit: {kept} keeps layers out of the MXFP4 packing, but "
                             f"model.experts_implementation is {model.experts_implementation}, which packs nothing; "
                             f"allowed: 0, or model.experts_implementation {MXFP4_EXPERTS}")
        return
    stored = base_stored_quantization(model, root)
    problems = packing_problems(base_model_type(model, root), None if stored == UNKNOWN else stored or "none",
                                lora.target_parameters)
    if model.source in TINY_MODEL_TYPES:
        layers = model.tiny.num_hidden_layers
    else:
        layers = (base_config_json(model, root) or {}).get("num_hidden_layers")
    if kept and isinstance(layers, int) and kept > layers:
        problems.append(f"train.experts_kept_16bit: {kept}, but the base model has {layers} decoder layers; allowed: 0 "
                        f"to {layers}")
    if distributed in SHARDED:
        problems.append(f"model.experts_implementation: {MXFP4_EXPERTS} with train.accelerate_config "
                        f"{accelerate_config} ({distributed}): the packed experts are buffers, which FSDP and "
                        "DeepSpeed do not shard (each process would hold all of them), and the path is not tested "
                        "there; allowed: grouped_mm, or a config with one replica per process (single_gpu, multi_gpu, "
                        "...)")
    if problems:
        raise ValueError("\n".join(problems))


def compute_dtype_problem(method: str, compute: str, dtype: str, sft) -> str | None:
    """Why an explicit quantization.compute_dtype makes no sense with these params on this machine, or None."""
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
    if compute == "bfloat16" and (old := [gpu for gpu in visible_gpus() if not gpu.has_bf16]):
        return (f", but this GPU ({old[0].name}, compute capability {'.'.join(map(str, old[0].capability))}) has no "
                "bfloat16, which needs 8.0 or later; allowed here: auto, float16, float32")
    return None


def check_save_format(model, merge, root: Path = ROOT) -> None:
    """merge.save_format: mxfp4 stores gpt-oss's MoE experts, so it needs a gpt-oss base (checked here where the base's
    config is known before fetch; the merge stage checks models/base itself)."""
    model_type = base_model_type(model, root)
    problem = save_format_problem(merge.save_format, model_type) if model_type else None
    if problem:
        raise ValueError(problem)


def check_model(model) -> None:
    """model.source local needs a model folder (config.json) at model.name."""
    if model.source == "local" and not (Path(model.name) / "config.json").is_file():
        raise FileNotFoundError(f"model.name: {model.name} is not a model folder (no config.json)")
