"""A benchmark's result as one JSON line: printed, and appended to a measurements/*.jsonl file when one is named."""
import json


def emit(row: dict, out: str | None) -> None:
    print(json.dumps(row), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
