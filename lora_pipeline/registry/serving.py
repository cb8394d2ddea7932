"""The registered model as MLflow serves it: a pyfunc ChatModel over the merged model or the adapter on its base, the
checks of a request's prompts and generation params against what the model can serve, and its logging with this
package's code (the registry, aliases and provenance: lora_pipeline.registry.registration)."""
from __future__ import annotations

import math
from numbers import Integral, Real
from pathlib import Path
from typing import NamedTuple

import mlflow
import numpy as np
import pandas as pd
from mlflow.exceptions import MlflowException


# The model params the registered model is loaded with (lora_pipeline.model.loading.load_model).
LOAD_KEYS = ("dtype", "attn_implementation", "experts_implementation", "trust_remote_code")
# Generation params a caller may pass to predict (params=...): greedy, hence deterministic, unless do_sample.
GENERATION_DEFAULTS = {"max_new_tokens": 256, "do_sample": False, "temperature": 1.0, "top_p": 1.0}
OUTPUT_COLUMNS = ("text", "reasoning", "answer")


def _invalid(message: str) -> MlflowException:
    """An error with the request, which `mlflow models serve` answers with HTTP 400 and this message."""
    return MlflowException.invalid_parameter_value(message)


def _shown(value) -> str:
    if value is None:
        return "null"
    value = value.item() if isinstance(value, np.generic) else value  # as JSON sent it: int, not int64
    shown = repr(value[:60]) if isinstance(value, str) else value
    return f"{type(value).__name__} {shown}"


def checked_prompts(values, max_prompts: int | None = None) -> list[str]:
    """The prompts of a request, or an error naming the first that is not a non-empty string, or saying that there
    are more than the `max_prompts` the model generates at once."""
    prompts = list(values)
    if not prompts:
        raise _invalid("inputs: no prompts; give one or more, each rendered with the model's chat template")
    if max_prompts is not None and len(prompts) > max_prompts:
        raise _invalid(f"inputs: {len(prompts)} prompts; this model serves at most {max_prompts} per request (the "
                       "prompts it generates for at once: register.serve_batch_size when it was registered); send "
                       "them in several requests")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            raise _invalid(f"inputs[{i}]: a prompt must be a string (rendered with the model's chat template), "
                           f"got {_shown(prompt)}")
        if not prompt.strip():
            raise _invalid(f"inputs[{i}]: the prompt is empty")
    return [str(prompt) for prompt in prompts]


def refuse_unknown_params(params: dict) -> None:
    if unknown := sorted(map(str, set(params) - set(GENERATION_DEFAULTS))):
        raise _invalid(f"params: unknown {', '.join(map(repr, unknown))}; allowed: {', '.join(GENERATION_DEFAULTS)}")


class Context(NamedTuple):
    """The most tokens the model attends over, prompt and new tokens together, and the config key that says so."""
    tokens: int
    key: str

    def __str__(self) -> str:
        return f"this model's context of {self.tokens} tokens ({self.key} in its config)"


# Where a transformers config states its context length, by architecture.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def model_context(config) -> Context | None:
    """The context a transformers config states (its text part for a multimodal model), or None if it states none."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in CONTEXT_KEYS:
        if isinstance(value := getattr(config, key, None), int) and value > 1:
            return Context(value, key)
    return None


def checked_generation(params: dict | None, context: Context | None = None) -> dict:
    """The generation options of a request, defaults filled in (null is the default), or an error naming the param
    that is unknown, of the wrong type or out of range (max_new_tokens below the model's `context`, leaving a token
    for the prompt). temperature and top_p apply, and are range-checked, only with do_sample."""
    params = params or {}
    refuse_unknown_params(params)
    options = {**GENERATION_DEFAULTS, **{key: value for key, value in params.items() if value is not None}}
    tokens, sample = options["max_new_tokens"], options["do_sample"]
    if isinstance(tokens, (bool, np.bool_)) or not isinstance(tokens, Integral) or tokens < 1:
        raise _invalid(f"params.max_new_tokens must be a whole number of at least 1, got {_shown(tokens)}")
    if not isinstance(sample, (bool, np.bool_)):
        raise _invalid(f"params.do_sample must be true or false, got {_shown(sample)}")
    for key in ("temperature", "top_p"):
        value = options[key]
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, Real) or not math.isfinite(value):
            raise _invalid(f"params.{key} must be a number, got {_shown(value)}")
    if sample and options["temperature"] <= 0:
        raise _invalid(f"params.temperature must be above 0 with do_sample, got {options['temperature']}")
    if sample and not 0 < options["top_p"] <= 1:
        raise _invalid(f"params.top_p must be above 0 and at most 1 with do_sample, got {options['top_p']}")
    if context is not None and tokens >= context.tokens:
        raise _invalid(f"params.max_new_tokens {tokens} leaves no room for a prompt in {context}; at most "
                       f"{context.tokens - 1}")
    return {"max_new_tokens": int(tokens), "do_sample": bool(sample), "temperature": float(options["temperature"]),
            "top_p": float(options["top_p"])}


def check_prompt_lengths(lengths: list[int], max_new_tokens: int, context: Context | None) -> None:
    """Each prompt (its length in tokens) must fit in the model's context with the new tokens asked for: a longer
    one would be generated past what the model was built to attend over (garbage, slowly)."""
    if context is None:
        return
    room = context.tokens - max_new_tokens
    for i, length in enumerate(lengths):
        if length > room:
            raise _invalid(f"inputs[{i}]: the prompt is {length} tokens; {context} less max_new_tokens "
                           f"{max_new_tokens} leaves at most {room} tokens for a prompt; shorten it or ask for "
                           "fewer new tokens")


def _refuse_undeclared_params() -> None:
    """MLflow drops the params a model's schema does not declare before predict sees them, with only a warning in
    the log (mlflow.models.utils._enforce_params_schema): for a schema of the generation params, they are an error
    instead. Installed once per process, by loading a ChatModel."""
    import mlflow.pyfunc

    enforce = mlflow.pyfunc._enforce_params_schema
    if getattr(enforce, "refuses_undeclared", False):
        return

    def strict(params, schema):
        declared = {param.name for param in schema.params} if schema is not None else None
        if isinstance(params, dict) and declared == set(GENERATION_DEFAULTS):
            refuse_unknown_params(params)
        return enforce(params, schema)

    strict.refuses_undeclared = True
    mlflow.pyfunc._enforce_params_schema = strict


class ChatModel(mlflow.pyfunc.PythonModel):
    """pyfunc over the merged model, or over the adapter applied at load time to a referenced base (for models too
    big to copy). Input: prompts rendered with the chat template; output: the assistant's new text only, its
    reasoning and its final answer."""

    def load_context(self, context):
        from types import SimpleNamespace

        from transformers import AutoTokenizer

        from lora_pipeline.model.loading import load_model

        _refuse_undeclared_params()
        config = context.model_config
        self.batch_size = config["serve_batch_size"]
        options = SimpleNamespace(**{key: config[key] for key in LOAD_KEYS})
        if "model" in context.artifacts:
            self.tokenizer = AutoTokenizer.from_pretrained(context.artifacts["model"],
                                                           trust_remote_code=options.trust_remote_code)
            self.model = load_model(context.artifacts["model"], options).eval()
            self.context = model_context(self.model.config)
            return
        from peft import PeftModel

        # The base in full precision (MXFP4 experts dequantized), as the merge uses it, whatever it was trained in.
        self.tokenizer = AutoTokenizer.from_pretrained(context.artifacts["adapter"],
                                                       trust_remote_code=options.trust_remote_code)
        model = load_model(config["base"], options, revision=config.get("revision") or None)
        self.model = PeftModel.from_pretrained(model, context.artifacts["adapter"]).eval()
        self.context = model_context(model.config)

    # The DataFrame hint (the signature turns a list of prompts into one) also spares MLflow's type-hint warning.
    def predict(self, context, model_input: pd.DataFrame, params: dict | None = None) -> pd.DataFrame:
        from lora_pipeline.model.chat import split_reasoning
        from lora_pipeline.evaluate.generation import generate_from_prompts

        prompts = checked_prompts(model_input.iloc[:, 0], self.batch_size)
        options = checked_generation(params, self.context)
        check_prompt_lengths([len(self.tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts],
                             options["max_new_tokens"], self.context)
        sampling = {"do_sample": options["do_sample"]}
        if sampling["do_sample"]:
            sampling.update(temperature=options["temperature"], top_p=options["top_p"])
        generated = generate_from_prompts(self.model, self.tokenizer, prompts, options["max_new_tokens"],
                                          batch_size=self.batch_size, **sampling)
        rows = []
        for raw in generated:
            reasoning, answer = split_reasoning(raw)
            text = self.tokenizer.decode(self.tokenizer(raw, add_special_tokens=False)["input_ids"],
                                         skip_special_tokens=True).strip()
            rows.append({"text": text, "reasoning": reasoning, "answer": answer})
        return pd.DataFrame(rows, columns=list(OUTPUT_COLUMNS))


def _pip_requirements() -> list[str]:
    """Exact versions of what loading the model needs (inferred ones would add torchvision, which breaks)."""
    from importlib.metadata import version

    return [f"{name}=={version(name).split('+')[0]}" for name in
            ("torch", "transformers", "tokenizers", "safetensors", "accelerate", "peft", "pandas")]


def _signature():
    """Prompts in; text, reasoning and answer out; the generation params with their defaults. The prompt column is
    of type Any: `mlflow models serve` casts a request's inputs to a string column's type before any check (123
    becomes "123"), and a named column would refuse a plain list of prompts; predict checks each prompt instead."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, DataType, ParamSchema, ParamSpec, Schema
    from mlflow.types.schema import AnyType

    types = {bool: DataType.boolean, int: DataType.long, float: DataType.double}
    params = ParamSchema([ParamSpec(name, types[type(default)], default)
                          for name, default in GENERATION_DEFAULTS.items()])
    return ModelSignature(inputs=Schema([ColSpec(AnyType())]),
                          outputs=Schema([ColSpec(DataType.string, name) for name in OUTPUT_COLUMNS]), params=params)


def _log_chat_model(artifacts: dict, config: dict):
    return mlflow.pyfunc.log_model(name="model", python_model=ChatModel(), artifacts=artifacts, model_config=config,
                                   pip_requirements=_pip_requirements(), signature=_signature(),
                                   code_paths=[str(Path(__file__).parents[1])])  # the whole lora_pipeline package


def _load_config(model_params, quantization, serve_batch_size: int) -> dict:
    """How the registered model loads, the most prompts it generates for at once (and so takes in one request), and
    the quantization its adapter was trained with (a record only)."""
    return {**{key: getattr(model_params, key) for key in LOAD_KEYS}, "serve_batch_size": serve_batch_size,
            "trained_quantization": quantization.method}


def log_merged_model(model_dir: Path, model_params, quantization, serve_batch_size: int):
    """The merged model, its weights copied into the run."""
    return _log_chat_model({"model": str(model_dir)}, _load_config(model_params, quantization, serve_batch_size))


def log_adapter_model(adapter_dir: Path, model_params, quantization, serve_batch_size: int):
    """Only the adapter, with a reference to its base (a Hub id and revision, or a local folder)."""
    base = model_params.name if model_params.source == "hub" else str(Path("models/base").resolve())
    config = {"base": base, "revision": model_params.revision if model_params.source == "hub" else "",
              **_load_config(model_params, quantization, serve_batch_size)}
    return _log_chat_model({"adapter": str(adapter_dir)}, config)
