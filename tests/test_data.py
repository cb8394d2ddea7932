"""Reading local data files in every supported format, and the seeded split."""
import json

import pytest

from lora_pipeline import builtin_data
from lora_pipeline.data import load_rows, read_jsonl, split_rows, write_jsonl
from lora_pipeline.params import Data

ROWS = builtin_data.generate(50, seed=1)


def test_split_is_seeded_disjoint_and_complete():
    train, test = split_rows(ROWS, 0.2, seed=42)
    assert len(test) == 10 and len(train) == 40
    assert split_rows(ROWS, 0.2, seed=42) == (train, test)
    assert split_rows(ROWS, 0.2, seed=43)[1] != test
    key = lambda r: json.dumps(r, sort_keys=True)
    assert {key(r) for r in train}.isdisjoint(key(r) for r in test)
    assert sorted(map(key, train + test)) == sorted(map(key, ROWS))
    assert len(split_rows(ROWS, 7, seed=0)[1]) == 7  # a count from 1 up


@pytest.mark.parametrize("size", [0.001, 50, 60])
def test_split_refuses_an_empty_side(size):
    with pytest.raises(ValueError, match="split.test_size"):
        split_rows(ROWS, size, seed=0)


def test_jsonl_round_trip(tmp_path):
    write_jsonl(ROWS, tmp_path / "rows.jsonl")
    assert read_jsonl(tmp_path / "rows.jsonl") == ROWS


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".csv", ".tsv"])
def test_local_files_of_every_format(tmp_path, suffix):
    import pandas as pd

    frame = pd.DataFrame([{"messages": r["messages"], "reasoning_language": r["reasoning_language"]} for r in ROWS])
    path = tmp_path / f"data{suffix}"
    if suffix == ".jsonl":
        frame.to_json(path, orient="records", lines=True, force_ascii=False)
    elif suffix == ".parquet":
        frame.to_parquet(path)
    else:  # text formats carry the conversation as JSON
        frame.assign(messages=frame.messages.map(lambda m: json.dumps(m, ensure_ascii=False))).to_csv(
            path, index=False, sep="\t" if suffix == ".tsv" else ",")
    rows = load_rows(Data(source="local", name=str(path)))
    assert len(rows) == len(ROWS)
    assert rows[3]["messages"][2]["thinking"] == ROWS[3]["messages"][2]["thinking"]
    assert rows[3]["messages"][1]["content"] == ROWS[3]["messages"][1]["content"]
