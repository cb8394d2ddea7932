"""gpt-oss MXFP4 checkpoints: written, read back, dequantized to a bf16 copy, and the merge's save format."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from lora_pipeline.config.outputs import replace_dir, staging_dir, write_json
from lora_pipeline.families.gpt_oss.mxfp4 import MXFP4_BLOCK, dequantize_mxfp4, quantize_mxfp4
from lora_pipeline.families.gpt_oss.rules import save_format_problem
from lora_pipeline.model.base_checks import stored_quantization
from lora_pipeline.model.checkpoint_files import tensor_files

__all__ = [
    "GPT_OSS_MODULES_TO_NOT_CONVERT",
    "expert_to_disk",
    "expert_from_disk",
    "save_mxfp4_checkpoint",
    "is_mxfp4_checkpoint",
    "load_into",
    "save_dequantized",
    "expert_values_changed",
    "merged_save_format",
]

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


def _is_expert_param(name: str) -> bool:
    return name.endswith(_EXPERT_PARAMS)


def expert_to_disk(weight: torch.Tensor, scale: str = "round_up") -> tuple[torch.Tensor, torch.Tensor]:
    """An expert weight as GptOssExperts holds it, [..., in, out], to the checkpoint's `_blocks` [..., out, in/32, 16]
    and `_scales` [..., out, in/32] (quantize_mxfp4 along `in`, in the openai checkpoints' orientation)."""
    return quantize_mxfp4(weight.transpose(-2, -1), scale=scale)


def expert_from_disk(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of expert_to_disk: the weight [..., in, out], a transposed view of the decoded [..., out, in]."""
    return dequantize_mxfp4(blocks, scales, dtype=dtype).transpose(-2, -1)


def _checkpoint_entries(model, scale: str, device) -> list[tuple[str, int, object]]:
    """(key, bytes on disk, make) for every tensor an MXFP4 checkpoint of `model` holds, in state_dict order;
    make() computes the tensor only when its shard is written. Tied weights (e.g. lm_head -> embed_tokens) once."""
    entries, seen, cache = [], set(), {}

    def expert(name, t, part):
        def make():
            if name not in cache:  # blocks and scales of one param come from one quantize call
                cache.clear()
                w = t.to(device) if device is not None else t  # quantized where it lives unless told otherwise
                blocks, scales = expert_to_disk(w, scale)  # [E, in, out] -> disk [E, out, in]
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


def is_mxfp4_checkpoint(path) -> bool:
    """Whether the checkpoint folder's config.json declares MXFP4 quantization (as openai/gpt-oss does)."""
    config = Path(path) / "config.json"
    return config.is_file() and stored_quantization(json.loads(config.read_text())) == "mxfp4"


def _read(files: dict[str, Path], name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(files[name], "pt") as f:
        return f.get_tensor(name)


def load_into(model, path, device=None) -> None:
    """Overwrite `model`'s weights in place with those of the MXFP4 checkpoint at `path`, the experts dequantized
    (on `device` if given) and every tensor cast to the model's dtype, as from_pretrained with
    Mxfp4Config(dequantize=True) loads them: the saved model, in memory, without a second copy. Raises if a weight
    is missing, extra or of another shape."""
    files = tensor_files(path)
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
                value = expert_from_disk(blocks, scales)
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
    """Write the MXFP4 checkpoint at `path` to the new folder `out_dir` with its experts in bf16 (two bytes per
    parameter, as the whole model in bf16): the weights Mxfp4Config(dequantize=True) loads, under the names
    transformers loads without a quantizer, one shard in memory at a time; config.json without quantization_config,
    the tokenizer and other files copied. A base that loads with quantization.method none, as DeepSpeed ZeRO-3 needs:
    transformers partitions a checkpoint while loading it (zero.Init) only when it is not quantized; from MXFP4 every
    process would first build the whole dequantized model on the CPU. `device`: where the experts are dequantized
    (a GPU where there is one: every expert value is decoded). Written to a staging folder and renamed when
    complete: an interrupted run leaves no partial `out_dir`."""
    import shutil

    from safetensors import safe_open

    src, out = Path(path), Path(out_dir)
    if not is_mxfp4_checkpoint(src):
        raise ValueError(f"{src}: not an MXFP4 checkpoint (its config.json declares no quantization_config "
                         "with quant_method mxfp4)")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out}: exists and is not empty; choose a new folder")
    files = tensor_files(src)

    def dequantized(name):
        blocks, scales = (_read(files, n).to(device or "cpu") for n in (f"{name}_blocks", f"{name}_scales"))
        return expert_from_disk(blocks, scales).contiguous().cpu()

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
    files, base_files = tensor_files(path), tensor_files(base)
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


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m lora_pipeline.families.gpt_oss.mxfp4_checkpoint",
                                     description="MXFP4 checkpoint tools")
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
