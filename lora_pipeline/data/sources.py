"""Reading data sets (built-in, Hugging Face Hub, local files) as checked rows."""
from __future__ import annotations

import csv
import io
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from lora_pipeline.data.formats import Converter, FormatError, NOT_TARGETS, Rename, check_format, json_rows
from lora_pipeline.data.local import check_data, text_lines
from lora_pipeline.data.rows import DataError, Problem, conversation_chars, row_key, row_problem


@dataclass
class SourceRow:
    """One row as read, or the problem met reading it, with where it is in its source."""
    number: int  # 1-based among the source's rows
    row: dict | Problem
    line: int | None = None  # text files: the line the row starts on
    rename: Rename | None = None  # names a problem in the converted messages by the source's own fields

    def where(self, label: str) -> str:
        line = f" (line {self.line})" if self.line is not None and self.line != self.number else ""
        return f"{label} row {self.number}{line}"


def load_data(data_params) -> tuple[list[dict], dict, str]:
    """The usable rows of the configured source, what reading them found (rows in, kept, dropped per reason), and
    the format the rows were in (data.format, or the one detected from the first row)."""
    label, source_rows, data_format = read_source(data_params)
    if data_params.max_rows:
        source_rows = source_rows[: data_params.max_rows]
    return (*clean_rows(source_rows, label, data_params.bad_rows, data_params.max_chars, data_params.duplicates),
            data_format)


def read_source(data_params) -> tuple[str, list[SourceRow], str]:
    """(label naming the source in messages, its rows as messages rows, their format) for builtin, hub or local
    data."""
    if data_params.source == "builtin":  # generated as messages rows
        from lora_pipeline.data import builtin as builtin_data

        rows = builtin_data.generate(data_params.builtin_rows, data_params.builtin_seed)
        return "builtin data", [SourceRow(i, row) for i, row in enumerate(rows, 1)], "messages"
    try:
        check_format(data_params)
    except FormatError as exc:
        raise DataError(str(exc)) from None
    noun = "data set" if data_params.source == "hub" else "file"
    converter = Converter(data_params.format, data_params.columns, noun, data_params.preference)
    if data_params.source == "hub":
        import datasets

        from lora_pipeline.data.hub import unreachable_error

        try:
            dataset = datasets.load_dataset(data_params.name, revision=data_params.revision,
                                            split=data_params.hub_split)
        except Exception as exc:
            error = unreachable_error("data.name", data_params.name, data_params.revision, exc)
            if error is None:
                raise
            raise DataError(str(error)) from None
        label = f"{data_params.name} ({data_params.hub_split})"
        if problem := converter.header_problem(dataset.column_names):
            raise DataError(f"{label}: {problem}")
        rows = [SourceRow(i, row) for i, row in enumerate(dataset.to_list(), 1)]
        return label, as_messages(rows, label, converter), converter.format
    check_data(data_params)
    return data_params.name, read_local(Path(data_params.name), data_params.name, converter), converter.format


def read_local(path: Path, label: str, converter: Converter | None = None) -> list[SourceRow]:
    """Rows of a .jsonl/.json/.parquet/.csv/.tsv file as messages rows (of any format with the default converter), of
    a .txt file as text rows (one a line); a file that cannot be read at all, or whose rows are of no or of several
    formats, raises DataError."""
    converter = converter or Converter("auto", {})
    if path.suffix == ".parquet":
        rows = [SourceRow(i, row) for i, row in enumerate(_parquet_rows(path, label, converter), 1)]
    else:
        text = _utf8_text(path, label)
        if path.suffix == ".txt":
            rows = [SourceRow(i, {"text": line}, line_no)
                    for i, (line_no, line) in enumerate(text_lines(text), 1)]
        elif path.suffix in (".csv", ".tsv"):
            rows = _csv_rows(text, label, "\t" if path.suffix == ".tsv" else ",", converter)
        else:
            whole = _json_rows(text, label) if path.suffix == ".json" and text.lstrip()[:1] in ("[", "{") else None
            rows = _json_lines_rows(text) if whole is None else whole
    if not rows:
        raise DataError(f"{label}: has no rows")
    return as_messages(rows, label, converter, text_cells=path.suffix in (".csv", ".tsv"))


def as_messages(source_rows: list[SourceRow], label: str, converter: Converter,
                text_cells: bool = False) -> list[SourceRow]:
    """Each row turned into a messages row in place (or the Problem that makes it a bad row); rows of another format
    than the first's, or a first row of none, raise DataError whatever data.bad_rows says."""
    for source_row in source_rows:
        try:
            source_row.row, source_row.rename = converter.convert(source_row.number, source_row.row, text_cells)
        except FormatError as exc:
            raise DataError(f"{source_row.where(label)}: {exc}") from None
    return source_rows


def _utf8_text(path: Path, label: str) -> str:
    raw = path.read_bytes()
    if not raw.strip():
        raise DataError(f"{label}: the file is empty")
    try:
        return raw.decode("utf-8-sig")  # a byte-order mark (as spreadsheet programs write) is not data
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise DataError(f"{label} line {line}: not valid UTF-8 (byte {raw[exc.start]:#04x} at offset {exc.start}); "
                        "save the file as UTF-8") from None


def _json_lines_rows(text: str) -> list[SourceRow]:
    rows = []
    for line_no, line in enumerate(text.split("\n"), 1):  # not splitlines(): JSON text may hold U+2028 and the like
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            row = Problem("invalid_json", f"line {line_no}: not valid JSON ({exc.msg} at column {exc.colno})")
        except RecursionError:
            row = Problem("invalid_json", f"line {line_no}: JSON nested too deeply to read")
        rows.append(SourceRow(len(rows) + 1, row, line_no))
    return rows


def _json_rows(text: str, label: str) -> list[SourceRow] | None:
    """The rows of a .json file holding an array, or one object (a row, or a key holding the rows); None for JSON
    Lines in a .json file."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        if text.lstrip().startswith("{") and exc.msg == "Extra data":  # an object a line: JSON Lines
            return None
        raise DataError(f"{label} line {exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise DataError(f"{label}: JSON nested too deeply to read") from None
    return [SourceRow(i, row) for i, row in enumerate(json_rows(value), 1)]


def _csv_rows(text: str, label: str, delimiter: str, converter: Converter) -> list[SourceRow]:
    """CSV/TSV rows; list-valued columns (messages, conversations, prompt/completion) hold JSON text."""
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter)
    try:
        header = next(reader)
        if problem := converter.header_problem(header):
            raise DataError(f"{label} line 1: {problem}")
        rows, line = [], reader.line_num + 1
        for cells in reader:
            if cells:
                row = dict(zip(header, cells)) if len(cells) == len(header) else Problem(
                    "wrong_column_count", f"row: {len(cells)} cells for {len(header)} columns")
                rows.append(SourceRow(len(rows) + 1, row, line))
            line = reader.line_num + 1  # the next row starts after the lines this one spanned
    except csv.Error as exc:
        raise DataError(f"{label} line {reader.line_num}: {exc}") from None
    return rows


def _parquet_rows(path: Path, label: str, converter: Converter) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a damaged file
        raise DataError(f"{label}: cannot be read as Parquet ({exc})") from None
    if problem := converter.header_problem(table.column_names):
        raise DataError(f"{label}: {problem}")
    return table.to_pylist()


def clean_rows(source_rows: list[SourceRow], label: str, bad_rows: str, max_chars: int,
               duplicates: str = "drop") -> tuple[list[dict], dict]:
    """Usable rows, first copies only; a bad row raises DataError (bad_rows 'fail') or is dropped and counted, and so
    is an exact duplicate, as `duplicates` says."""
    kept, dropped, first_seen = [], Counter(), {}
    untrained = None  # bad_rows fail: the first row with no turn to train, raised unless no row has one
    for source_row in source_rows:
        problem = _problem(source_row, max_chars, first_seen)
        if problem and source_row.rename:
            problem = problem._replace(detail=source_row.rename(problem.detail))
        if problem is None:
            kept.append(source_row.row)
        elif problem.reason in NOT_TARGETS or (duplicates if problem.reason == "duplicate" else bad_rows) == "drop":
            dropped[problem.reason] += 1
        elif problem.reason == "no_trained_turn":  # a file of such rows alone is refused as a whole, below
            untrained = untrained or f"{source_row.where(label)}: {problem.detail}; {way_on(problem.reason)}"
            dropped[problem.reason] += 1
        else:
            raise DataError(untrained or f"{source_row.where(label)}: {problem.detail}; {way_on(problem.reason)}")
    if not kept and set(dropped) == {"no_trained_turn"}:
        raise DataError(f"{label}: no row has a turn left to train: every assistant turn of its {len(source_rows)} "
                        "rows has weight 0; weight 1 (or no weight) on an assistant turn trains it")
    if untrained:
        raise DataError(untrained)
    if not kept:
        filters = ", ".join(f"{reason} ({n})" for reason, n in dropped.most_common())
        limit = (f" (data.max_chars {max_chars}); raise data.max_chars (0: no limit) or fix the rows"
                 if "too_long" in dropped else "; fix the rows")
        raise DataError(f"{label}: no usable rows left of {len(source_rows)}; removed by {filters}{limit}")
    return kept, {"rows_in": len(source_rows), "rows_kept": len(kept), "dropped": dict(sorted(dropped.items()))}


def way_on(reason: str) -> str:
    """The params that change what a bad row of this reason does, for its message."""
    drop = "data.bad_rows: drop drops and counts such rows"
    if reason == "too_long":
        return f"raise data.max_chars (0: no limit), or {drop}"
    if reason == "duplicate":
        return "remove the row, or data.duplicates: drop drops and counts such rows"
    if reason == "no_trained_turn":
        return f"give an assistant turn weight 1 (or none), or {drop}"
    return f"fix the row, or {drop}"


def _problem(source_row: SourceRow, max_chars: int, first_seen: dict) -> Problem | None:
    """The schema problem, the length limit, then exact duplicates (the same messages as an earlier kept row)."""
    row = source_row.row
    if isinstance(row, Problem):
        return row
    problem = row_problem(row)
    if problem:
        return problem
    chars = conversation_chars(row)
    if max_chars and chars > max_chars:
        return Problem("too_long", f"{'messages' if 'messages' in row else 'text'}: {chars} characters of text, "
                                   f"over data.max_chars {max_chars}")
    key = row_key(row)
    if key in first_seen:
        return Problem("duplicate", f"{'messages' if 'messages' in row else 'text'}: the same conversation as row "
                                    f"{first_seen[key]}")
    first_seen[key] = source_row.number
    return None
