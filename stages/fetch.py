"""fetch: the data set to data/raw and the base model to models/base.

    python -m stages.fetch
"""
import json
import shutil
from pathlib import Path

from lora_pipeline.checks import check_model
from lora_pipeline.data import load_rows, write_jsonl
from lora_pipeline.params import load_params

RAW, BASE = Path("data/raw"), Path("models/base")

params = load_params("fetch")
data, model = params.data, params.model

rows = load_rows(data)
if data.max_rows:
    rows = rows[: data.max_rows]
write_jsonl(rows, RAW / "data.jsonl")
source = {"source": data.source, "name": data.name, "revision": data.revision, "rows": len(rows)}
(RAW / "source.json").write_text(json.dumps(source, indent=2) + "\n")
print(f"data: {len(rows)} rows from {data.source} {data.name} -> {RAW}")

if BASE.exists():
    shutil.rmtree(BASE)
if model.source in ("tiny-qwen2", "tiny-gpt-oss"):
    from lora_pipeline.tiny_models import build_tiny

    losses = build_tiny(model.source, rows, model.tiny, BASE)
    if losses:
        print(f"tiny base pretrained {len(losses)} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
elif model.source == "hub":
    from huggingface_hub import snapshot_download

    # Weights as safetensors only; the original/ and metal/ folders of gpt-oss are other formats.
    snapshot_download(model.name, revision=model.revision, local_dir=BASE,
                      allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"],
                      ignore_patterns=["original/*", "metal/*"])
else:
    check_model(model)
    shutil.copytree(model.name, BASE)
print(f"model: {model.source} {model.name} -> {BASE}")
