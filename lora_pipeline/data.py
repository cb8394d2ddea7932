"""Reading data sets from the built-in generator, the Hugging Face Hub or a local file, as plain rows."""
from __future__ import annotations

import json
from pathlib import Path

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".tsv": "csv"}


def load_rows(data_params) -> list[dict]:
    """All rows of the configured source, as dicts (messages as lists, whatever the file format)."""
    if data_params.source == "builtin":
        from lora_pipeline import builtin_data

        return builtin_data.generate(data_params.builtin_rows, data_params.builtin_seed)
    import datasets

    if data_params.source == "hub":
        dataset = datasets.load_dataset(data_params.name, revision=data_params.revision, split=data_params.hub_split)
    else:
        from lora_pipeline.checks import check_data

        check_data(data_params)
        path = Path(data_params.name)
        extra = {"delimiter": "\t"} if path.suffix == ".tsv" else {}
        dataset = datasets.load_dataset(LOCAL_FORMATS[path.suffix], data_files=str(path), split="train", **extra)
    rows = dataset.to_list()
    for row in rows:  # csv/tsv hold messages as JSON text
        if isinstance(row.get("messages"), str):
            row["messages"] = json.loads(row["messages"])
    return rows


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def split_rows(rows: list[dict], test_size: float, seed: int) -> tuple[list[dict], list[dict]]:
    """Shuffle with `seed`, then cut off the test part: a fraction if test_size < 1, else a row count."""
    import random

    n_test = round(len(rows) * test_size) if test_size < 1 else int(test_size)
    if not 1 <= n_test < len(rows):
        raise ValueError(f"split.test_size {test_size} leaves {n_test} test rows of {len(rows)}; "
                         "need at least one row on each side")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    test_idx = set(order[:n_test])
    train = [rows[i] for i in order if i not in test_idx]
    test = [rows[i] for i in order[:n_test]]
    return train, test
