"""Data set formats (messages, TRL prompt/completion, ShareGPT, Alpaca, plain text): which one rows are in, and each
row as a messages row (a text row stays text), with problems named by the source's own fields; preference rows
(chosen/rejected, or a KTO label) are refused, or read for their chosen answers alone (data.preference)."""
from __future__ import annotations

import json
import re
from typing import Callable

from lora_pipeline.data.rows import Problem

# Each format's fields: those a row must have, then optional ones. data.columns maps them to a data set's columns.
FORMATS = {
    "messages": (("messages",), ("tools",)),
    "prompt_completion": (("prompt", "completion"), ("tools",)),
    "sharegpt": (("conversations",), ("system", "tools")),
    "alpaca": (("instruction", "output"), ("input", "system", "history")),
    "text": (("text",), ()),
}
# LLaMA-Factory's ShareGPT roles too: function_call (an assistant's tool call) and observation (the tool's answer)
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant",
                  "function_call": "assistant", "observation": "tool", "tool": "tool"}
# Preference data: paired (TRL, LLaMA-Factory's ranking sets) and unpaired (TRL, LLaMA-Factory's kto_tag)
PAIRED, UNPAIRED = ("chosen", "rejected"), "label"
# Rows that are not bad but are no target either: counted in metrics/data.json, never a reason to stop
NOT_TARGETS = {"label_false"}
JSON_TEXT_FIELDS = ("messages", "conversations")  # lists that csv cells and some Hub sets hold as JSON text
# Image, audio and video data: LLaMA-Factory's columns and the placeholders its text holds, the OpenAI API's parts
MEDIA_COLUMNS = ("images", "videos", "audios")
MEDIA_PARTS = ("image_url", "image", "input_image", "input_audio", "audio", "video", "video_url", "file", "input_file")
MEDIA_PLACEHOLDER = re.compile(r"<(image|video|audio)>")
MEDIA = "media"  # the reason of a Problem that refuses the whole data set, not just the row
MAX_DEPTH = 100  # lists and objects nested deeper are no conversation, and deeper than Python's json writes back
TOO_DEEP = Problem("not_a_conversation", f"row: lists and objects nested more than {MAX_DEPTH} levels deep")
TEXT_ONLY = "the pipeline trains text models, not image, audio or video ones: give it rows of text alone"
# A problem that rows.row_problem names by the converted messages: messages, messages[i], messages[i].key
_MESSAGES_FIELD = re.compile(r"^messages(?:\[(\d+)\])?(?:\.(\w+))?(?=: |\[)")

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

    def __init__(self, data_format: str, columns: dict[str, str], noun: str = "file", preference: str = "refuse"):
        self.chosen = data_format != "auto"
        self.format = data_format if self.chosen else None
        self.first = None  # the number of the row the format was detected from
        self.columns, self.noun, self.preference = columns, noun, preference

    def column(self, field: str) -> str:
        return self.columns.get(field, field)

    def describe(self, data_format: str) -> str:
        """e.g. alpaca (instruction, output): the format and the columns a row of it must have."""
        return f"{data_format} ({', '.join(self.column(f) for f in FORMATS[data_format][0])})"

    def formats_of(self, names) -> list[str]:
        """The formats whose every required column is among `names`, in FORMATS order."""
        return [name for name, (required, _) in FORMATS.items() if all(self.column(f) in names for f in required)]

    def missing(self, names) -> str:
        """The format a row of these columns comes closest to and the fields it lacks, e.g. "alpaca lacks 'output'"."""
        partial = [(sum(self.column(f) in names for f in required), name) for name, (required, _) in FORMATS.items()]
        found, name = max(partial, key=lambda pair: pair[0])
        if not found:
            return "no column of any format"
        lacking = [repr(self.column(f)) for f in FORMATS[name][0] if self.column(f) not in names]
        return f"{name} lacks {', '.join(lacking)}"

    def header_problem(self, names: list[str]) -> str | None:
        """What is wrong with a table's columns (csv, Parquet, Hub) for this format, or None."""
        listed = f"(columns: {', '.join(names)})"
        if not self.chosen:
            if self.formats_of(names) or preference_fields(names):
                return None
            return (f"the columns match no format ({self.missing(names)}); expected one of: {self.expected()} "
                    f"{listed}; {MAP_COLUMNS}")
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
        if _too_deep(row):
            return TOO_DEEP, None
        if refusal := media_refusal(row):
            raise FormatError(refusal)
        label = None
        if fields := preference_fields(row):
            if self.preference == "refuse":
                raise FormatError(preference_refusal(fields))
            if UNPAIRED in fields:
                label, row = row[UNPAIRED], {k: v for k, v in row.items() if k != UNPAIRED}
            else:
                row = chosen_row(row)
        matches = self.formats_of(row)
        if self.format is None:
            if not matches:
                raise FormatError(f"matches no format ({self.missing(row)}); expected one of: {self.expected()} "
                                  f"(columns: {', '.join(row)}); {MAP_COLUMNS}")
            self.format, self.first = matches[0], number
        elif self.format not in matches and matches:
            raise FormatError(f"a {self.describe(matches[0])} row {self._of_what()}")
        try:
            converted, rename = getattr(self, f"_{self.format}")(row, text_cells)
        except RecursionError:  # JSON text in a cell nested deeper than Python's json reads
            return TOO_DEEP, None
        if isinstance(converted, dict) and _too_deep(converted):  # JSON text in a cell, parsed
            return TOO_DEEP, None
        if isinstance(converted, dict) and "messages" in converted:
            problem = _normalize(converted)
            if problem:
                problem = problem._replace(detail=rename(problem.detail)) if rename else problem
                if problem.reason == MEDIA:
                    raise FormatError(problem.detail)
                return problem, None
        if label is not None and not isinstance(converted, Problem):
            if not isinstance(label, bool):
                return Problem("not_a_conversation", f"{UNPAIRED}: must be true or false, got {label!r:.40}"), None
            if not label:  # an answer marked bad: never a target
                return Problem("label_false", f"{UNPAIRED}: false (an answer marked bad)"), None
        return converted, rename

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

    def _tools(self, row: dict, out: dict) -> Problem | None:
        """The row's tools column into out["tools"] (a list of function schemas); a Problem if it is none."""
        column = self.column("tools")
        if row.get(column) in (None, "", []):
            return None
        tools = tool_schemas(row[column])
        if isinstance(tools, str):
            return Problem("bad_tools", f"{column}: {tools}")
        out["tools"] = tools
        return None

    def _messages(self, row: dict, text_cells: bool):
        column = self.column("messages")
        value = self._value(row, "messages", text_cells)
        if isinstance(value, Problem):
            return value, None
        if column in row and (column != "messages" or value is not row[column]):  # other columns kept, in order
            row = {("messages" if key == column else key): (value if key == column else v) for key, v in row.items()}
        tools_column = self.column("tools")
        if row.get(tools_column) not in (None, "", []):
            extra = {}
            if problem := self._tools(row, extra):
                return problem, None
            row = {("tools" if key == tools_column else key): (extra["tools"] if key == tools_column else v)
                   for key, v in row.items()}
        return row, None if column == "messages" else _renamer(lambda i, key: _indexed(column, i, key))

    def _sharegpt(self, row: dict, text_cells: bool):
        column = self.column("conversations")
        turns = self._value(row, "conversations", text_cells)
        if isinstance(turns, Problem):
            return turns, None
        if not isinstance(turns, list) or not turns:
            return Problem("not_a_conversation", f"{column}: must be a non-empty list of {{from, value}} objects, "
                                                 f"got {turns!r:.80}"), None
        system = row.get(self.column("system"))
        messages = [{"role": "system", "content": system}] if isinstance(system, str) and system.strip() else []
        offset = len(messages)
        for i, turn in enumerate(turns):
            if not isinstance(turn, dict):
                return Problem("bad_message", f"{column}[{i}]: must be an object with from and value, got "
                                              f"{type(turn).__name__}"), None
            if not isinstance(turn.get("from"), str) or turn["from"] not in SHAREGPT_ROLES:
                return Problem("unknown_role", f"{column}[{i}].from: {turn.get('from')!r} is not one of "
                                               f"{tuple(SHAREGPT_ROLES)}"), None
            if turn["from"] == "function_call":
                calls = function_calls(turn.get("value"))
                if isinstance(calls, str):
                    return Problem("bad_tool_call", f"{column}[{i}].value: {calls}"), None
                messages.append({"role": "assistant", "content": None, "tool_calls": calls})
            else:
                messages.append({"role": SHAREGPT_ROLES[turn["from"]], "content": turn.get("value")})
        out = {"messages": messages}
        if problem := self._tools(row, out):
            return problem, None
        keys = {"role": "from", "content": "value", "tool_calls": "value"}

        def field(i, key):
            if i is not None and i < offset:
                return self.column("system")
            return _indexed(column, None if i is None else i - offset, keys.get(key, key))

        return out, _renamer(field)

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
        out = {}
        if problem := self._tools(row, out):
            return problem, None
        if isinstance(prompt, str) and isinstance(completion, str):
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
            return {"messages": messages, **out}, _renamer(lambda i, key: whole if i is None else
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

        return {"messages": prompt + completion, **out}, _renamer(field)

    def _alpaca(self, row: dict, text_cells: bool):
        column = {field: self.column(field) for field in field_names("alpaca")}
        values = {field: row.get(name) for field, name in column.items()}
        for field in ("instruction", "output"):
            if column[field] not in row:
                return Problem("not_a_conversation", f"{column[field]}: missing"), None
        for field, value in values.items():
            if field == "history":
                continue
            optional = field in ("input", "system")
            if not isinstance(value, str) and not (optional and value is None):
                expected = "a string or null" if optional else "a string"
                return Problem("non_string_content", f"{column[field]}: must be {expected}, got "
                                                     f"{type(value).__name__}"), None
        if not values["instruction"].strip():
            return Problem("empty_content", f"{column['instruction']}: empty"), None
        history = values["history"] or []
        if not isinstance(history, list) or not all(isinstance(pair, (list, tuple)) and len(pair) == 2
                                                     and all(isinstance(t, str) for t in pair) for pair in history):
            return Problem("not_a_conversation", f"{column['history']}: must be a list of [instruction, response] "
                                                 f"pairs of strings, got {history!r:.80}"), None
        earlier = [{"role": role, "content": text} for pair in history for role, text in zip(("user", "assistant"),
                                                                                               pair)]
        user = values["instruction"] + (f"\n\n{values['input']}" if (values["input"] or "").strip() else "")
        system = [{"role": "system", "content": values["system"]}] if (values["system"] or "").strip() else []
        messages = system + earlier + [{"role": "user", "content": user},
                                       {"role": "assistant", "content": values["output"]}]
        sources = ([column["system"]] * len(system) + [column["history"]] * len(earlier)
                   + [column["instruction"], column["output"]])
        whole = f"{column['instruction']}, {column['output']}"
        return {"messages": messages}, _renamer(lambda i, key: whole if i is None else sources[i])

    def _text(self, row: dict, text_cells: bool):
        """TRL's language modeling rows: plain text, trained as it is (no chat template)."""
        column = self.column("text")
        value = row.get(column)
        if not isinstance(value, str):
            return Problem("non_string_content", f"{column}: must be a string, got {type(value).__name__}"), None
        if not value.strip():
            return Problem("empty_content", f"{column}: empty"), None
        return {"text": value}, None


def json_rows(value) -> list:
    """The rows a .json file holds: an array's items; an object that is a row (it has a format's or preference
    field) as one row; else the items of the one key that holds a list of objects (e.g. {"data": [...]})."""
    if isinstance(value, list):
        return value
    if not isinstance(value, dict):
        return [value]
    fields = {field for required, _ in FORMATS.values() for field in required} | {*PAIRED, UNPAIRED}
    lists = [v for v in value.values() if isinstance(v, list) and v and all(isinstance(r, dict) for r in v)]
    if fields.isdisjoint(value) and len(lists) == 1:
        return lists[0]
    return [value]


def preference_fields(names) -> list[str]:
    """The preference fields among a row's (or a table's) columns: chosen/rejected, or a KTO label."""
    return [f for f in PAIRED if f in names] or ([UNPAIRED] if UNPAIRED in names else [])


def preference_refusal(fields: list[str]) -> str:
    answers = "the label: true answers" if fields == [UNPAIRED] else "the chosen answers"
    return (f"preference data ({', '.join(fields)}): SFT does not train preferences; data.preference: chosen_only "
            f"trains on {answers} only (or train the preferences with TRL's DPOTrainer/KTOTrainer)")


def chosen_row(row: dict) -> dict:
    """A paired preference row as the row of its base format with the chosen answer as the answer (rejected
    dropped): TRL's prompt/chosen (strings or messages) or chosen alone (implicit prompt), LLaMA-Factory's ShareGPT
    conversations + a chosen {from, value}, its Alpaca instruction + a chosen string."""
    rest = {k: v for k, v in row.items() if k not in PAIRED}
    chosen = row.get("chosen")
    if "conversations" in rest and isinstance(rest["conversations"], list):
        return {**rest, "conversations": rest["conversations"] + (chosen if isinstance(chosen, list) else [chosen])}
    if "instruction" in rest:
        return {**rest, "output": chosen}
    if "prompt" in rest:
        return {**rest, "completion": chosen}
    if "messages" in rest and isinstance(rest["messages"], list) and isinstance(chosen, list):
        return {**rest, "messages": rest["messages"] + chosen}
    return {**rest, ("messages" if isinstance(chosen, list) else "text"): chosen}


def function_calls(value) -> list[dict] | str:
    """A ShareGPT function_call value (JSON text of {name, arguments}, or of a list of them) as OpenAI tool_calls;
    what is wrong with it as a string."""
    try:
        calls = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as exc:
        return f"a function_call must be JSON text of {{name, arguments}} ({exc.msg} at column {exc.colno})"
    calls = calls if isinstance(calls, list) else [calls]
    if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        return f"a function_call must be {{name, arguments}} objects, got {value!r:.80}"
    return [{"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}}
            for c in calls]


def tool_schemas(value) -> list[dict] | str:
    """A tools column (a list, or JSON text of one) as OpenAI function schemas {type: function, function: {...}}
    (LLaMA-Factory's bare {name, description, parameters} wrapped); what is wrong with it as a string."""
    try:
        tools = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as exc:
        return f"text that is not valid JSON ({exc.msg} at column {exc.colno})"
    if isinstance(tools, dict):
        tools = [tools]
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        return f"must be a list of function schemas, got {value!r:.80}"
    wrapped = [t if isinstance(t.get("function"), dict) else {"type": "function", "function": t} for t in tools]
    if not all(isinstance(t["function"].get("name"), str) for t in wrapped):
        return "every function schema needs a name"
    return wrapped


def media_refusal(row: dict) -> str | None:
    """Where a row as read holds image, audio or video data (a media column, a media content part, an <image>-style
    placeholder in its text) and why that refuses the data set; None for a row of text."""
    for column in MEDIA_COLUMNS:
        if row.get(column) not in (None, "", []):
            return f"{column}: a column of {column[:-1]} data; {TEXT_ONLY}"
    stack = [(value, str(key)) for key, value in reversed(row.items())]  # a stack, not recursion: any depth is read
    while stack:
        value, field = stack.pop()
        if isinstance(value, str):
            if found := MEDIA_PLACEHOLDER.search(value):
                return f"{field}: holds the placeholder <{found[1]}>, where {found[1]} data goes; {TEXT_ONLY}"
        elif isinstance(value, dict):
            if isinstance(value.get("type"), str) and value["type"] in MEDIA_PARTS:
                return f"{field}: a content part of type '{value['type']}'; {TEXT_ONLY}"
            stack += [(v, f"{field}.{k}") for k, v in reversed(value.items())]
        elif isinstance(value, list):
            stack += [(v, f"{field}[{j}]") for j, v in reversed(list(enumerate(value)))]
    return None


def _too_deep(row: dict) -> bool:
    stack = [(row, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            return True
        if isinstance(value, (dict, list)):
            stack += [(v, depth + 1) for v in (value.values() if isinstance(value, dict) else value)]
    return False


def _text_parts(content: list, field: str) -> str | Problem:
    """Content given as a list of parts: the text parts joined by a newline ({type: text, text} as the OpenAI API and
    TRL write them, {type: text, value} as LLaMA-Factory's v1 files do); a Problem naming the first other part."""
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            return Problem("non_text_content", f"{field}[{j}]: must be a {{type, text}} part, got "
                                               f"{type(part).__name__}")
        kind = part.get("type", "text")
        if kind == "text":
            key = "text" if "text" in part or "value" not in part else "value"
            if isinstance(part.get(key), str):
                texts.append(part[key])
                continue
            if key not in part:
                return Problem("non_string_content", f"{field}[{j}].text: missing (a text part holds its text under "
                                                     "'text', or 'value')")
            return Problem("non_string_content", f"{field}[{j}].{key}: must be a string, got "
                                                 f"{type(part[key]).__name__}")
        if isinstance(kind, str) and kind in MEDIA_PARTS:
            return Problem(MEDIA, f"{field}[{j}]: a content part of type '{kind}'; {TEXT_ONLY}")
        return Problem("non_text_content", f"{field}[{j}].type: {kind!r:.40} is not a text part; only text parts are "
                                           "read")
    return "\n".join(texts)


def _normalize(row: dict) -> Problem | None:
    """A messages row in place as the chat templates take it: content given as a list of text parts joined, a calling
    turn without content given a null one, each assistant tool call as {type: function, function: {name, arguments}}
    with its arguments as JSON text (and its id, if it has one), a weight 0 or 1 as an int (a null one left out)."""
    messages = row.get("messages")
    if not isinstance(messages, list):
        return None
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):
            content = _text_parts(content, f"messages[{i}].content")
            if isinstance(content, Problem):
                return content
            message["content"] = content
        if "weight" in message:
            weight = message["weight"]
            if weight is None:  # Arrow gives every message every key: null is no weight
                del message["weight"]
            elif not isinstance(weight, bool) and weight in (0, 1):
                message["weight"] = int(weight)
        calls = message.get("tool_calls")
        if calls is not None and "content" not in message:  # TRL's and OpenAI's calling turns have no content key
            messages[i] = message = {**{k: v for k, v in message.items() if k == "role"}, "content": None, **message}
        if calls is None:
            message.pop("tool_calls", None)
            continue
        if not isinstance(calls, list):
            return Problem("bad_tool_call", f"messages[{i}].tool_calls: must be a list, got {type(calls).__name__}")
        normalized = []
        for call in calls:
            function = call.get("function", call) if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                return Problem("bad_tool_call", f"messages[{i}].tool_calls: each call needs a function name, got "
                                                f"{call!r:.80}")
            arguments = function.get("arguments", {})
            entry = {"type": "function", "function": {
                "name": function["name"],
                "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)}}
            if isinstance(call, dict) and call.get("id") is not None:
                entry["id"] = str(call["id"])
            normalized.append(entry)
        message["tool_calls"] = normalized
    return None


def _indexed(column: str, i: int | None, key: str | None) -> str:
    """column, column[i] or column[i].key"""
    return column + (f"[{i}]" if i is not None else "") + (f".{key}" if key else "")


def _renamer(field: Callable[[int | None, str | None], str]) -> Rename:
    """What rewrites a problem's leading messages field (messages[2].content) as field(2, 'content') names it."""
    def rename(detail: str) -> str:
        return _MESSAGES_FIELD.sub(lambda m: field(int(m[1]) if m[1] else None, m[2]), detail, count=1)
    return rename
