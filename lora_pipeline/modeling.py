"""Loading base and fine-tuned models the same way in every stage, LoRA config, and Liger kernels."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_tokenizer(path: str | Path, padding_side: str = "right"):
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = padding_side
    return tokenizer


def runnable_implementations(path: str | Path, model_params) -> dict:
    """The attention and experts implementations this machine runs for the checkpoint at `path`, and why any
    differs from what model.attn_implementation / model.experts_implementation ask for.

    Flex attention (the fast path for gpt-oss's attention sinks and for padding-free batches) and flash
    attention need a GPU; gpt-oss has no sdpa path (its sinks), so eager stands in for it.
    """
    model_type = json.loads((Path(path) / "config.json").read_text())["model_type"]
    attention, experts, notes = model_params.attn_implementation, model_params.experts_implementation, []
    if attention in ("flex_attention", "flash_attention_2") and not torch.cuda.is_available():
        notes.append(f"{attention} needs a CUDA GPU")
        attention = "sdpa"
    if attention == "sdpa" and model_type == "gpt_oss":
        notes.append("gpt-oss has no sdpa attention (attention sinks)")
        attention = "eager"
    return {"attention": attention, "experts": experts, "notes": notes}


def load_model(path: str | Path, model_params, quantized: bool | None = None, **kwargs):
    """The base (or merged) model as every stage loads it: dtype, attention and experts implementations, and
    MXFP4 dequantization.

    `quantized` defaults to model.mxfp4_dequantize; a merged model saved in model.dtype (not MXFP4) passes False.
    trust_remote_code stays off: only architectures that transformers ships are loaded.
    """
    chosen = runnable_implementations(path, model_params)
    if chosen["notes"]:
        log.warning("running attention %s, experts %s: %s", chosen["attention"], chosen["experts"],
                    "; ".join(chosen["notes"]))
    load_kwargs = dict(dtype=DTYPES[model_params.dtype], attn_implementation=chosen["attention"])
    if chosen["experts"] != "eager":  # only MoE models take it
        load_kwargs["experts_implementation"] = chosen["experts"]
    if model_params.mxfp4_dequantize if quantized is None else quantized:
        from transformers import Mxfp4Config

        load_kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
    load_kwargs.update(kwargs)
    return AutoModelForCausalLM.from_pretrained(path, **load_kwargs)


def training_device_map():
    """With one replica per GPU (no FSDP/DeepSpeed sharding), load each process's copy straight onto its GPU,
    so 8 processes do not each stage a 42 GB gpt-oss-20b in CPU memory first."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    state = PartialState()
    if torch.cuda.is_available() and state.distributed_type in (DistributedType.NO, DistributedType.MULTI_GPU):
        return {"": state.local_process_index}
    return None


def lora_config(lora_params):
    """peft.LoraConfig from the `lora` params section (field names are peft's own)."""
    from peft import LoraConfig

    fields = lora_params.to_dict()
    if not fields["target_parameters"]:
        fields.pop("target_parameters")
    return LoraConfig(task_type="CAUSAL_LM", **fields)


def apply_liger(model, wanted: bool) -> dict:
    """Patch the model with Liger kernels where possible; return the decision, to be logged and recorded.

    Liger's Triton kernels need a GPU: on a CPU the request is declined, loudly, rather than ignored.
    """
    if not wanted:
        return {"applied": False, "reason": "train.liger is false", "kernels": []}
    if not torch.cuda.is_available():
        decision = {"applied": False, "reason": "Liger kernels need a CUDA GPU; none is present", "kernels": []}
        log.warning("Liger requested but not applied: %s", decision["reason"])
        return decision
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError as exc:
        raise RuntimeError("train.liger is true but liger-kernel is not installed "
                           "(pip install -r requirements-gpu.txt)") from exc
    def forwards():
        return {name: getattr(m.forward, "__func__", m.forward) for name, m in model.named_modules()}

    before = forwards()
    _apply_liger_kernel_to_instance(model=model)
    patched = sorted({f"{type(model.get_submodule(name)).__name__}.forward -> {fn.__module__}.{fn.__qualname__}"
                      for name, fn in forwards().items() if fn is not before[name]})
    decision = {"applied": bool(patched), "reason": f"model_type {model.config.model_type}", "kernels": patched}
    if not patched:
        decision["reason"] = f"Liger has no kernels for model_type {model.config.model_type}"
    log.warning("Liger decision: %s", decision)
    return decision
