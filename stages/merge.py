"""merge: fold the LoRA adapter into the full-precision base weights (merge_and_unload), safetensors to models/merged.

    python -m stages.merge
Checks on a few held-out conversations that the merged model gives the adapted model's logits. An adapter trained
on a 4/8-bit base (QLoRA) is merged into the unquantized weights too; how far that moves the logits from the
trained model's is reported (metrics/merge.json: trained_relative_logit_diff).
"""
import sys
from pathlib import Path

import torch
from peft import PeftModel

from lora_pipeline.chat import conversation
from lora_pipeline.data import read_jsonl
from lora_pipeline.modeling import BITSANDBYTES, load_model, load_tokenizer
from lora_pipeline.outputs import replace_dir, staging_dir, write_json
from lora_pipeline.params import load_params

BASE, ADAPTER, MERGED = Path("models/base"), Path("models/adapter"), Path("models/merged")
TEST, METRICS = Path("data/split/test.jsonl"), Path("metrics/merge.json")
# Largest |merged - adapted| logit difference allowed, relative to the largest |logit|: merging changes
# only rounding, which is ~1e-7 in float32 and ~1e-3..1e-2 in 16-bit formats.
RELATIVE_TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-2}

params = load_params("merge")
if not (ADAPTER / "adapter_model.safetensors").is_file():  # peft would fall back to a pickled adapter_model.bin
    sys.exit(f"merge: {ADAPTER}/adapter_model.safetensors not found; adapters are loaded from safetensors only")
tokenizer = load_tokenizer(BASE, trust_remote_code=params.model.trust_remote_code)
model = PeftModel.from_pretrained(load_model(BASE, params.model), ADAPTER).eval()

texts = [tokenizer.apply_chat_template(conversation(row), tokenize=False) for row in read_jsonl(TEST)[:4]]
batch = tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=128).to(model.device)
with torch.no_grad():
    adapted = model(**batch).logits.float()
    merged_model = model.merge_and_unload()
    merged = merged_model(**batch).logits.float()
mask = batch["attention_mask"].bool()
max_diff = (adapted - merged).abs()[mask].max().item()
relative = max_diff / adapted.abs()[mask].max().item()
if relative > RELATIVE_TOLERANCE[params.model.dtype]:
    raise SystemExit(f"merged logits differ from the adapted model's by {max_diff:.3g} "
                     f"({relative:.3g} relative, tolerance {RELATIVE_TOLERANCE[params.model.dtype]})")
metrics = {"max_abs_logit_diff": max_diff, "relative_logit_diff": relative}
if params.quantization.method in BITSANDBYTES:  # the adapter over the 4/8-bit base it was trained on
    trained = PeftModel.from_pretrained(load_model(BASE, params.model, params.quantization), ADAPTER).eval()
    with torch.no_grad():
        trained_logits = trained(**batch.to(trained.device)).logits.float().to(merged.device)
    metrics["trained_relative_logit_diff"] = ((trained_logits - merged).abs()[mask].max() /
                                              trained_logits.abs()[mask].max()).item()
    del trained

staged = staging_dir(MERGED)
merged_model.save_pretrained(staged)
tokenizer.save_pretrained(staged)
replace_dir(staged, MERGED)
write_json(METRICS, metrics)
print(f"merged -> {MERGED}; {metrics}")
