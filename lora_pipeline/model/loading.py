"""The one model loader (every stage and the registered model), quantization, LoRA config, and Liger kernels."""
from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lora_pipeline.families.gpt_oss.rules import MXFP4_EXPERTS
from lora_pipeline.model.base_checks import BITSANDBYTES, method_problem, stored_quantization
from lora_pipeline.model.varlen_attention import NAME as VARLEN, register as register_varlen_attention

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_tokenizer(path: str | Path, padding_side: str = "right", trust_remote_code: bool = False):
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    # transformers keeps the load's local_files_only (true whenever HF_HUB_OFFLINE is set) and writes it into a saved
    # tokenizer_config.json: the adapter and the merged model would then differ between environments.
    tokenizer.init_kwargs.pop("local_files_only", None)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = padding_side
    return tokenizer


def runnable_implementations(model_type: str, model_params) -> dict:
    """The attention and experts implementations this machine runs for a model of `model_type`, and why any
    differs from what model.attn_implementation / model.experts_implementation ask for.

    Flex attention (block-sparse over padding-free batches), torch_varlen (torch's FlashAttention over padding-free
    rows, gpt-oss's sinks included) and flash attention need a GPU; gpt-oss has no sdpa path (its sinks), so eager
    stands in for it.
    """
    attention, experts, notes = model_params.attn_implementation, model_params.experts_implementation, []
    if attention in ("flex_attention", "flash_attention_2", VARLEN) and not torch.cuda.is_available():
        notes.append(f"{attention} needs a CUDA GPU")
        attention = "sdpa"
    if attention == "sdpa" and model_type == "gpt_oss":
        notes.append("gpt-oss has no sdpa attention (attention sinks)")
        attention = "eager"
    if experts == MXFP4_EXPERTS:
        notes.append(f"{MXFP4_EXPERTS} loads as grouped_mm; the train stage then packs the frozen experts in MXFP4")
        experts = "grouped_mm"
    return {"attention": attention, "experts": experts, "notes": notes}


def inference_attention(model_type: str, attention: str) -> tuple[str, str | None]:
    """The attention implementation for passes without gradients (evaluation's held-out loss over padded rows, decode
    steps, merge's check of a few 128-token rows), and why it differs from the loaded one. Flex attention, training's,
    does not pay there: it compiles for each new shape, and its block mask skips nothing in padded rows; gpt-oss's
    does not compile for short passes at all (Inductor finds no kernel for its sinks' score function). So gpt-oss,
    whose sinks rule out sdpa, runs eager, the reference, and other models sdpa, which decodes faster and compiles
    nothing (docs/evaluation.md). torch_varlen takes padding-free rows only: sdpa runs these passes (gpt-oss: eager)."""
    if attention == VARLEN:
        fallback = "eager" if model_type == "gpt_oss" else "sdpa"
        return fallback, f"{VARLEN} takes padding-free rows only: {fallback}"
    if attention != "flex_attention":
        return attention, None
    if model_type == "gpt_oss":
        return "eager", "flex attention compiles for each shape, and gpt-oss's sinks rule out sdpa: eager"
    return "sdpa", "flex attention compiles for each shape and decodes slower than sdpa: sdpa"


def quantization_config(quantization, dtype: str):
    """The transformers quantization config for quantization.method (None: load the weights as they are)."""
    from transformers import BitsAndBytesConfig, Mxfp4Config

    if quantization.method == "mxfp4-dequantize":
        return Mxfp4Config(dequantize=True)
    if quantization.method == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    if quantization.method == "nf4":
        compute = dtype if quantization.compute_dtype == "auto" else quantization.compute_dtype
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=DTYPES[compute],
                                  bnb_4bit_use_double_quant=quantization.double_quant)
    return None


_logged: set[str] = set()


def _once(record: logging.LogRecord) -> bool:
    """A logging filter that lets each message through the first time only."""
    message = record.getMessage()
    new = message not in _logged
    _logged.add(message)
    return new


def load_model(path: str | Path, model_params, quantization=None, revision: str | None = None, **kwargs):
    """A model as every stage (and the registered model) loads it: model.dtype, the attention and experts
    implementations this machine runs, and the weights as `quantization` says.

    `quantization`: the `quantization` params, for the base model as it is trained (and evaluated "before"):
    none, mxfp4-dequantize, or nf4/int8 (bitsandbytes; the model is placed on its device while loading). None: full
    precision, as the merge and a merged model need, whatever was trained: a checkpoint whose config.json declares
    MXFP4 loads dequantized, any other as stored. trust_remote_code only as model.trust_remote_code
    allows; weights only from safetensors files.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, revision=revision)
    stored = stored_quantization(config)
    if quantization is None:
        quantization = SimpleNamespace(method="mxfp4-dequantize" if stored == "mxfp4" else "none")
    problem = method_problem(quantization.method, stored)
    if problem:
        raise ValueError(f"quantization.method: {problem} ({path})")
    chosen = runnable_implementations(config.model_type, model_params)
    if chosen["notes"]:
        log.warning("running attention %s, experts %s: %s", chosen["attention"], chosen["experts"],
                    "; ".join(chosen["notes"]))
    if chosen["attention"] == VARLEN:
        register_varlen_attention()
    load_kwargs = dict(dtype=DTYPES[model_params.dtype], attn_implementation=chosen["attention"],
                       trust_remote_code=model_params.trust_remote_code, use_safetensors=True)
    load_kwargs["quantization_config"] = quantization_config(quantization, model_params.dtype)
    if quantization.method in BITSANDBYTES:
        load_kwargs["device_map"] = {"": device()}  # bitsandbytes quantizes on the device the model runs on
        # int8 inference logs that its inputs go to float16 on every matmul: once is enough
        logging.getLogger("bitsandbytes.autograd._functions").addFilter(_once)
    load_kwargs.update(kwargs)
    model = AutoModelForCausalLM.from_pretrained(path, revision=revision, **load_kwargs)
    if quantization.method == "mxfp4-dequantize" and getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)  # plain 16-bit weights: trained and saved as such
    set_experts_implementation(model, chosen["experts"])
    return model


def experts_modules(model) -> list[torch.nn.Module]:
    """The MoE experts modules whose forward transformers dispatches by config._experts_implementation."""
    return [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "config")]


def set_experts_implementation(model, implementation: str) -> None:
    """Run `implementation` in every experts module. transformers picks grouped_mm when none is asked for, so eager
    has to be set, not left as the default; each experts module's own config is set too, since a module may hold a
    config object other than the model's."""
    modules = experts_modules(model)
    if not modules:
        return
    model.set_experts_implementation(implementation)
    for module in modules:
        module.config._experts_implementation = implementation


def experts_implementation(model) -> str | None:
    """The experts implementation the model's experts modules run (None: not a MoE model)."""
    running = sorted({m.config._experts_implementation for m in experts_modules(model)})
    return ",".join(running) if running else None


def training_device_map():
    """With one replica per GPU (no FSDP/DeepSpeed sharding), load each process's copy straight onto its GPU,
    so the processes do not each stage a whole copy of the model in CPU memory first."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    state = PartialState()
    if torch.cuda.is_available() and state.distributed_type in (DistributedType.NO, DistributedType.MULTI_GPU):
        return {"": state.local_process_index}
    return None


def lora_config(lora_params):
    """peft.LoraConfig from the `lora` params section (field names are peft's own)."""
    from peft import LoraConfig

    fields = lora_params.dump()
    if not fields["target_parameters"]:
        fields.pop("target_parameters")
    return LoraConfig(task_type="CAUSAL_LM", **fields)


def apply_liger(model, wanted: bool, declined: str | None = None) -> dict:
    """Patch the model with Liger kernels where possible; return the decision, to be logged and recorded.
    declined: why another lever rules them out on this run (they are then not applied, and the reason recorded).

    Liger's Triton kernels need a GPU: on a CPU the request is declined, loudly, rather than ignored.
    Its fused linear cross-entropy is left out: it replaces the model's forward, which TRL's SFTTrainer bypasses when
    it computes the loss through its own tiled LM head (trl.trainer.utils.add_fused_lm_head, no full logits in
    memory either; TRL refuses the Liger one in its own liger_kernel_config for this reason). Patched, it would be
    listed here as running while it never runs.
    """
    if not wanted:
        return {"applied": False, "reason": "train.liger is false", "kernels": []}
    if declined:
        log.warning("Liger requested but not applied: %s", declined)
        return {"applied": False, "reason": declined, "kernels": []}
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
    _apply_liger_kernel_to_instance(model=model, fused_linear_cross_entropy=False)
    patched = sorted({f"{type(model.get_submodule(name)).__name__}.forward -> {fn.__module__}.{fn.__qualname__}"
                      for name, fn in forwards().items() if fn is not before[name]})
    decision = {"applied": bool(patched), "reason": f"model_type {model.config.model_type}", "kernels": patched}
    if not patched:
        decision["reason"] = f"Liger has no kernels for model_type {model.config.model_type}"
    log.warning("Liger decision: %s", decision)
    return decision
