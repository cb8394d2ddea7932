"""split: a seeded train/test split to data/split; train rows that ask what a test row asks are removed.

    python -m stages.split
Rows were checked by fetch. Counts go to metrics/split.json. Data that cannot be split stops the stage with one line
naming the keys, before it writes anything: its outputs (persist in dvc.yaml) stay as they were.
"""
import sys
from pathlib import Path

from lora_pipeline.config.outputs import read_jsonl, write_json, write_jsonl
from lora_pipeline.config.params import load_params
from lora_pipeline.data.rows import DataError
from lora_pipeline.data.splitting import remove_test_prompts, split_problem, split_rows, too_few_rows

RAW, OUT, METRICS = Path("data/raw/data.jsonl"), Path("data/split"), Path("metrics/split.json")
KEPT = f"{OUT} and {METRICS} are as they were"


def main():
    params = load_params("split")
    rows = read_jsonl(RAW)
    if few := too_few_rows(len(rows), params.split.test_size):  # no split.test_size can help: more rows can
        sys.exit(f"split: data: {len(rows)} rows fetched into {RAW} (see metrics/data.json for those dropped); {few}: "
                 f"add rows; {KEPT}")
    if problem := split_problem(len(rows), params.split.test_size, f"{len(rows)} fetched into {RAW}"):
        sys.exit(f"split: {problem}; {KEPT}")
    train, test = split_rows(rows, params.split.test_size, params.split.seed)
    try:
        train, removed = remove_test_prompts(train, test)
    except DataError as exc:
        sys.exit(f"split: {exc}; {KEPT}")
    write_jsonl(train, OUT / "train.jsonl")
    write_jsonl(test, OUT / "test.jsonl")
    counts = {"train_rows": len(train), "test_rows": len(test), "train_test_duplicates_removed": removed}
    write_json(METRICS, counts)
    print(f"split: {len(train)} train, {len(test)} test rows -> {OUT}; {removed} train rows removed that ask what a test row asks")


if __name__ == "__main__":
    main()
