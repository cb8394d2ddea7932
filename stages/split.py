"""split: a seeded train/test split to data/split; train rows that ask what a test row asks are removed.

    python -m stages.split
Rows were checked by fetch. Counts go to metrics/split.json.
"""
import sys
from pathlib import Path

from lora_pipeline.data import DataError, read_jsonl, remove_test_prompts, split_rows, write_jsonl
from lora_pipeline.outputs import write_json
from lora_pipeline.params import load_params

RAW, OUT, METRICS = Path("data/raw/data.jsonl"), Path("data/split"), Path("metrics/split.json")


def main():
    params = load_params("split")
    train, test = split_rows(read_jsonl(RAW), params.split.test_size, params.split.seed)
    try:
        train, removed = remove_test_prompts(train, test)
    except DataError as exc:
        sys.exit(f"split: {exc}")
    write_jsonl(train, OUT / "train.jsonl")
    write_jsonl(test, OUT / "test.jsonl")
    counts = {"train_rows": len(train), "test_rows": len(test), "train_test_duplicates_removed": removed}
    write_json(METRICS, counts)
    print(f"split: {len(train)} train, {len(test)} test rows -> {OUT}; {removed} train rows removed that ask what a test row asks")


if __name__ == "__main__":
    main()
