"""Data set formats (messages, TRL prompt/completion, ShareGPT, Alpaca): which one rows are in, and each row as
a messages row, with problems named by the source's own fields."""
from __future__ import annotations

import json
import re
from typing import Callable

from lora_pipeline.rows import Problem

# Each format's fields: those a row must have, then optional ones. data.columns maps them to a data set's columns.
FORMATS = {
    "messages": (("messages",), ()),
    "prompt_completion": (("prompt", "completion"), ()),
    "sharegpt": (("conversations",), ()),
    "alpaca": (("instruction", "output"), ("input", "system")),
}
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant"}
JSON_TEXT_FIELDS = ("messages", "conversations")  # lists that csv cells and some Hub sets hold as JSON text
# A problem that rows.row_problem names by the converted messages: messages, messages[i], messages[i].key
_MESSAGES_FIELD = re.compile(r"^messages(?:\[(\d+)\])?(?:\.(\w+))?(?=: )")

Rename = Callable[[str], str]
MAP_COLUMNS = "data.columns maps a format's fields to these columns, e.g. {instruction: question, output: answer}"


class FormatError(ValueError):
    """Rows of more than one format, a first row of none, or a data.format / data.columns that cannot apply."""


def field_names(data_format: str) -> list[str]:
    """The fields data.columns may map for a data.format (auto: those of every format)."""
    names = FORMATS if data_format == "auto" else [data_format]
    return list(dict.fromkeys(field for name in names for part in FORMATS[name] for field in part))


def check_format(data) -> None:
    """data.columns keys must be fields of data.format; builtin data is messages rows with nothing to map."""
    allowed = field_names(data.format)
    of = "any format (data.format auto)" if data.format == "auto" else f"format {data.format}"
    problems = [f"data.columns.{key}: not a field of {of}; allowed: {allowed}" for key in data.columns
                if key not in allowed]
    if data.source == "builtin" and data.format not in ("auto", "messages"):
        problems.append(f"data.format: {data.format}, but data.source builtin yields messages rows; "
                        "allowed: auto, messages")
    if data.source == "builtin" and data.columns:
        problems.append("data.columns: data.source builtin has no columns to map; allowed: {}")
    if problems:
        raise FormatError("\n".join(problems))


class Converter:
    """Rows of one data set as messages rows: of data.format, or of the format the first row (an object) has."""

    def __init__(self, data_format: str, columns: dict[str, str], noun: str = "file"):
        self.chosen = data_format != "auto"
        self.format = data_format if self.chosen else None
        self.first = None  # the number of the row the format was detected from
        self.columns, self.noun = columns, noun

    def column(self, field: str) -> str:
        return self.columns.get(field, field)

    def describe(self, data_format: str) -> str:
        """e.g. alpaca (instruction, output): the format and the columns a row of it must have."""
        return f"{data_format} ({', '.join(self.column(f) for f in FORMATS[data_format][0])})"

    def formats_of(self, names) -> list[str]:
        """The formats whose every required column is among `names`, in FORMATS order."""
        return [name for name, (required, _) in FORMATS.items() if all(self.column(f) in names for f in required)]

    def header_problem(self, names: list[str]) -> str | None:
        """What is wrong with a table's columns (csv, Parquet, Hub) for this format, or None."""
        listed = f"(columns: {', '.join(names)})"
        if not self.chosen:
            if self.formats_of(names):
                return None
            return f"the columns match no format; expected one of: {self.expected()} {listed}; {MAP_COLUMNS}"
        missing = [self.column(f) for f in FORMATS[self.format][0] if self.column(f) not in names]
        if not missing:
            return None
        plural = "s" if len(missing) > 1 else ""
        return f"no {', '.join(repr(m) for m in missing)} column{plural} {listed}; {MAP_COLUMNS}"

    def expected(self) -> str:
        return ", ".join(self.describe(name) for name in FORMATS)

    def convert(self, number: int, row, text_cells: bool = False) -> tuple[dict | Problem, Rename | None]:
        """(the row as a messages row, or the Problem that makes it a bad row; what renames a problem found later in
        its messages to the source's fields). text_cells: a csv/tsv row, whose prompt/completion may be JSON text."""
        if not isinstance(row, dict):  # not an object, or a Problem met reading it: a bad row either way
            return row, None
        matches = self.formats_of(row)
        if self.format is None:
            if not matches:
                raise FormatError(f"matches no format; expected one of: {self.expected()} "
                                  f"(columns: {', '.join(row)}); {MAP_COLUMNS}")
            self.format, self.first = matches[0], number
        elif self.format not in matches and matches:
            raise FormatError(f"a {self.describe(matches[0])} row {self._of_what()}")
        return getattr(self, f"_{self.format}")(row, text_cells)

    def _of_what(self) -> str:
        if self.chosen:
            return f"where data.format is {self.describe(self.format)}"
        first = "first row" if self.first == 1 else f"first row (row {self.first})"
        return f"in a {self.noun} whose {first} is {self.describe(self.format)}; every row must be of one format"

    def _value(self, row: dict, field: str, text_cells: bool):
        """The field's value, JSON text parsed where it holds a list; a Problem for JSON text that does not parse."""
        column = self.column(field)
        value = row.get(column)
        if not isinstance(value, str):
            return value
        if field in JSON_TEXT_FIELDS:
            try:
                return json.loads(value)
            except json.JSONDecodeError as exc:
                return Problem(f"{field}_not_json", f"{column}: text that is not valid JSON ({exc.msg} at column "
                                                    f"{exc.colno}): {value!r:.60}")
        if text_cells and value.lstrip().startswith("["):  # a csv prompt/completion cell with a list of messages
            try:
                parsed = json.loads(value)
                return parsed if isinstance(parsed, list) else value
            except json.JSONDecodeError:
                return value  # plain text that starts with a bracket
        return value

    def _messages(self, row: dict, text_cells: bool):
        column = self.column("messages")
        value = self._value(row, "messages", text_cells)
        if isinstance(value, Problem):
            return value, None
        if column in row and (column != "messages" or value is not row[column]):  # other columns kept, in order
            row = {("messages" if key == column else key): (value if key == column else v) for key, v in row.items()}
        return row, None if column == "messages" else _renamer(lambda i, key: _indexed(column, i, key))

    def _sharegpt(self, row: dict, text_cells: bool):
        column = self.column("conversations")
        turns = self._value(row, "conversations", text_cells)
        if isinstance(turns, Problem):
            return turns, None
        if not isinstance(turns, list) or not turns:
            return Problem("not_a_conversation", f"{column}: must be a non-empty list of {{from, value}} objects, "
                                                 f"got {turns!r:.80}"), None
        messages = []
        for i, turn in enumerate(turns):
            if not isinstance(turn, dict):
                return Problem("bad_message", f"{column}[{i}]: must be an object with from and value, got "
                                              f"{type(turn).__name__}"), None
            if turn.get("from") not in SHAREGPT_ROLES:
                return Problem("unknown_role", f"{column}[{i}].from: {turn.get('from')!r} is not one of "
                                               f"{tuple(SHAREGPT_ROLES)}"), None
            messages.append({"role": SHAREGPT_ROLES[turn["from"]], "content": turn.get("value")})
        keys = {"role": "from", "content": "value"}
        return {"messages": messages}, _renamer(lambda i, key: _indexed(column, i, keys.get(key, key)))

    def _prompt_completion(self, row: dict, text_cells: bool):
        prompt_column, completion_column = self.column("prompt"), self.column("completion")
        prompt, completion = (self._value(row, field, text_cells) for field in ("prompt", "completion"))
        for column, value in ((prompt_column, prompt), (completion_column, completion)):
            if column not in row:
                return Problem("not_a_conversation", f"{column}: missing"), None
            if not isinstance(value, (str, list)):
                return Problem("not_a_conversation", f"{column}: must be a string or a list of messages, got "
                                                     f"{type(value).__name__}"), None
        whole = f"{prompt_column}, {completion_column}"
        if isinstance(prompt, str) and isinstance(completion, str):
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
            return {"messages": messages}, _renamer(lambda i, key: whole if i is None else
                                                    (prompt_column, completion_column)[i])
        if isinstance(prompt, str) or isinstance(completion, str):
            kinds = ["a string" if isinstance(v, str) else "a list" for v in (prompt, completion)]
            return Problem("not_a_conversation", f"{completion_column}: {kinds[1]} after a prompt that is {kinds[0]}; "
                                                 "both must be strings or both lists of messages"), None
        n = len(prompt)

        def field(i, key):
            if i is None:
                return whole
            return _indexed(prompt_column, i, key) if i < n else _indexed(completion_column, i - n, key)

        return {"messages": prompt + completion}, _renamer(field)

    def _alpaca(self, row: dict, text_cells: bool):
        column = {field: self.column(field) for field in field_names("alpaca")}
        values = {field: row.get(name) for field, name in column.items()}
        for field in ("instruction", "output"):
            if column[field] not in row:
                return Problem("not_a_conversation", f"{column[field]}: missing"), None
        for field, value in values.items():
            optional = field in ("input", "system")
            if not isinstance(value, str) and not (optional and value is None):
                expected = "a string or null" if optional else "a string"
                return Problem("non_string_content", f"{column[field]}: must be {expected}, got "
                                                     f"{type(value).__name__}"), None
        if not values["instruction"].strip():
            return Problem("empty_content", f"{column['instruction']}: empty"), None
        user = values["instruction"] + (f"\n\n{values['input']}" if (values["input"] or "").strip() else "")
        system = [{"role": "system", "content": values["system"]}] if (values["system"] or "").strip() else []
        messages = system + [{"role": "user", "content": user}, {"role": "assistant", "content": values["output"]}]
        sources = [column["system"]] * len(system) + [column["instruction"], column["output"]]
        whole = f"{column['instruction']}, {column['output']}"
        return {"messages": messages}, _renamer(lambda i, key: whole if i is None else sources[i])


def _indexed(column: str, i: int | None, key: str | None) -> str:
    """column, column[i] or column[i].key"""
    return column + (f"[{i}]" if i is not None else "") + (f".{key}" if key else "")


def _renamer(field: Callable[[int | None, str | None], str]) -> Rename:
    """What rewrites a problem's leading messages field (messages[2].content) as field(2, 'content') names it."""
    def rename(detail: str) -> str:
        return _MESSAGES_FIELD.sub(lambda m: field(int(m[1]) if m[1] else None, m[2]), detail, count=1)
    return rename
