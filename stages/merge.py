"""merge: fold the LoRA adapter into the full-precision base weights (merge_and_unload), safetensors to models/merged.

    python -m stages.merge
Checks the merged model weight by weight (lora_pipeline.merge.merged_checks): each adapted weight is the base's plus
PEFT's LoRA delta within one rounding to model.dtype, every other weight is the base's (metrics/merge.json: weights.*).
Beside it, reported and not gating, how far the merged model's logits are from the adapted model's on a few
held-out conversations: in a 16-bit mixture of experts a rounding can send a token to other experts, so they move
by chance. An adapter trained on a 4/8-bit base (QLoRA) is merged into the unquantized weights too; how far that
moves the logits from the trained model's is reported (trained_relative_logit_diff). With merge.save_format mxfp4
(auto, for an MXFP4 base such as openai/gpt-oss), where the adapter leaves the experts alone (no
lora.target_parameters), the merged checkpoint is the base's files with only the weights the adapter changed written
over them, in the base's dtype (lora_pipeline.merge.over_base): the experts, embeddings, norms and routers keep the
base's bytes, and all of it is verified exactly (mxfp4.*). A LoRA on the experts has them re-encoded to MXFP4 as the
base stores them; that saved model is read back into memory and its logits compared with the 16-bit merged model's.
How long each phase took goes to logs/merge_speed.json, no DVC output.
"""
import contextlib
import sys
import time
from pathlib import Path

import torch
from peft import PeftModel

from lora_pipeline.config import outputs
from lora_pipeline.config.outputs import read_jsonl, replace_dir, staging_dir, write_json
from lora_pipeline.config.params import load_params
from lora_pipeline.families.gpt_oss.mxfp4_checkpoint import (expert_values_changed, is_mxfp4_checkpoint, load_into,
                                                             merged_save_format, save_mxfp4_checkpoint)
from lora_pipeline.launch.stage_launch import seconds_since_launch
from lora_pipeline.merge.merged_checks import adapter_load_problem, check_merged_weights, compare_logits, lora_weights
from lora_pipeline.merge.over_base import (changed_weights, copy_problem, put_stored, save_over_base,
                                           verify_over_base)
from lora_pipeline.model.base_checks import BITSANDBYTES
from lora_pipeline.model.chat import as_text
from lora_pipeline.model.loading import device, inference_attention, load_model, load_tokenizer

BASE, ADAPTER, MERGED = Path("models/base"), Path("models/adapter"), Path("models/merged")
TEST, METRICS, SPEED = Path("data/split/test.jsonl"), outputs.METRICS["merge"], Path("logs/merge_speed.json")


class Phases:
    """Seconds each phase of the stage took, summed over its parts, the GPU's queued work included."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        started = time.perf_counter()
        yield
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started


def main():
    started, phases = time.perf_counter(), Phases()
    startup = seconds_since_launch()  # the launcher's and this interpreter's start, the imports
    params = load_params("merge")
    try:
        save_format = merged_save_format(params.merge.save_format, BASE)  # before any model is loaded
    except ValueError as exc:
        raise SystemExit(f"merge: {exc}") from None
    if not (ADAPTER / "adapter_model.safetensors").is_file():  # peft would fall back to a pickled adapter_model.bin
        sys.exit(f"merge: {ADAPTER}/adapter_model.safetensors not found; adapters are loaded from safetensors only")
    with phases("tokenizer"):
        tokenizer = load_tokenizer(BASE, trust_remote_code=params.model.trust_remote_code)
    # Loaded onto the GPU, where there is one: an MXFP4 base is dequantized there too (Mxfp4Config(dequantize=True):
    # every expert decoded to model.dtype), which the forward passes below need.
    with phases("load_base"):
        base = load_model(BASE, params.model, device_map={"": device()})
    attention, note = inference_attention(base.config.model_type, base.config._attn_implementation)
    if note:  # the logit comparison below needs no speed
        print(f"merge: {note}")
        base.set_attn_implementation(attention)
    with phases("load_adapter"):
        model = PeftModel.from_pretrained(base, ADAPTER).eval()
        problem = adapter_load_problem(model, ADAPTER)
        if problem:
            raise SystemExit(f"merge: {problem}")
        layers = lora_weights(model)
    experts_trained = bool(model.peft_config["default"].target_parameters)

    with phases("logits"):
        texts = [as_text(tokenizer, row) for row in read_jsonl(TEST)[:4]]
        batch = tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=128).to(model.device)
        with torch.no_grad():
            adapted = model(**batch).logits.float()
            with model.disable_adapter():
                base_logits = model(**batch).logits.float()
    with phases("merge_and_unload"), torch.no_grad():
        merged_model = model.merge_and_unload()
    with phases("logits"), torch.no_grad():
        merged = merged_model(**batch).logits.float()
    mask = batch["attention_mask"].bool()
    compared = compare_logits(adapted, merged, mask)
    metrics = {key: compared[key] for key in outputs.MERGE_LOGIT_FIGURES}
    metrics["adapter_relative_effect"] = compare_logits(adapted, base_logits, mask)["mean_relative_logit_diff"]
    with phases("weight_check"):
        checked = check_merged_weights(merged_model, layers, BASE, ADAPTER)
    if checked.problem:
        raise SystemExit(f"merge: {checked.problem} (logits, not gating: merged differ from adapted by "
                         f"{metrics['mean_relative_logit_diff']:.3g} of the mean |logit|, the base by "
                         f"{metrics['adapter_relative_effect']:.3g}; top-1 tokens agree at "
                         f"{metrics['top1_agreement']:.1%})")
    if checked.adapted and not checked.delta_above_rounding:
        print(f"merge: no value of the LoRA delta exceeds {params.model.dtype}'s rounding of its weight: the merged "
              "weights are the base's")
    metrics["weights"] = checked.figures()
    if params.quantization.method in BITSANDBYTES:  # the adapter over the 4/8-bit base it was trained on
        with phases("trained_logits"):
            trained = PeftModel.from_pretrained(load_model(BASE, params.model, params.quantization), ADAPTER).eval()
            with torch.no_grad():
                trained_logits = trained(**batch.to(trained.device)).logits.float().to(merged.device)
            metrics["trained_relative_logit_diff"] = compare_logits(trained_logits, merged,
                                                                    mask)["relative_logit_diff"]
            del trained

    staged = staging_dir(MERGED)
    written_as = "save_pretrained"
    if save_format == "mxfp4":
        changed = changed_weights(merged_model, layers, ADAPTER)
        why_not = copy_problem(changed, BASE) if is_mxfp4_checkpoint(BASE) else f"{BASE} stores no MXFP4 experts"
        if why_not is None:
            written_as = "over_base"
            metrics["mxfp4"] = save_mxfp4_over_base(merged_model, changed, staged, batch, merged, mask, phases)
        else:
            written_as = "re-encoded"
            print(f"merge: every expert re-encoded to MXFP4: {why_not}")
            metrics["mxfp4"] = save_mxfp4_reencoded(merged_model, staged, batch, merged, mask, phases,
                                                    experts_trained)
    else:
        with phases("save"):
            # A model loaded from MXFP4 with dequantize=True is saved as plain weights in model.dtype.
            merged_model.config.__dict__.pop("quantization_config", None)
            merged_model.save_pretrained(staged)
    with phases("tokenizer"):
        tokenizer.save_pretrained(staged)
    replace_dir(staged, MERGED)
    write_json(METRICS, metrics)
    write_json(SPEED, {"phase_seconds": phases.seconds, "total_seconds": time.perf_counter() - started,
                       "startup_seconds": startup, "save_format": save_format, "written_as": written_as,
                       "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                       "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0})
    print(f"merged ({save_format}, {written_as}) -> {MERGED}; {metrics}")


def save_mxfp4_over_base(merged_model, changed: dict, staged: Path, batch, merged, mask, phases: Phases) -> dict:
    """The base's files with the weights the adapter changed written over them (the experts keep the base's bytes),
    verified exactly; the figures of metrics/merge.json's `mxfp4`.

    The saved model is not loaded again: verify_over_base proves it holds the merged model's weights, so its logits
    are the merged model's, identical (the figures below are those of that identity; saved_logits_computed 0). Only
    where written weights were rounded to a narrower stored dtype (a float32 model over a bf16 base) are those
    weights, as stored, put into the merged model, the only difference, and its logits computed again."""
    with phases("save"):
        save_over_base(BASE, staged, changed)
    with phases("read_back_check"):
        try:
            written = verify_over_base(BASE, staged, changed)
        except ValueError as exc:
            raise SystemExit(f"merge: the checkpoint written over the base's is wrong: {exc}") from None
        saved = merged
        if written.rounded:
            put_stored(changed, staged, written.rounded)
            with torch.no_grad():
                saved = merged_model(**batch).logits.float()
    # expert_values_changed: the experts are among the copied tensors, the base's bytes, verified.
    return {**compare_logits(merged, saved, mask), "expert_values_changed": 0.0, "tensors_replaced": written.replaced,
            "tensors_copied": written.copied, "saved_logits_computed": int(bool(written.rounded))}


def save_mxfp4_reencoded(merged_model, staged: Path, batch, merged, mask, phases: Phases,
                         experts_trained: bool) -> dict:
    """Every expert re-encoded to MXFP4 (the LoRA changed some), the rest bf16; the saved model read back into memory
    and its logits compared with the 16-bit merged model's: the figures of metrics/merge.json's `mxfp4`."""
    with phases("save"):
        # min_error scales: a group whose largest weight the LoRA grew a little keeps its scale (see quantize_mxfp4).
        save_mxfp4_checkpoint(merged_model, staged, scale="min_error", device=device())
    with phases("read_back_check"):
        load_into(merged_model, staged, device=device())  # the model as saved, in place of the 16-bit one
        with torch.no_grad():
            saved = merged_model(**batch).logits.float()
        figures = compare_logits(merged, saved, mask)
        changed = expert_values_changed(staged, BASE, device=device())
    if changed is not None:
        figures["expert_values_changed"] = changed
        if experts_trained and changed == 0:
            print("merge: the LoRA on the experts changed no MXFP4 value: its deltas are below MXFP4's resolution, "
                  "so the saved experts are the base's; merge.save_format: model_dtype keeps them")
    return figures


if __name__ == "__main__":
    main()
