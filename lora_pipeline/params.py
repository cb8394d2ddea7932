"""Typed schema of params.yaml, per-stage views that expose only the keys a stage declares in dvc.yaml, and the
check that params.yaml is still what the validate stage checked at the start of the run."""
from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

ROOT = Path(__file__).resolve().parents[1]
# The digest of the params the validate stage last checked: no DVC output (a digest of every param would make
# every stage re-run on any change), git-ignored like the rest of logs/.
DIGEST = Path("logs/params_digest")


class ParamsError(ValueError):
    """params.yaml is invalid, or a stage read a key that dvc.yaml does not declare for it."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


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


class TinyModel(_Section):
    """Architecture of the tiny offline base model (model.source tiny-qwen2 / tiny-gpt-oss)."""
    vocab_size: int = Field(ge=300)
    hidden_size: int = Field(ge=8)
    intermediate_size: int = Field(ge=8)
    num_hidden_layers: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    num_key_value_heads: int = Field(ge=1)
    num_local_experts: int = Field(ge=1)  # gpt-oss only
    num_experts_per_tok: int = Field(ge=1)  # gpt-oss only
    max_position_embeddings: int = Field(ge=64)
    initializer_range: float = Field(gt=0)
    pretrain_steps: int = Field(ge=0)  # full-parameter LM training on the data as plain text
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
        return self


class Data(_Section):
    source: Literal["builtin", "hub", "local"]
    name: str  # Hub dataset id (hub) or file path (local: .jsonl .json .parquet .csv .tsv)
    revision: str
    hub_split: str
    # auto: detected from the first row (lora_pipeline/formats.py lists each format's fields)
    format: Literal["auto", "messages", "prompt_completion", "sharegpt", "alpaca"]
    columns: dict[str, str]  # a format's field name -> the data set's column holding it
    builtin_rows: int = Field(ge=10)
    builtin_seed: int
    max_rows: int = Field(ge=0)  # 0 keeps every row
    bad_rows: Literal["drop", "fail"]  # drop: drop and count each bad row; fail: stop at the first, naming it
    max_chars: int = Field(ge=0)  # rows with more characters of text are bad rows ("too_long"); 0: no limit

    @model_validator(mode="after")
    def _name_when_needed(self):
        return _require_name(self)


class Model(_Section):
    source: Literal["tiny-qwen2", "tiny-gpt-oss", "hub", "local"]
    name: str  # Hub model id (hub) or folder (local)
    revision: str
    dtype: Literal["float32", "bfloat16", "float16"]
    attn_implementation: Literal["eager", "sdpa", "flex_attention", "flash_attention_2"]
    experts_implementation: Literal["eager", "grouped_mm", "batched_mm"]  # MoE experts (gpt-oss)
    trust_remote_code: bool  # run code a model folder ships; every model, tokenizer and config load passes it
    tiny: TinyModel

    @model_validator(mode="after")
    def _name_when_needed(self):
        return _require_name(self)


class Quantization(_Section):
    """How the base model is loaded to be trained: as stored, MXFP4 experts dequantized, or frozen in 4/8 bits."""
    method: Literal["none", "mxfp4-dequantize", "nf4", "int8"]
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"]  # nf4 only; auto: model.dtype
    double_quant: bool  # nf4 only


class Split(_Section):
    test_size: float = Field(gt=0)  # a fraction below 1, or a row count from 1 up
    seed: int

    @field_validator("test_size")
    @classmethod
    def _whole_row_count(cls, value):
        if value >= 1 and value != int(value):
            raise ValueError("a row count must be whole; allowed: a fraction below 1 or a whole row count")
        return value


class Sft(_Section):
    """trl.SFTConfig fields: these are typed and required; any other SFTConfig field may be added (checked in
    validate against SFTConfig itself)."""
    model_config = ConfigDict(extra="allow")
    learning_rate: float = Field(gt=0)
    num_train_epochs: float = Field(gt=0)
    max_steps: int
    per_device_train_batch_size: int = Field(ge=1)
    gradient_accumulation_steps: int = Field(ge=1)
    lr_scheduler_type: str
    lr_scheduler_kwargs: dict[str, Any]
    warmup_steps: float = Field(ge=0)  # a ratio below 1, else a step count
    weight_decay: float = Field(ge=0)
    max_length: int = Field(ge=16)
    assistant_only_loss: bool
    packing: bool
    padding_free: bool  # rows (truncated at max_length) concatenated into one sequence, no padding
    torch_compile: bool
    bf16: bool
    fp16: bool
    gradient_checkpointing: bool
    # e.g. {every_n_layers: 2}: transformers recomputes every 2nd decoder layer only, the others keep activations
    gradient_checkpointing_kwargs: dict[str, Any]
    ddp_find_unused_parameters: bool  # False: DDP skips its per-step search of the graph for unused weights
    train_sampling_strategy: Literal["random", "sequential", "group_by_length", "batch_rebalance"]
    logging_steps: int = Field(ge=1)
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


class Train(_Section):
    accelerate_config: str  # configs/accelerate/<name>.yaml
    liger: bool
    checkpoint_steps: int = Field(ge=0)  # save a resumable checkpoint every N optimizer steps (0: never)
    sft: Sft

    @field_validator("accelerate_config")
    @classmethod
    def _config_exists(cls, name):
        folder = ROOT / "configs" / "accelerate"
        known = sorted(p.stem for p in folder.glob("*.yaml"))
        if not re.fullmatch(r"[A-Za-z0-9_-]+", name):  # a name, so that it cannot point outside the folder
            raise ValueError(f"a config name (letters, digits, _ and - only), not a path; known: {known}")
        path = folder / f"{name}.yaml"
        if not path.is_file():
            raise ValueError(f"no file {path.relative_to(ROOT)}; known: {known}")
        return name


class Lora(_Section):
    """peft.LoraConfig fields: these are typed and required; any other LoraConfig field may be added (checked in
    validate against LoraConfig itself)."""
    model_config = ConfigDict(extra="allow")
    r: int = Field(ge=1, le=4096)
    lora_alpha: float = Field(gt=0)
    lora_dropout: float = Field(ge=0, lt=1)
    target_modules: str | list[str]
    target_parameters: list[str]  # e.g. gpt-oss experts: mlp.experts.gate_up_proj, mlp.experts.down_proj
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
    # auto: the base checkpoint's own format (MXFP4 experts for openai/gpt-oss, else model_dtype); mxfp4: gpt-oss's
    # experts in MXFP4 and the rest bf16, as openai/gpt-oss is stored; model_dtype: every weight in model.dtype
    save_format: Literal["auto", "mxfp4", "model_dtype"]


class Mgsm(_Section):
    path: str  # folder of mgsm_<lang>.tsv files, "hub" for juletxara/mgsm, or empty to skip
    languages: list[str]
    limit: int = Field(ge=1)

    @field_validator("languages")
    @classmethod
    def _some_languages_when_run(cls, value, info: ValidationInfo):
        return _not_empty(value, "language code while path is set") if info.data.get("path") else value


class Eval(_Section):
    languages: list[str]
    prompts: int = Field(ge=1)  # held-out questions, each asked once per language
    max_new_tokens: int = Field(ge=1)
    batch_size: int = Field(ge=1)
    do_sample: bool
    include_base: bool  # also evaluate the base model, for before/after figures
    loss_rows: int = Field(ge=0)  # 0: the whole test split
    mgsm: Mgsm

    @field_validator("languages")
    @classmethod
    def _some_languages(cls, value):
        return _not_empty(value, "language code")


class Register(_Section):
    model_name: str
    experiment: str
    log_mode: Literal["merged", "adapter"]
    gate_metric: str  # a key of metrics/eval.json, dotted
    gate_greater_is_better: bool


# The section is called `register` in params.yaml; the name only shadows ABCMeta.register, which is unused.
warnings.filterwarnings("ignore", message='Field name "register"', category=UserWarning)


class Params(_Section):
    data: Data
    model: Model
    quantization: Quantization
    split: Split
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
                got += f"; allowed: {_field_names(err['loc'][:-1])}"
            lines.append(f"  {key or '<root>'}: {err['msg']}{got}")
        raise ParamsError(f"{source} is invalid:\n" + "\n".join(lines)) from None


def _field_names(loc: tuple) -> list[str]:
    """The keys the schema allows in the section at `loc`, e.g. ('model', 'tiny')."""
    section = Params
    for name in loc:
        section = section.model_fields[name].annotation
    return list(section.model_fields)


def declared_keys(stage: str, root: Path = ROOT) -> list[str]:
    """The params.yaml keys that dvc.yaml lists for a stage."""
    dvc = yaml.safe_load((root / "dvc.yaml").read_text())
    if stage not in dvc.get("stages", {}):
        raise ParamsError(f"dvc.yaml has no stage '{stage}'")
    keys = []
    for entry in dvc["stages"][stage].get("params", []):
        if isinstance(entry, str):
            keys.append(entry)
        else:  # {file: [keys]}
            for file, file_keys in entry.items():
                if Path(file).name == "params.yaml":
                    keys.extend(file_keys)
    return keys


def is_declared(key: str, declared: list[str]) -> bool:
    """Whether a dotted key is one that dvc.yaml lists, or lies inside a section it lists."""
    return any(key == d or key.startswith(d + ".") for d in declared)


class StageParams:
    """Read-only view of Params that raises on any key the stage did not declare in dvc.yaml."""

    def __init__(self, node: BaseModel, stage: str, declared: list[str], prefix: str = ""):
        self._node, self._stage, self._declared, self._prefix = node, stage, declared, prefix

    def _check(self, path: str, whole: bool) -> None:
        covered = is_declared(path, self._declared)
        if not whole and not covered:
            covered = any(k.startswith(path + ".") for k in self._declared)
        if not covered:
            raise ParamsError(f"stage '{self._stage}' reads '{path}', which dvc.yaml does not list under "
                              f"stages.{self._stage}.params")

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        value = getattr(self._node, name)
        path = self._prefix + name
        if isinstance(value, BaseModel):
            self._check(path, whole=False)
            return StageParams(value, self._stage, self._declared, path + ".")
        self._check(path, whole=True)
        return value

    def to_dict(self) -> dict:
        """Every leaf of this section, each of which must be declared."""
        out = {}
        for name in [*type(self._node).model_fields, *(self._node.model_extra or {})]:
            value = getattr(self, name)
            out[name] = value.to_dict() if isinstance(value, StageParams) else value
        return out


def load_params(stage: str, root: Path = ROOT) -> StageParams:
    """Validate params.yaml as a whole, then return the view of it that `stage` may read. Run by DVC, a stage whose
    params.yaml changed since the validate stage checked it stops first (see stop_if_changed_since_validate)."""
    path = root / "params.yaml"
    if not path.is_file():
        raise ParamsError(f"{path} not found")
    text = path.read_text()
    stop_if_changed_since_validate(stage, text, root)
    return stage_view(validate(yaml.safe_load(text), source=str(path.name)), stage, root)


class _Yaml12Loader(yaml.SafeLoader):
    """PyYAML's safe loader that also reads floats without a dot (1e-8) as floats, as DVC's YAML 1.2 parser does,
    so that a digest sees the same values DVC compares."""


_EXPONENT_FLOAT = re.compile(r"^[-+]?[0-9][0-9_]*(\.[0-9_]*)?[eE][-+]?[0-9]+$")
_Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789"))


def params_digest(text: str) -> str:
    """sha256 of params.yaml's values (not its bytes: comments and layout do not count), as validated when valid."""
    return _values_digest(yaml.load(text, Loader=_Yaml12Loader))


def _values_digest(raw) -> str:
    try:
        values = validate(raw).model_dump(mode="json")  # 1e-3 and 0.001, 1 and 1.0: one value, as DVC sees them
    except ParamsError:
        values = raw
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()


def _lock_digest(root: Path) -> str | None:
    """The digest of the params dvc.lock records for the validate stage (what it last ran with), if any."""
    try:
        lock = yaml.load((root / "dvc.lock").read_text(), Loader=_Yaml12Loader)
        return _values_digest(lock["stages"]["validate"]["params"]["params.yaml"])
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None


def stop_if_changed_since_validate(stage: str, text: str, root: Path = ROOT) -> None:
    """Stop a stage that DVC runs (DVC sets DVC_STAGE) if params.yaml's values are neither those the validate stage
    checked (logs/params_digest) nor those dvc.lock records for it: another `dvc exp run -S` (which writes its
    values into params.yaml before DVC's lock stops it) or an edit changed them during this run, and this stage
    would mix them into the run's result. A normal edit is never stopped: any change of a value re-runs validate
    first (it tracks every section, and is never restored from DVC's run cache: its output persists); when
    validate is up to date (say, after `dvc exp apply`), dvc.lock records exactly the values in params.yaml."""
    recorded = root / DIGEST
    if not os.environ.get("DVC_STAGE") or stage == "validate" or not recorded.is_file():
        return
    now = params_digest(text)
    if now == recorded.read_text().strip() or now == _lock_digest(root):
        return
    raise SystemExit(
        f"{stage}: params.yaml changed after validate checked it at the start of this run (another `dvc exp run`, or "
        "an edit, during the run); stopped before any work so that no result mixes two sets of params. Run "
        "experiments side by side with `dvc exp run --queue` then `dvc exp run --run-all`, or re-run when no other "
        "run is going (params.yaml now holds the other values). A single stage run with `dvc repro -s` after an edit "
        "skips validate: run `dvc repro` instead.")


def stage_view(params: Params, stage: str, root: Path = ROOT) -> StageParams:
    """The view of validated params that `stage` may read; every key it declares in dvc.yaml must exist."""
    declared = declared_keys(stage, root)
    leaves = set(flat_keys(params.model_dump()))
    unknown = [k for k in declared if k not in leaves and not any(l.startswith(k + ".") for l in leaves)]
    if unknown:
        raise ParamsError(f"dvc.yaml stage '{stage}' declares params that the schema does not know: {unknown}")
    return StageParams(params, stage, declared)


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
