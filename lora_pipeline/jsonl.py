"""JSON Lines files (one JSON object a line, UTF-8): the rows the data stages hand on, evaluate's transcripts."""
from __future__ import annotations

import json
from pathlib import Path

from lora_pipeline.outputs import write_text


def write_jsonl(rows: list[dict], path: Path) -> None:
    write_text(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
