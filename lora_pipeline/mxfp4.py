"""MXFP4 (OCP MX e2m1) encode/decode and gpt-oss MXFP4 checkpoints in pure torch, as transformers reads them."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from lora_pipeline.outputs import replace_dir, staging_dir, write_json

__all__ = [
    "FP4_VALUES",
    "MXFP4_BLOCK",
    "GPT_OSS_MODULES_TO_NOT_CONVERT",
    "quantize_mxfp4",
    "dequantize_mxfp4",
    "save_mxfp4_checkpoint",
    "is_mxfp4_checkpoint",
    "load_into",
    "save_dequantized",
    "expert_values_changed",
    "merged_save_format",
    "compare_logits",
    "build_tiny_gpt_oss",
]

# e2m1 code -> value; code bit 3 is the sign. Same table (and order) as transformers.integrations.mxfp4.FP4_VALUES.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Values per shared scale (one uint8 E8M0 exponent, bias 127), along the last (input) dim; 2 values per byte.
MXFP4_BLOCK = 32
_E8M0_BIAS = 127
# Midpoints between consecutive positive e2m1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.
_FP4_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
# quantization_config.modules_to_not_convert of the real openai/gpt-oss checkpoints.
GPT_OSS_MODULES_TO_NOT_CONVERT = [
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
]
# The expert params stored as MXFP4. In memory (GptOssExperts) they are [E, in, out]: gate_up_proj [E, H, 2I],
# down_proj [E, I, H]; on disk the blocks are [E, out, in/32, 16], i.e. transposed, as in the openai checkpoints
# (transformers' convert_moe_packed_tensors undoes this with `.transpose(1, 2)`).
_EXPERT_PARAMS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
_ROWS_PER_CHUNK = 1 << 20  # groups of 32 handled at once: bounds the temporaries to a few hundred MiB


def quantize_mxfp4(weight: torch.Tensor, scale: str = "round_up") -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., K] float (K % 32 == 0) -> (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32]).

    The OCP MX FP4 (e2m1) layout that transformers' gpt-oss loader reads.

    Each group of 32 consecutive values along the last dim shares the scale 2**e, e = scales - 127. With
    scale="round_up", e is the smallest exponent such that max|w| <= 6 * 2**e (ROUND_UP, the default of
    triton_kernels' downcast_to_mxfp_torch, which transformers' Mxfp4Quantize calls), so nothing is clipped.
    scale="min_error" takes, per group, whichever of that e and e - 1 gives the smaller squared error, values beyond
    6 * 2**(e-1) clipped to it: for weights already on an MXFP4 grid plus small changes (a merged LoRA), a group whose
    largest value grew a little past 6 * 2**e keeps its scale instead of doubling it and losing a bit of precision in
    all 32 values; on-grid weights encode exactly either way. w / 2**e is rounded to the nearest e2m1 value (ties to
    even code); byte j of a group holds value 2j in its low nibble and value 2j+1 in its high nibble.
    """
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        got = getattr(weight, "dtype", type(weight))
        raise TypeError(f"weight must be a floating point tensor, got {got}")
    if weight.ndim == 0 or weight.shape[-1] % MXFP4_BLOCK != 0:
        raise ValueError(f"weight's last dim must be a multiple of {MXFP4_BLOCK}, got shape {tuple(weight.shape)}")
    if scale not in ("round_up", "min_error"):
        raise ValueError(f"scale must be 'round_up' or 'min_error', got {scale!r}")
    *prefix, k = weight.shape
    groups = k // MXFP4_BLOCK
    flat = weight.detach().reshape(-1, MXFP4_BLOCK)
    blocks = torch.empty(flat.shape[0], MXFP4_BLOCK // 2, dtype=torch.uint8, device=weight.device)
    scales = torch.empty(flat.shape[0], dtype=torch.uint8, device=weight.device)
    midpoints = torch.tensor(_FP4_MIDPOINTS, dtype=torch.float32, device=weight.device)
    values = torch.tensor(FP4_VALUES, dtype=torch.float32, device=weight.device)
    for r0 in range(0, flat.shape[0], _ROWS_PER_CHUNK):
        r1 = min(r0 + _ROWS_PER_CHUNK, flat.shape[0])
        x = flat[r0:r1].to(torch.float32)  # exact for bf16/fp16/fp32 input
        if not torch.isfinite(x).all():
            raise ValueError("weight contains inf or nan; MXFP4 cannot encode it")
        amax = x.abs().amax(dim=-1)
        # amax = m * 2**p with m in [0.5, 1): the smallest e with amax <= 6 * 2**e is p-3 if m <= 0.75 else p-2.
        mantissa, power = torch.frexp(amax)
        exp = power - 3 + (mantissa > 0.75).to(power.dtype)
        exp = torch.where(amax == 0, torch.full_like(exp, -_E8M0_BIAS), exp).clamp(-_E8M0_BIAS, _E8M0_BIAS)
        q = torch.ldexp(x, (-exp).unsqueeze(-1))  # exact: multiplication by a power of two, |q| <= 6
        code = _e2m1_codes(q, midpoints)
        if scale == "min_error":
            # At e - 1 the values are 2q (those beyond 6 clip to code 6); its squared error in units of 2**e is 1/4
            # of that in units of 2**(e-1). A tie (the same values on both grids) takes the finer grid: for a merged
            # model, the base's scale.
            code_down = _e2m1_codes(2 * q, midpoints)
            err = (values[code] - q).square().sum(-1)
            err_down = (values[code_down] - 2 * q).square().sum(-1) / 4
            down = (err_down <= err) & (exp > -_E8M0_BIAS)
            code = torch.where(down.unsqueeze(-1), code_down, code)
            exp = exp - down.to(exp.dtype)
        code = code.to(torch.uint8)
        blocks[r0:r1] = code[:, 0::2] | (code[:, 1::2] << 4)
        scales[r0:r1] = (exp + _E8M0_BIAS).to(torch.uint8)
    return blocks.reshape(*prefix, groups, MXFP4_BLOCK // 2), scales.reshape(*prefix, groups)


def _e2m1_codes(q: torch.Tensor, midpoints: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code (int64, bit 3 the sign) of each scaled value q; |q| beyond 6 gets +-6."""
    mag = q.abs()
    # bucketize (right=False) gives code i with midpoints[i-1] < |q| <= midpoints[i]: a tie goes to the lower
    # code; move it up where the lower code is odd, so ties land on the even code (round half to even).
    code = torch.bucketize(mag, midpoints)
    tie = (code % 2 == 1) & (mag == midpoints[code.clamp(max=len(_FP4_MIDPOINTS) - 1)])
    code = code + tie.to(code.dtype)
    return code | (((q < 0) & (code > 0)).to(code.dtype) << 3)  # a value rounding to 0 is stored as +0


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse, pure torch: [..., K/32, 16] + [..., K/32] -> [..., K].

    Used by tests and to compare with transformers' own loader.

    Same arithmetic as transformers' convert_moe_packed_tensors (table lookup in `dtype`, then ldexp), but without
    its final transpose: this returns the on-disk orientation [..., out, in].
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.ndim < 2 or blocks.shape[-1] != MXFP4_BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"blocks must be [..., G, {MXFP4_BLOCK // 2}] and scales [..., G]; got {tuple(blocks.shape)} and "
            f"{tuple(scales.shape)}"
        )
    *prefix, groups, nbytes = blocks.shape
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    flat = blocks.reshape(-1, nbytes)
    exp = scales.reshape(-1, 1).to(torch.int32) - _E8M0_BIAS
    out = torch.empty(flat.shape[0], 2 * nbytes, dtype=dtype, device=blocks.device)
    for r0 in range(0, flat.shape[0], _ROWS_PER_CHUNK):
        r1 = min(r0 + _ROWS_PER_CHUNK, flat.shape[0])
        blk, sub = flat[r0:r1], out[r0:r1]
        sub[:, 0::2] = lut[(blk & 0x0F).to(torch.int)]
        sub[:, 1::2] = lut[(blk >> 4).to(torch.int)]
        torch.ldexp(sub, exp[r0:r1], out=sub)
    return out.reshape(*prefix, groups * 2 * nbytes)


def _is_expert_param(name: str) -> bool:
    return name.endswith(_EXPERT_PARAMS)


def _checkpoint_entries(model, scale: str, device) -> list[tuple[str, int, object]]:
    """(key, bytes on disk, make) for every tensor an MXFP4 checkpoint of `model` holds, in state_dict order;
    make() computes the tensor only when its shard is written. Tied weights (e.g. lm_head -> embed_tokens) once."""
    entries, seen, cache = [], set(), {}

    def expert(name, t, part):
        def make():
            if name not in cache:  # blocks and scales of one param come from one quantize call
                cache.clear()
                w = t.to(device) if device is not None else t  # quantized where it lives unless told otherwise
                blocks, scales = quantize_mxfp4(w.transpose(1, 2), scale=scale)  # [E, in, out] -> disk [E, out, in]
                cache[name] = {"blocks": blocks.contiguous().cpu(), "scales": scales.contiguous().cpu()}
            return cache[name][part]
        return make

    def plain(t):
        return lambda: (t.to(torch.bfloat16) if t.is_floating_point() else t).contiguous().cpu().clone()

    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen and t.numel() > 0:
            continue
        seen.add(key)
        t = t.detach()
        if _is_expert_param(name):
            if t.ndim != 3 or t.shape[1] % MXFP4_BLOCK:
                raise ValueError(f"{name}: expected a 3-D [experts, in, out] tensor with `in` a multiple of "
                                 f"{MXFP4_BLOCK}, got shape {tuple(t.shape)}")
            entries.append((f"{name}_blocks", t.numel() // 2, expert(name, t, "blocks")))
            entries.append((f"{name}_scales", t.numel() // MXFP4_BLOCK, expert(name, t, "scales")))
        else:
            size = 2 if t.is_floating_point() else t.element_size()
            entries.append((name, t.numel() * size, plain(t)))
    return entries


def _write_shards(entries: list[tuple[str, int, object]], out_dir: Path, max_shard_bytes: int) -> None:
    """Shards of at most max_shard_bytes (a larger tensor alone), each computed and written before the next: memory
    holds one shard at a time. More than one shard gets a model.safetensors.index.json."""
    shards: list[list[tuple[str, int, object]]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry[1] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry[1]
    metadata = {"format": "pt"}
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({name: make() for name, _, make in shard}, str(out_dir / fname), metadata=metadata)
        weight_map.update(dict.fromkeys((name for name, _, _ in shard), fname))
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(e[1] for e in entries)}, "weight_map": weight_map}
        write_json(out_dir / "model.safetensors.index.json", index)


def save_mxfp4_checkpoint(model, out_dir, *, max_shard_size: int = 5 * 2**30, scale: str = "round_up",
                          device=None) -> None:
    """Save a GptOssForCausalLM to out_dir as an MXFP4 checkpoint, one shard in memory at a time.

    Experts as blocks+scales, in the exact key names and orientation of the real openai/gpt-oss checkpoints;
    everything else bf16 safetensors; config.json with quantization_config {"quant_method": "mxfp4",
    "modules_to_not_convert": GPT_OSS_MODULES_TO_NOT_CONVERT}.

    `<layer>.mlp.experts.gate_up_proj` [E, H, 2I] becomes `..._blocks` [E, 2I, H/32, 16] + `..._scales` [E, 2I, H/32];
    `down_proj` [E, I, H] becomes [E, H, I/32, 16] + [E, H, I/32]; the expert biases stay bf16. A tied lm_head is not
    written twice. Shards above `max_shard_size` bytes get a model.safetensors.index.json. `scale` is
    quantize_mxfp4's; `device` (e.g. a GPU) is where each expert param is quantized, by default where it lives.
    """
    out = Path(out_dir)
    entries = _checkpoint_entries(model, scale, device)
    if not any(name.endswith("_blocks") and _is_expert_param(name[:-len("_blocks")]) for name, _, _ in entries):
        raise ValueError("no `mlp.experts.gate_up_proj` / `mlp.experts.down_proj` params found: not a gpt-oss model?")
    out.mkdir(parents=True, exist_ok=True)
    _write_shards(entries, out, max_shard_size)

    config = copy.deepcopy(model.config)
    config.quantization_config = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": list(GPT_OSS_MODULES_TO_NOT_CONVERT),
    }
    config.dtype = torch.bfloat16
    if getattr(config, "architectures", None) is None:
        config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(out)


def save_format_problem(save_format: str, model_type: str) -> str | None:
    """Why merge.save_format cannot be used with a base model of this type, or None."""
    if save_format == "mxfp4" and model_type != "gpt_oss":
        return (f"merge.save_format: mxfp4, but the base model ({model_type}) is not gpt-oss, whose MoE experts "
                "(mlp.experts.gate_up_proj / down_proj) are what MXFP4 stores; allowed: auto, model_dtype")
    return None


def merged_save_format(save_format: str, base) -> str:
    """'mxfp4' or 'model_dtype': what merge.save_format means for the base checkpoint folder `base` (auto: mxfp4
    when the base stores its experts in MXFP4). ValueError naming the key if the base cannot be saved so."""
    model_type = json.loads((Path(base) / "config.json").read_text()).get("model_type", "unknown")
    problem = save_format_problem(save_format, model_type)
    if problem:
        raise ValueError(problem)
    if save_format == "auto":
        return "mxfp4" if is_mxfp4_checkpoint(base) else "model_dtype"
    return save_format


def compare_logits(reference: torch.Tensor, other: torch.Tensor, mask: torch.Tensor | None = None) -> dict:
    """How far `other`'s logits [..., vocab] are from `reference`'s over the positions in `mask`: max and mean
    |difference|, the max relative to the largest |reference logit|, and how often the top-1 tokens agree."""
    ref, oth = reference.float(), other.float()
    if mask is not None:
        ref, oth = ref[mask.bool()], oth[mask.bool()]
    diff = (ref - oth).abs()
    return {"max_abs_logit_diff": diff.max().item(), "mean_abs_logit_diff": diff.mean().item(),
            "relative_logit_diff": (diff.max() / ref.abs().max()).item(),
            "top1_agreement": (ref.argmax(-1) == oth.argmax(-1)).float().mean().item()}


def is_mxfp4_checkpoint(path) -> bool:
    """Whether the checkpoint folder's config.json declares MXFP4 quantization (as openai/gpt-oss does)."""
    from lora_pipeline.modeling import stored_quantization

    config = Path(path) / "config.json"
    return config.is_file() and stored_quantization(json.loads(config.read_text())) == "mxfp4"


def _checkpoint_files(path) -> dict[str, Path]:
    """Tensor name -> the safetensors file of a checkpoint folder (one file, or sharded with an index) that holds it."""
    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {name: folder / fname for name, fname in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "pt") as f:
        return dict.fromkeys(f.keys(), folder / "model.safetensors")


def _read(files: dict[str, Path], name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(files[name], "pt") as f:
        return f.get_tensor(name)


def load_into(model, path, device=None) -> None:
    """Overwrite `model`'s weights in place with those of the MXFP4 checkpoint at `path`, the experts dequantized
    (on `device` if given) and every tensor cast to the model's dtype, as from_pretrained with
    Mxfp4Config(dequantize=True) loads them: the saved model, in memory, without a second copy. Raises if a weight
    is missing, extra or of another shape."""
    files = _checkpoint_files(path)
    state = model.state_dict()
    done = set()
    with torch.no_grad():
        for name in files:
            if name.endswith("_scales"):
                continue
            target = name[:-len("_blocks")] if name.endswith("_blocks") else name
            if target not in state:
                raise ValueError(f"{path}: {name} is no weight of the model")
            if name.endswith("_blocks"):
                blocks, scales = (_read(files, n).to(device or "cpu") for n in (name, target + "_scales"))
                value = dequantize_mxfp4(blocks, scales, dtype=torch.bfloat16).transpose(1, 2)
            else:
                value = _read(files, name)
            if tuple(value.shape) != tuple(state[target].shape):
                raise ValueError(f"{path}: {name} has shape {tuple(value.shape)}, the model's "
                                 f"{tuple(state[target].shape)}")
            state[target].copy_(value)
            done.add(state[target].untyped_storage().data_ptr())
    missing = [n for n, t in state.items() if t.numel() and t.untyped_storage().data_ptr() not in done]
    if missing:
        raise ValueError(f"{path}: no weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def save_dequantized(path, out_dir, device=None, max_shard_size: int = 5 * 2**30) -> None:
    """Write the MXFP4 checkpoint at `path` to the new folder `out_dir` with its experts in bf16 (42 GB for
    gpt-oss-20b): the weights Mxfp4Config(dequantize=True) loads, under the names transformers loads without a
    quantizer, one shard in memory at a time; config.json without quantization_config, the tokenizer and other
    files copied. A base that loads with quantization.method none, as DeepSpeed ZeRO-3 needs: transformers partitions
    a checkpoint while loading it (zero.Init) only when it is not quantized; from MXFP4 every process would first build
    the whole dequantized model on the CPU. `device`: where the experts are dequantized (gpt-oss-20b took 56 s on one
    H200). Written to a staging folder and renamed when complete: an interrupted run leaves no partial `out_dir`."""
    import shutil

    from safetensors import safe_open

    src, out = Path(path), Path(out_dir)
    if not is_mxfp4_checkpoint(src):
        raise ValueError(f"{src}: not an MXFP4 checkpoint (its config.json declares no quantization_config "
                         "with quant_method mxfp4)")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out}: exists and is not empty; choose a new folder")
    files = _checkpoint_files(src)

    def dequantized(name):
        blocks, scales = (_read(files, n).to(device or "cpu") for n in (f"{name}_blocks", f"{name}_scales"))
        return dequantize_mxfp4(blocks, scales, dtype=torch.bfloat16).transpose(1, 2).contiguous().cpu()

    entries = []
    for name in files:
        with safe_open(files[name], "pt") as f:
            stored = f.get_slice(name)
            numel, dtype = math.prod(stored.get_shape()), stored.get_dtype()
        if name.endswith("_blocks"):  # two e2m1 values per byte, each now two bytes of bf16
            entries.append((name[:-len("_blocks")], numel * 4, lambda n=name[:-len("_blocks")]: dequantized(n)))
        elif not name.endswith("_scales"):
            nbytes = numel * {"F32": 4, "F64": 8, "I64": 8, "I32": 4, "U8": 1, "I8": 1, "BOOL": 1}.get(dtype, 2)
            entries.append((name, nbytes, lambda n=name: _read(files, n)))
    staged = staging_dir(out)
    try:
        _write_shards(entries, staged, max_shard_size)
        config = json.loads((src / "config.json").read_text())
        config.pop("quantization_config")
        write_json(staged / "config.json", config)
        for f in src.iterdir():  # tokenizer, chat template, generation config, license...
            weights = f.name.startswith(("model.safetensors", "model-"))
            if f.is_file() and not weights and not (staged / f.name).exists():
                shutil.copy2(f, staged / f.name)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    replace_dir(staged, out)


def expert_values_changed(path, base, device=None) -> float | None:
    """The fraction of expert weights whose (dequantized, on `device` if given) value in the MXFP4 checkpoint at
    `path` differs from the one in `base`; None if `base` stores no MXFP4 experts under the same names and shapes."""
    if not is_mxfp4_checkpoint(base):
        return None
    files, base_files = _checkpoint_files(path), _checkpoint_files(base)
    changed = total = 0
    for name in (n for n in files if n.endswith("_blocks")):
        scales = name[:-len("_blocks")] + "_scales"
        if name not in base_files or scales not in base_files:
            return None
        ours, theirs = (dequantize_mxfp4(_read(f, name).to(device or "cpu"), _read(f, scales).to(device or "cpu"),
                                         dtype=torch.float32) for f in (files, base_files))
        if ours.shape != theirs.shape:
            return None
        changed += int((ours != theirs).sum())
        total += ours.numel()
    return changed / total if total else None


def build_tiny_gpt_oss(out_dir, **sizes) -> None:
    """Write a randomly initialised tiny gpt-oss (see tiny_gpt_oss) to out_dir as an MXFP4 checkpoint."""
    save_mxfp4_checkpoint(tiny_gpt_oss(**sizes), out_dir)


def tiny_gpt_oss(
    *,
    vocab_size: int,
    hidden_size: int = 64,
    intermediate_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    num_local_experts: int = 4,
    num_experts_per_tok: int = 2,
    sliding_window: int = 32,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    pad_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
    bos_token_id: int | None = None,
    initializer_range: float = 0.02,
):
    """A randomly initialised (torch.manual_seed(seed)) GptOssForCausalLM in bf16.

    The real architecture in bf16: layer_types alternating sliding/full attention as the real config does, YaRN rope
    with factor 32. hidden_size and intermediate_size must be multiples of 32 (ValueError naming the param otherwise).
    """
    from transformers import GptOssConfig, GptOssForCausalLM

    for pname, value in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
        if not isinstance(value, int) or value <= 0 or value % MXFP4_BLOCK != 0:
            raise ValueError(f"{pname} must be a positive multiple of {MXFP4_BLOCK} for MXFP4, got {value!r}")
    positive = {
        "vocab_size": vocab_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "num_local_experts": num_local_experts,
        "num_experts_per_tok": num_experts_per_tok,
        "sliding_window": sliding_window,
        "max_position_embeddings": max_position_embeddings,
    }
    for pname, value in positive.items():
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{pname} must be a positive int, got {value!r}")
    if num_attention_heads % num_key_value_heads != 0:
        raise ValueError(
            f"num_attention_heads ({num_attention_heads}) must be a multiple of num_key_value_heads "
            f"({num_key_value_heads})"
        )
    if num_experts_per_tok > num_local_experts:
        raise ValueError(
            f"num_experts_per_tok ({num_experts_per_tok}) must be <= num_local_experts ({num_local_experts})"
        )
    for pname, value in (("pad_token_id", pad_token_id), ("bos_token_id", bos_token_id)):
        if value is not None and not 0 <= value < vocab_size:
            raise ValueError(f"{pname} {value} is outside the vocabulary [0, {vocab_size})")
    for value in [eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []):
        if not 0 <= value < vocab_size:
            raise ValueError(f"eos_token_id {value} is outside the vocabulary [0, {vocab_size})")

    # The real config's YaRN: factor 32 over original_max_position_embeddings (4096 -> 131072); keep that shape.
    original_max_pos = max(1, max_position_embeddings // 32)
    rope_parameters = {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": max_position_embeddings / original_max_pos,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": original_max_pos,
    }
    config = GptOssConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        num_local_experts=num_local_experts,
        num_experts_per_tok=num_experts_per_tok,
        sliding_window=sliding_window,
        max_position_embeddings=max_position_embeddings,
        rope_parameters=rope_parameters,
        # As in openai/gpt-oss-20b's config.json: layer 0 sliding, then alternating.
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_hidden_layers)],
        tie_word_embeddings=False,
        initializer_range=initializer_range,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=bos_token_id,
    )
    torch.manual_seed(seed)
    return GptOssForCausalLM(config).to(torch.bfloat16).eval()


def gpt_oss_20b_config(num_hidden_layers: int = 24, **overrides):
    """openai/gpt-oss-20b's config.json as a GptOssConfig (full width; fewer layers or experts for cheap checks)."""
    from transformers import GptOssConfig

    fields = dict(num_hidden_layers=num_hidden_layers, num_local_experts=32, num_experts_per_tok=4, vocab_size=201088,
                  hidden_size=2880, intermediate_size=2880, head_dim=64, num_attention_heads=64, num_key_value_heads=8,
                  sliding_window=128, use_cache=False, tie_word_embeddings=False)
    fields.update(overrides)
    n = fields["num_hidden_layers"]
    fields["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    return GptOssConfig(**fields)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m lora_pipeline.mxfp4", description="MXFP4 checkpoint tools")
    commands = parser.add_subparsers(dest="command", required=True)
    dequantize = commands.add_parser("dequantize", help="save_dequantized: an MXFP4 checkpoint folder again, its "
                                     "experts in bf16 (a base for DeepSpeed ZeRO-3, with quantization.method none)")
    dequantize.add_argument("checkpoint", help="the MXFP4 checkpoint folder, e.g. models/base")
    dequantize.add_argument("out", help="a new folder")
    dequantize.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    try:
        save_dequantized(args.checkpoint, args.out, args.device)
    except ValueError as exc:
        raise SystemExit(f"dequantize: {exc}") from None
    print(f"{args.checkpoint} -> {args.out} (experts bf16)")
