"""Local data files: where they live and which suffixes are read (check_data, which validate and fetch apply), how
many rows one holds before any is read (local_rows, validate's bound on the split), and whether it is text alone."""
from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path

from lora_pipeline.data.formats import json_rows, media_refusal

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".tsv": "csv",
                 ".txt": "text"}
LOCAL_DIR = Path("data/local")  # local data files live here: the folder is a dependency of fetch


def check_data(data) -> None:
    """A local data file must exist under data/local/ with a supported suffix (checked by validate, and again here)."""
    if data.source == "local":
        path = Path(data.name)
        if not Path(os.path.abspath(path)).is_relative_to(os.path.abspath(LOCAL_DIR)):
            raise ValueError(f"data.name: local data files live under {LOCAL_DIR}/ (a dependency of fetch, so "
                             f"editing one re-runs it); move {path} there")
        if path.is_symlink() or any(parent.is_symlink() for parent in path.parents):
            target = path.resolve()
            if not target.is_relative_to(Path.cwd().resolve()):  # stages run at the repository's root
                raise ValueError(f"data.name: {path} is a link to {target}, outside the repository; copy the file "
                                 f"into {LOCAL_DIR}/")
        if not path.is_file():
            raise FileNotFoundError(f"data.name: local data file {path} does not exist")
        if path.suffix not in LOCAL_FORMATS:
            raise ValueError(f"data.name: {path} has suffix '{path.suffix}'; supported: {sorted(LOCAL_FORMATS)}")


def check_text_only(data) -> None:
    """A local data file holding image, audio or video data is refused by validate, naming the row and the field
    (fetch refuses it too, and a Hub data set's); a file check_data refuses is left to its message."""
    if data.source != "local":
        return
    try:
        check_data(data)
    except (ValueError, OSError):
        return
    for number, row in enumerate(local_objects(Path(data.name)) or [], 1):
        if isinstance(row, dict) and (refusal := media_refusal(row)):
            raise ValueError(f"data.name: {data.name} row {number}: {refusal}")


def local_rows(path: Path) -> int | None:
    """How many rows fetch will read from a local data file, before any is checked; None where it cannot be read
    (fetch then names why)."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq

            return pq.ParquetFile(path).metadata.num_rows
        except Exception:  # a damaged Parquet file: fetch's to report
            return None
    rows = local_objects(path)
    return None if rows is None else len(rows)


def local_objects(path: Path) -> list | None:
    """A local data file's rows as parsed, unchecked (a line that is not JSON: None in its place); None where the
    file cannot be read (fetch then names why). validate's view of a file: fetch reads it with lora_pipeline.data.sources."""
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path).to_pylist()
        text = path.read_bytes().decode("utf-8-sig")
        if path.suffix == ".txt":
            return [{"text": line} for _, line in text_lines(text)]
        if path.suffix in (".csv", ".tsv"):
            table = list(csv.reader(io.StringIO(text, newline=""), delimiter="\t" if path.suffix == ".tsv" else ","))
            return [dict(zip(table[0], cells)) for cells in table[1:] if cells]
        if path.suffix == ".json" and text.lstrip()[:1] in ("[", "{"):
            try:
                return json_rows(json.loads(text))
            except json.JSONDecodeError:
                if not text.lstrip().startswith("{"):
                    raise  # else JSON Lines in a .json file: read by lines below
        return [_json_or_none(line) for line in text.split("\n") if line.strip()]
    except Exception:  # not UTF-8, not JSON, a damaged Parquet file, a csv error: fetch's to report
        return None


def text_lines(text: str) -> list[tuple[int, str]]:
    """A .txt file's rows: (its 1-based line number, the line) for each line that is not blank, one document a line."""
    return [(number, line.removesuffix("\r")) for number, line in enumerate(text.split("\n"), 1) if line.strip()]


def _json_or_none(line: str):
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None
