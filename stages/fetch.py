"""fetch: the data set's usable rows to data/raw (counts in metrics/data.json) and the base model to models/base.

    python -m stages.fetch
A bad row stops the stage with one line naming the file, row and field (data.bad_rows: fail), or is dropped and
counted per reason (drop).
"""
import shutil
import sys
from pathlib import Path

from lora_pipeline.checks import check_model
from lora_pipeline.data import DataError, load_rows, write_jsonl
from lora_pipeline.outputs import replace_dir, staging_dir, write_json
from lora_pipeline.params import load_params

RAW, BASE, METRICS = Path("data/raw"), Path("models/base"), Path("metrics/data.json")

params = load_params("fetch")
data, model = params.data, params.model

try:
    rows, counts = load_rows(data)
except DataError as exc:
    sys.exit(f"fetch: {exc}")
write_jsonl(rows, RAW / "data.jsonl")
source = {"source": data.source, "name": data.name, "revision": data.revision, "rows": len(rows)}
write_json(RAW / "source.json", source)
write_json(METRICS, counts)
dropped = ", ".join(f"{n} {reason}" for reason, n in counts["dropped"].items())
print(f"data: {len(rows)} rows from {data.source} {data.name} -> {RAW}" + (f" (dropped: {dropped})" if dropped else ""))

base = staging_dir(BASE)  # moved into place once complete: an interrupted download leaves no half a model
if model.source in ("tiny-qwen2", "tiny-gpt-oss"):
    from lora_pipeline.tiny_models import build_tiny

    losses = build_tiny(model.source, rows, model.tiny, base)
    if losses:
        print(f"tiny base pretrained {len(losses)} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
elif model.source == "hub":
    from huggingface_hub import snapshot_download

    # Weights as safetensors only; the original/ and metal/ folders of gpt-oss are other formats.
    snapshot_download(model.name, revision=model.revision, local_dir=base,
                      allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"],
                      ignore_patterns=["original/*", "metal/*"])
else:
    check_model(model)
    shutil.copytree(model.name, base, dirs_exist_ok=True)
replace_dir(base, BASE)
print(f"model: {model.source} {model.name} -> {BASE}")
