"""split: check every row's schema, then a seeded train/test split to data/split.

    python -m stages.split
"""
import json
from pathlib import Path

from lora_pipeline.chat import check_row
from lora_pipeline.data import read_jsonl, split_rows, write_jsonl
from lora_pipeline.params import load_params

RAW, OUT = Path("data/raw/data.jsonl"), Path("data/split")

params = load_params("split")
rows = read_jsonl(RAW)
for i, row in enumerate(rows):
    check_row(row, where=f"{RAW} row {i}")

train, test = split_rows(rows, params.split.test_size, params.split.seed)
write_jsonl(train, OUT / "train.jsonl")
write_jsonl(test, OUT / "test.jsonl")
(OUT / "summary.json").write_text(json.dumps({"train_rows": len(train), "test_rows": len(test)}, indent=2) + "\n")
print(f"split: {len(train)} train, {len(test)} test rows -> {OUT}")
