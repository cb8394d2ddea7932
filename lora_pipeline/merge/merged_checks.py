"""merge's check of the merged model, weight by weight: each weight a LoRA adapts is the base's plus PEFT's delta within
one rounding to the model's dtype, every other weight is the base's, read lazily from the base's safetensors."""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from lora_pipeline.families.gpt_oss.mxfp4_checkpoint import expert_from_disk
from lora_pipeline.model.checkpoint_files import tensor_files

ADAPTER_FILE = "adapter_model.safetensors"
CHUNK_ELEMENTS = 2**24  # compared a slice of rows at a time: a few float64 temporaries of 128 MiB, whatever the model


@dataclass
class WeightCheck:
    """The figures of metrics/merge.json's `weights`, and why the merge failed (None: it did not)."""
    adapted: int = 0  # weights with a LoRA delta, checked against base + delta
    unchanged: int = 0  # other weights, checked equal to the base's (or the adapter file's, e.g. trained biases)
    max_error_over_bound: float = 0.0  # largest |merged - (base + delta)| / the rounding bound: at most 1 passes
    delta_kept: float = 1.0  # sum((merged - base) * delta) / sum(delta^2): about 1 merged, 0 where the delta is lost
    delta_above_rounding: float = 0.0  # share of the delta's values larger than the bound: where a lost one shows
    problem: str | None = None

    def figures(self) -> dict:
        return {key: value for key, value in vars(self).items() if key != "problem"}


def lora_weights(peft_model) -> dict:
    """The name in the merged model of each weight a LoRA layer of `peft_model` adapts -> that layer, whose
    get_delta_weight (PEFT's own) gives the delta merge_and_unload adds. A LoRA on a parameter (peft's
    target_parameters, e.g. gpt-oss's mlp.experts.gate_up_proj) nests its layers under `base_layer`."""
    from peft.tuners.lora import LoraLayer

    layers = {}
    for name, module in peft_model.base_model.model.named_modules():
        if isinstance(module, LoraLayer) and module.lora_A:
            path = ".".join(part for part in name.split(".") if part != "base_layer")
            layers[f"{path}.{getattr(module, 'parameter_name', 'weight')}"] = module
    return layers


def adapter_load_problem(peft_model, adapter_dir: str | Path) -> str | None:
    """Why the adapter as loaded into `peft_model` is not the adapter file's (a tensor missing, extra or another value:
    peft only warns when a key does not match, and leaves that LoRA at its initial, zero delta), or None."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    stored = load_file(Path(adapter_dir) / ADAPTER_FILE)
    loaded = get_peft_model_state_dict(peft_model)
    if stored.keys() != loaded.keys():
        missing, extra = sorted(stored.keys() - loaded.keys()), sorted(loaded.keys() - stored.keys())
        return (f"{adapter_dir}/{ADAPTER_FILE} does not match the model's LoRA layers: not loaded {missing[:3]}, "
                f"not in the file {extra[:3]} ({len(missing)} and {len(extra)} in all)")
    for key, value in loaded.items():
        if not torch.equal(value.detach().cpu(), stored[key].to(value.dtype)):
            return f"{key}: the model holds other values than {adapter_dir}/{ADAPTER_FILE}"
    return None


def rounding_bound(base: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """How far a merged weight may be from base + delta (float64 tensors) in `dtype`, elementwise. merge_and_unload adds
    PEFT's delta (get_delta_weight, the tensor compared here) to the weight in place: the sum, computed in float32 or
    wider, is rounded once to `dtype`, off by at most half a unit in the last place, and a unit is at most
    eps * |value|. The bound, eps * max(|base|, |base + delta|), allows twice that. A lost delta is off by the whole
    delta: past the bound wherever the delta exceeds a unit of its weight. `tiny` keeps the bound above 0 at 0."""
    info = torch.finfo(dtype)
    return torch.maximum(base.abs(), expected.abs()) * info.eps + info.tiny


class BaseWeights:
    """The base model's weights, read a slice of rows at a time from its safetensors files (MXFP4 experts decoded
    as Mxfp4Config(dequantize=True) decodes them), cast to the merged model's dtype on its device."""

    def __init__(self, folder: str | Path, stack: contextlib.ExitStack):
        from safetensors import safe_open

        self.files = tensor_files(folder)
        handles = {path: stack.enter_context(safe_open(path, "pt")) for path in set(self.files.values())}
        self.handle = {name: handles[path] for name, path in self.files.items()}

    def __contains__(self, name: str) -> bool:
        return name in self.handle or self.decoded(name)

    def decoded(self, name: str) -> bool:
        """Whether the weight is stored in MXFP4 (its values decoded here, by transformers when the model loads)."""
        return name not in self.handle and f"{name}_blocks" in self.handle

    def rows(self, name: str, start: int, stop: int, like: torch.Tensor) -> torch.Tensor:
        if name in self.handle:
            stored = self.handle[name].get_slice(name)
            value = stored[start:stop] if stored.get_shape() else self.handle[name].get_tensor(name).reshape(1)
        else:  # experts stored as MXFP4: [E, ...] blocks and scales, the experts' axis first as in the model
            blocks, scales = (self.handle[f"{name}_{part}"].get_slice(f"{name}_{part}")[start:stop].to(like.device)
                              for part in ("blocks", "scales"))
            value = expert_from_disk(blocks, scales)
        return value.to(like.device, like.dtype)


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor with a first axis to slice (a 0-d one as one row)."""
    return tensor if tensor.ndim else tensor.reshape(1)


def _row_slices(tensor: torch.Tensor):
    rows = tensor.shape[0]
    step = max(1, CHUNK_ELEMENTS // max(1, math.prod(tensor.shape[1:])))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def adapter_values(adapter_dir: str | Path) -> dict:
    """The weights other than LoRA's that the adapter file holds (lora.bias all / lora_only: trained biases), by their
    name in the merged model."""
    from safetensors.torch import load_file

    stored = load_file(Path(adapter_dir) / ADAPTER_FILE)
    return {".".join(p for p in key.removeprefix("base_model.model.").split(".") if p != "base_layer"): value
            for key, value in stored.items() if "lora_" not in key}


def check_merged_weights(merged, layers: dict, base_dir: str | Path, adapter_dir: str | Path) -> WeightCheck:
    """Whether `merged` (from merge_and_unload) holds, for each weight in `layers` (lora_weights of the model before
    merging), the base's weight plus its layer's delta within rounding_bound, and every other weight unchanged: the
    base's (or the adapter file's), value for value after the cast the load made. One weight and one slice of its
    rows in memory at a time, on the device where the merged model sits."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    check = WeightCheck()
    if any(isinstance(module, BaseTunerLayer) for module in merged.modules()):
        check.problem = "the merged model still holds LoRA layers: merge_and_unload did not unload them"
        return check
    params = dict(merged.named_parameters(remove_duplicate=False)) | dict(merged.named_buffers())
    state = merged.state_dict()
    from_adapter = adapter_values(adapter_dir)
    kept_dot = kept_norm = above = total = 0.0
    failed = []
    with contextlib.ExitStack() as stack, torch.no_grad():
        base = BaseWeights(base_dir, stack)
        for name, layer in layers.items():
            weight = params.get(name)
            if weight is None or name not in base:
                where = "the merged model" if weight is None else base_dir
                check.problem = f"{name}: adapted by the LoRA, but not found in {where}: the merge cannot be checked"
                return check
            weight = _rows(weight)
            delta = _rows(layer.get_delta_weight(next(iter(layer.lora_A))).to(weight.device))
            worst = dot = norm = 0.0
            for start, stop in _row_slices(weight):
                before = base.rows(name, start, stop, weight).double()
                change = delta[start:stop].double()
                expected = before + change
                bound = rounding_bound(before, expected, weight.dtype)
                merged_rows = weight[start:stop].double()
                worst = max(worst, ((merged_rows - expected).abs() / bound).max().item())
                dot += ((merged_rows - before) * change).sum().item()
                norm += change.square().sum().item()
                above += (change.abs() > bound).sum().item()
                total += change.numel()
            del delta
            check.adapted += 1
            check.max_error_over_bound = max(check.max_error_over_bound, worst)
            kept_dot, kept_norm = kept_dot + dot, kept_norm + norm
            if worst > 1:
                failed.append(name)
                if len(failed) == 1:
                    dtype = str(weight.dtype).removeprefix("torch.")
                    check.problem = (f"{name} is not the base's plus the LoRA delta within {dtype}'s rounding: "
                                     f"|merged - (base + delta)| reaches {worst:.3g} times the bound, and the merged "
                                     f"weight holds {dot / norm if norm else 0:.1%} of the delta (0: the adapter was "
                                     "lost or this module not merged)")
        if len(failed) > 1:
            check.problem += f"; {len(failed) - 1} other adapted weights fail too"
        check.delta_kept = kept_dot / kept_norm if kept_norm else 1.0
        check.delta_above_rounding = above / total if total else 0.0
        if check.problem:
            return check
        tied: dict[tuple, list[str]] = {}  # a weight tied to another (lm_head to embed_tokens) is one tensor
        for name, tensor in state.items():
            if tensor.numel():
                tied.setdefault((tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape)),
                                []).append(name)
        for names in tied.values():
            if any(name in layers for name in names):
                continue
            name = next((n for n in names if n in from_adapter or n in base), None)
            if name is None:
                check.problem = f"{names[0]}: in the merged model but in neither {base_dir} nor {adapter_dir}"
                return check
            tensor = _rows(state[name])
            for start, stop in _row_slices(tensor):
                if name in from_adapter:
                    expected = _rows(from_adapter[name])[start:stop].to(tensor.device, tensor.dtype)
                else:
                    expected = base.rows(name, start, stop, tensor)
                wrong = tensor[start:stop] != expected
                # two decoders, exact both, rounding allowed: the float64 bound only where the values are not equal
                if base.decoded(name) and name not in from_adapter and wrong.any():
                    wrong = (tensor[start:stop].double() - expected.double()).abs() > rounding_bound(
                        expected.double(), expected.double(), tensor.dtype)
                if wrong.any():
                    differ = wrong.sum().item()
                    check.problem = (f"{name} differs from the base's in {differ} values, though no LoRA adapts it: "
                                     "the merge changed a weight it should have left")
                    return check
            check.unchanged += 1
    return check


def compare_logits(reference: torch.Tensor, other: torch.Tensor, mask: torch.Tensor | None = None) -> dict:
    """How far `other`'s logits [..., vocab] are from `reference`'s over the positions in `mask`: max and mean
    |difference|, the max relative to the largest |reference logit|, the mean relative to the mean |reference
    logit|, and how often the top-1 tokens agree."""
    ref, oth = reference.float(), other.float()
    if mask is not None:
        ref, oth = ref[mask.bool()], oth[mask.bool()]
    diff = (ref - oth).abs()
    largest = diff.max().item()
    return {"max_abs_logit_diff": largest, "mean_abs_logit_diff": diff.mean().item(),
            "relative_logit_diff": largest / ref.abs().max().item(),
            "mean_relative_logit_diff": diff.mean().item() / ref.abs().mean().item(),
            "top1_agreement": (ref.argmax(-1) == oth.argmax(-1)).float().mean().item()}
