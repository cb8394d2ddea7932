"""merge: fold the LoRA adapter into the full-precision base weights (merge_and_unload), safetensors to models/merged.

    python -m stages.merge
Checks the merged model weight by weight (lora_pipeline.merge.check): each adapted weight is the base's plus PEFT's
LoRA delta within one rounding to model.dtype, every other weight is the base's (metrics/merge.json: weights.*).
Beside it, reported and not gating, how far the merged model's logits are from the adapted model's on a few
held-out conversations: in a 16-bit mixture of experts a rounding can send a token to other experts, so they move
by chance. An adapter trained on a 4/8-bit base (QLoRA) is merged into the unquantized weights too; how far that
moves the logits from the trained model's is reported (trained_relative_logit_diff). With merge.save_format mxfp4
(auto, for an MXFP4 base such as openai/gpt-oss) the experts are re-encoded to MXFP4 as the base stores them; the
saved model is read back into memory and its logits compared with the 16-bit merged model's (mxfp4.*).
"""
import sys
from pathlib import Path

import torch
from peft import PeftModel

from lora_pipeline.config import outputs
from lora_pipeline.config.outputs import read_jsonl, replace_dir, staging_dir, write_json
from lora_pipeline.config.params import load_params
from lora_pipeline.merge.check import adapter_load_problem, check_merged_weights, compare_logits, lora_weights
from lora_pipeline.model.chat import as_text
from lora_pipeline.model.checks import BITSANDBYTES
from lora_pipeline.model.loading import device, inference_attention, load_model, load_tokenizer
from lora_pipeline.model.mxfp4_checkpoint import (expert_values_changed, load_into, merged_save_format,
                                                  save_mxfp4_checkpoint)

BASE, ADAPTER, MERGED = Path("models/base"), Path("models/adapter"), Path("models/merged")
TEST, METRICS = Path("data/split/test.jsonl"), outputs.METRICS["merge"]


def main():
    params = load_params("merge")
    try:
        save_format = merged_save_format(params.merge.save_format, BASE)  # before any model is loaded
    except ValueError as exc:
        raise SystemExit(f"merge: {exc}") from None
    if not (ADAPTER / "adapter_model.safetensors").is_file():  # peft would fall back to a pickled adapter_model.bin
        sys.exit(f"merge: {ADAPTER}/adapter_model.safetensors not found; adapters are loaded from safetensors only")
    tokenizer = load_tokenizer(BASE, trust_remote_code=params.model.trust_remote_code)
    # Loaded onto the GPU, where there is one: an MXFP4 base is dequantized there too.
    base = load_model(BASE, params.model, device_map={"": device()})
    attention, note = inference_attention(base.config.model_type, base.config._attn_implementation)
    if note:  # the logit comparison below needs no speed
        print(f"merge: {note}")
        base.set_attn_implementation(attention)
    model = PeftModel.from_pretrained(base, ADAPTER).eval()
    problem = adapter_load_problem(model, ADAPTER)
    if problem:
        raise SystemExit(f"merge: {problem}")
    layers = lora_weights(model)
    experts_trained = bool(model.peft_config["default"].target_parameters)

    texts = [as_text(tokenizer, row) for row in read_jsonl(TEST)[:4]]
    batch = tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=128).to(model.device)
    with torch.no_grad():
        adapted = model(**batch).logits.float()
        with model.disable_adapter():
            base_logits = model(**batch).logits.float()
        merged_model = model.merge_and_unload()
        merged = merged_model(**batch).logits.float()
    mask = batch["attention_mask"].bool()
    compared = compare_logits(adapted, merged, mask)
    metrics = {key: compared[key] for key in outputs.MERGE_LOGIT_FIGURES}
    metrics["adapter_relative_effect"] = compare_logits(adapted, base_logits, mask)["mean_relative_logit_diff"]
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
        trained = PeftModel.from_pretrained(load_model(BASE, params.model, params.quantization), ADAPTER).eval()
        with torch.no_grad():
            trained_logits = trained(**batch.to(trained.device)).logits.float().to(merged.device)
        metrics["trained_relative_logit_diff"] = compare_logits(trained_logits, merged, mask)["relative_logit_diff"]
        del trained

    staged = staging_dir(MERGED)
    if save_format == "mxfp4":
        # min_error scales: a group whose largest weight the LoRA grew a little keeps its scale (see quantize_mxfp4).
        save_mxfp4_checkpoint(merged_model, staged, scale="min_error", device=device())
        load_into(merged_model, staged, device=device())  # the model as saved, in place of the 16-bit one
        with torch.no_grad():
            saved = merged_model(**batch).logits.float()
        metrics["mxfp4"] = compare_logits(merged, saved, mask)
        changed = expert_values_changed(staged, BASE, device=device())
        if changed is not None:
            metrics["mxfp4"]["expert_values_changed"] = changed
            if experts_trained and changed == 0:
                print("merge: the LoRA on the experts changed no MXFP4 value: its deltas are below MXFP4's resolution, "
                      "so the saved experts are the base's; merge.save_format: model_dtype keeps them")
    else:
        # A model loaded from MXFP4 with dequantize=True is saved as plain weights in model.dtype.
        merged_model.config.__dict__.pop("quantization_config", None)
        merged_model.save_pretrained(staged)
    tokenizer.save_pretrained(staged)
    replace_dir(staged, MERGED)
    write_json(METRICS, metrics)
    print(f"merged ({save_format}) -> {MERGED}; {metrics}")


if __name__ == "__main__":
    main()
