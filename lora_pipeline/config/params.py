"""params.yaml: its typed schema, validated once per process, and the part of it a stage may read (the keys
dvc.yaml declares for it); and the check that params.yaml is still what the validate stage checked at the start of
the run."""
from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo, \
    field_validator, model_validator

from lora_pipeline.config.dvcfiles import ROOT, declared_params, is_declared, locked_params, read_yaml

# The digest of the params the validate stage last checked: no DVC output (a digest of every param would make
# every stage re-run on any change), git-ignored like the rest of logs/.
DIGEST = Path("logs/params_digest")


class ParamsError(ValueError):
    """params.yaml is invalid, or a stage read a key that dvc.yaml does not declare for it."""


class _Section(BaseModel):
    """A section of params.yaml. In a stage's view (for_stage) the keys it did not declare are left out, and reading
    one raises ParamsError naming the stage and the key."""
    model_config = ConfigDict(extra="forbid")
    _stage: str = PrivateAttr("")
    _prefix: str = PrivateAttr("")

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name not in type(self).model_fields or not self._stage:
                raise
            raise ParamsError(f"stage '{self._stage}' reads '{self._prefix}{name}', which dvc.yaml does not list "
                              f"under stages.{self._stage}.params") from None

    def dump(self) -> dict:
        """This section as a dict (train.sft for SFTConfig, lora for LoraConfig); every key in it must be declared."""
        return {name: (value.dump() if isinstance(value := getattr(self, name), _Section) else value)
                for name in [*type(self).model_fields, *(self.model_extra or {})]}


def _require_name(section):
    """data and model: a Hub id or a local path is needed unless the source is built here."""
    if section.source in ("hub", "local") and not section.name:
        raise ValueError(f"name is required when source is '{section.source}'")
    return section


def _not_empty(value, what: str):
    """A list (or string) that must name at least one thing."""
    if not value:
        raise ValueError(f"must name at least one {what}")
    return value


# The schema: types, ranges and the rules between keys. params.yaml's comments say what each key means.


class TinyModel(_Section):
    """Architecture of the tiny offline base model (model.source tiny-qwen2 / tiny-gpt-oss)."""
    vocab_size: int = Field(ge=300)
    hidden_size: int = Field(ge=8)
    intermediate_size: int = Field(ge=8)
    num_hidden_layers: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    num_key_value_heads: int = Field(ge=1)
    num_local_experts: int = Field(ge=1)
    num_experts_per_tok: int = Field(ge=1)
    max_position_embeddings: int = Field(ge=64)
    initializer_range: float = Field(gt=0)
    pretrain_steps: int = Field(ge=0)
    seed: int

    @model_validator(mode="after")
    def _heads_divide(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                             f"{self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not divisible by "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError("num_experts_per_tok is larger than num_local_experts")
        if self.pretrain_steps == 1:
            raise ValueError("pretrain_steps 1 leaves the one-cycle schedule no step to warm up in: use 0 (no "
                             "pretraining) or 2 or more")
        return self


class Data(_Section):
    source: Literal["builtin", "hub", "local"]
    name: str
    revision: str
    hub_split: str
    format: Literal["auto", "messages", "prompt_completion", "sharegpt", "alpaca", "text"]
    columns: dict[str, str]
    preference: Literal["refuse", "chosen_only"]
    builtin_rows: int = Field(ge=10)
    builtin_seed: int
    max_rows: int = Field(ge=0)
    bad_rows: Literal["drop", "fail"]
    duplicates: Literal["drop", "fail"]
    max_chars: int = Field(ge=0)

    @model_validator(mode="after")
    def _name_when_needed(self):
        return _require_name(self)


class Model(_Section):
    source: Literal["tiny-qwen2", "tiny-gpt-oss", "hub", "local"]
    name: str
    revision: str
    dtype: Literal["float32", "bfloat16", "float16"]
    attn_implementation: Literal["eager", "sdpa", "flex_attention", "flash_attention_2", "torch_varlen"]
    experts_implementation: Literal["eager", "grouped_mm", "batched_mm", "grouped_mm_mxfp4"]
    trust_remote_code: bool
    tiny: TinyModel

    @model_validator(mode="after")
    def _name_when_needed(self):
        return _require_name(self)


class Quantization(_Section):
    """How the base model is loaded to be trained: as stored, MXFP4 experts dequantized, or frozen in 4/8 bits."""
    method: Literal["none", "mxfp4-dequantize", "nf4", "int8"]
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"]
    double_quant: bool


class Split(_Section):
    test_size: float = Field(gt=0)
    seed: int

    @field_validator("test_size")
    @classmethod
    def _whole_row_count(cls, value):
        if value >= 1 and value != int(value):
            raise ValueError("a row count must be whole; allowed: a fraction below 1 or a whole row count")
        return value


class Sft(_Section):
    """trl.SFTConfig fields: these are typed and required; any other SFTConfig field may be added (validate checks
    it against SFTConfig's own fields)."""
    model_config = ConfigDict(extra="allow")
    learning_rate: float = Field(gt=0)
    num_train_epochs: float = Field(gt=0)
    max_steps: int
    per_device_train_batch_size: int = Field(ge=1)
    gradient_accumulation_steps: int = Field(ge=1)
    lr_scheduler_type: str
    lr_scheduler_kwargs: dict[str, Any]
    warmup_steps: float = Field(ge=0)
    weight_decay: float = Field(ge=0)
    max_length: int = Field(ge=16)
    assistant_only_loss: bool
    packing: bool
    padding_free: bool
    torch_compile: bool
    bf16: bool
    fp16: bool
    gradient_checkpointing: bool
    gradient_checkpointing_kwargs: dict[str, Any]
    ddp_find_unused_parameters: bool
    train_sampling_strategy: Literal["random", "sequential", "group_by_length", "batch_rebalance"]
    logging_steps: int = Field(ge=1)
    dataloader_num_workers: int = Field(ge=0)
    seed: int

    @field_validator("gradient_checkpointing_kwargs")
    @classmethod
    def _checkpointing_kwargs(cls, value):
        every = value.get("every_n_layers", 1)
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"every_n_layers must be a whole number of layers, at least 1 (got {every!r})")
        if not isinstance(value.get("offload", False), bool):
            raise ValueError(f"offload must be true or false (got {value['offload']!r})")
        return value


def accelerate_config_name(name: str) -> str:
    """An accelerate config's name: a file configs/accelerate/<name>.yaml."""
    folder = ROOT / "configs" / "accelerate"
    known = sorted(p.stem for p in folder.glob("*.yaml"))
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name):  # a name, so that it cannot point outside the folder
        raise ValueError(f"a config name (letters, digits, _ and - only), not a path; known: {known}")
    path = folder / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"no file {path.relative_to(ROOT)}; known: {known}")
    return name


AccelerateConfig = Annotated[str, AfterValidator(accelerate_config_name)]


class Slurm(_Section):
    """Slurm's own settings for the jobs of launch.launcher slurm, passed to srun as they are ("" and 0: Slurm's
    default)."""
    partition: str
    account: str
    time: str
    save_before_limit: int = Field(ge=0)
    gpus_per_node: int = Field(ge=0)
    cpus_per_task: int = Field(ge=0)


class Launch(_Section):
    launcher: Literal["local", "slurm"]
    slurm: Slurm


class Train(_Section):
    accelerate_config: AccelerateConfig
    nodes: int = Field(ge=1)
    global_batch_size: int = Field(ge=0)
    liger: bool
    compile_layers: Literal["none", "default", "max-autotune-no-cudagraphs", "reduce-overhead"]
    flex_block_mask: Literal["auto", "eager", "compiled"]
    host_syncs: Literal["each_step", "at_logging"]
    experts_kept_16bit: int = Field(ge=0)
    checkpoint_steps: int = Field(ge=0)
    sft: Sft


class Lora(_Section):
    """peft.LoraConfig fields: these are typed and required; any other LoraConfig field may be added (validate checks
    it against LoraConfig's own fields)."""
    model_config = ConfigDict(extra="allow")
    r: int = Field(ge=1, le=4096)
    lora_alpha: float = Field(gt=0)
    lora_dropout: float = Field(ge=0, lt=1)
    target_modules: str | list[str]
    target_parameters: list[str]
    bias: Literal["none", "all", "lora_only"]

    @field_validator("target_modules")
    @classmethod
    def _some_modules(cls, value):
        return _not_empty(value, "module (a list of names, a regex, or all-linear)")

    @model_validator(mode="after")
    def _dropout_with_parameters(self):
        if self.target_parameters and self.lora_dropout:
            raise ValueError(f"peft's LoRA on parameters (target_parameters {self.target_parameters}) needs "
                             f"lora_dropout 0, got {self.lora_dropout}")
        return self


class Merge(_Section):
    save_format: Literal["auto", "mxfp4", "model_dtype"]


# The reasoning languages eval.languages and eval.mgsm.languages may name (and the built-in data is written in some of):
# ISO 639-1 code -> the name used in "reasoning language: <Name>" (Multilingual-Thinking's form).
LANGUAGE_NAMES = {"en": "English", "de": "German", "es": "Spanish", "fr": "French", "it": "Italian",
                  "ru": "Russian", "zh": "Chinese", "ja": "Japanese", "th": "Thai", "sw": "Swahili",
                  "bn": "Bengali", "te": "Telugu", "pt": "Portuguese", "nl": "Dutch"}


class Mgsm(_Section):
    path: str
    languages: list[str]
    limit: int = Field(ge=1)

    @field_validator("languages")
    @classmethod
    def _some_languages_when_run(cls, value, info: ValidationInfo):
        return _not_empty(value, "language code while path is set") if info.data.get("path") else value


class Eval(_Section):
    accelerate_config: AccelerateConfig
    nodes: int = Field(ge=1)
    languages: list[str]
    prompts: int = Field(ge=1)
    max_new_tokens: int = Field(ge=1)
    batch_size: int = Field(ge=1)
    do_sample: bool
    decode_step: Literal["eager", "cudagraphs", "inductor", "captured"]
    include_base: bool
    loss_rows: int = Field(ge=0)
    mgsm: Mgsm

    @field_validator("languages")
    @classmethod
    def _some_languages(cls, value):
        return _not_empty(value, "language code")

    @model_validator(mode="after")
    def _captured_decodes_greedily(self):
        if self.decode_step == "captured" and self.do_sample:
            raise ValueError("decode_step captured decodes greedily, and do_sample is true: set do_sample false, or "
                             "decode_step cudagraphs or eager")
        return self


class Register(_Section):
    model_name: str
    experiment: str
    log_mode: Literal["merged", "adapter"]
    gate_metric: str
    gate_greater_is_better: bool | Literal["auto"]
    serve_batch_size: int = Field(ge=1)


# The section is called `register` in params.yaml; the name only shadows ABCMeta.register, which is unused.
warnings.filterwarnings("ignore", message='Field name "register"', category=UserWarning)


class Params(_Section):
    data: Data
    model: Model
    quantization: Quantization
    split: Split
    launch: Launch
    train: Train
    lora: Lora
    merge: Merge
    eval: Eval
    register: Register


def validate(raw: dict, source: str = "params.yaml") -> Params:
    """Validate a params mapping; errors name the dotted key and what is wrong."""
    try:
        return Params.model_validate(raw or {})
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            key = ".".join(str(p) for p in err["loc"])
            got = f" (got {err['input']!r})" if err["type"] != "missing" and not isinstance(err["input"], dict) else ""
            if err["type"] == "extra_forbidden":
                section = Params
                for name in err["loc"][:-1]:
                    section = section.model_fields[name].annotation
                got += f"; allowed: {list(section.model_fields)}"
            lines.append(f"  {key or '<root>'}: {err['msg']}{got}")
        raise ParamsError(f"{source} is invalid:\n" + "\n".join(lines)) from None


def for_stage(params: Params, stage: str, declared: list[str]) -> Params:
    """A copy of validated params holding only the keys `stage` declares; each declared key must exist."""
    leaves = flat_keys(params.model_dump())
    unknown = [k for k in declared if not any(is_declared(leaf, [k]) for leaf in leaves)]
    if unknown:
        raise ParamsError(f"dvc.yaml stage '{stage}' declares params that the schema does not know: {unknown}")

    def keep(node: _Section, prefix: str) -> _Section:
        values = {}
        for name in [*type(node).model_fields, *(node.model_extra or {})]:
            value, path = getattr(node, name), prefix + name
            if is_declared(path, declared):
                values[name] = value
            elif isinstance(value, _Section) and any(k.startswith(path + ".") for k in declared):
                values[name] = keep(value, path + ".")
        view = type(node).model_construct(**values)
        view._stage, view._prefix = stage, prefix
        return view

    return keep(params, "")


def load_params(stage: str, root: Path = ROOT) -> Params:
    """params.yaml validated, then the part of it that `stage` may read. Run by DVC, a stage whose params.yaml
    changed since the validate stage checked it stops first (see stop_if_changed_since_validate)."""
    path = root / "params.yaml"
    if not path.is_file():
        raise ParamsError(f"{path} not found")
    params = validate(read_yaml(path), source=path.name)
    stop_if_changed_since_validate(stage, params, root)
    return for_stage(params, stage, declared_params(stage, root))


def params_digest(params: Params | dict) -> str:
    """sha256 of params' values as validated (1e-3 and 0.001, 1 and 1.0: one value, as DVC compares them); of the
    raw values where they do not validate."""
    if isinstance(params, dict):
        try:
            params = validate(params)
        except ParamsError:
            pass
    values = params.model_dump(mode="json") if isinstance(params, Params) else params
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()


def stop_if_changed_since_validate(stage: str, params: Params, root: Path = ROOT) -> None:
    """Stop a stage that DVC runs (DVC sets DVC_STAGE) if params.yaml's values are neither those the validate stage
    checked (logs/params_digest) nor those dvc.lock records for it: another `dvc exp run -S` (which writes its
    values into params.yaml before DVC's lock stops it) or an edit changed them during this run, and this stage
    would mix them into the run's result. A normal edit is never stopped: any change of a value re-runs validate
    first (it tracks every section, and is never restored from DVC's run cache: its output persists); when
    validate is up to date (say, after `dvc exp apply`), dvc.lock records exactly the values in params.yaml."""
    recorded = root / DIGEST
    if not os.environ.get("DVC_STAGE") or stage == "validate" or not recorded.is_file():
        return
    now = params_digest(params)
    if now == recorded.read_text().strip() or now == params_digest(locked_params("validate", root)):
        return
    raise SystemExit(
        f"{stage}: params.yaml changed after validate checked it at the start of this run (another `dvc exp run`, or "
        "an edit, during the run); stopped before any work so that no result mixes two sets of params. Run "
        "experiments side by side with `dvc exp run --queue` then `dvc exp run --run-all`, or re-run when no other "
        "run is going (params.yaml now holds the other values). A single stage run with `dvc repro -s` after an edit "
        "skips validate: run `dvc repro` instead.")


def flat_keys(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}; lists and dict-valued leaves (like lr_scheduler_kwargs) stay whole."""
    out = {}
    for key, value in tree.items():
        path = prefix + key
        if isinstance(value, dict) and value and path not in _DICT_LEAVES:
            out.update(flat_keys(value, path + "."))
        else:
            out[path] = value
    return out


_DICT_LEAVES = {"train.sft.lr_scheduler_kwargs", "train.sft.gradient_checkpointing_kwargs"}
