"""Data set formats: each converts to messages rows, bad rows of each are named by their own fields (or dropped and
counted), mixed or unknown formats fail, and data.columns maps a format's fields to other column names."""
import csv
import io
import json
from pathlib import Path
from typing import get_args

import pytest
import yaml

from conftest import ROOT
from helpers import load_rows
from lora_pipeline.config.params import Data
from lora_pipeline.data.formats import FORMATS, FormatError, check_format
from lora_pipeline.data.sources import DataError, load_data


def data_params(**changes) -> Data:
    return Data.model_validate({**yaml.safe_load((ROOT / "params.yaml").read_text())["data"], **changes})


def local(tmp_path, monkeypatch, name: str, content: str, **changes) -> Data:
    """A file under data/local/ in a temporary working directory, and the data params that name it."""
    monkeypatch.chdir(tmp_path)
    path = Path("data/local") / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content, encoding="utf-8")
    return data_params(**{"source": "local", "name": str(path), "bad_rows": "fail", "max_chars": 0, **changes})


def jsonl(*rows) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def csv_text(rows: list[list[str]], delimiter=",") -> str:
    out = io.StringIO()
    csv.writer(out, delimiter=delimiter).writerows(rows)
    return out.getvalue()


def msg(role, content):
    return {"role": role, "content": content}


def qa(i: int) -> list[dict]:
    return [msg("user", f"question {i}"), msg("assistant", f"answer {i}")]


# A good row of each format (distinct per i), and the messages it becomes.
GOOD = {
    "messages": lambda i: ({"messages": qa(i)}, qa(i)),
    "prompt_completion": lambda i: ({"prompt": f"question {i}", "completion": f"answer {i}"}, qa(i)),
    "prompt_completion_conversational": lambda i: (
        {"prompt": [msg("system", "be brief"), msg("user", f"question {i}")],
         "completion": [msg("assistant", f"answer {i}")]},
        [msg("system", "be brief"), *qa(i)]),
    "sharegpt": lambda i: (
        {"id": i, "conversations": [{"from": "system", "value": "be brief"},
                                    {"from": "human", "value": f"question {i}"},
                                    {"from": "gpt", "value": f"answer {i}"},
                                    {"from": "user", "value": "and?"}, {"from": "assistant", "value": "done"}]},
        [msg("system", "be brief"), *qa(i), msg("user", "and?"), msg("assistant", "done")]),
    "alpaca": lambda i: ({"instruction": f"question {i}", "input": "", "output": f"answer {i}", "id": i}, qa(i)),
    "alpaca_input_system": lambda i: (
        {"instruction": f"question {i}", "input": "the data", "output": f"answer {i}", "system": "be brief"},
        [msg("system", "be brief"), msg("user", f"question {i}\n\nthe data"), msg("assistant", f"answer {i}")]),
}


def format_of(case: str) -> str:
    return next(name for name in FORMATS if case.startswith(name))


def good_rows(case: str, n=3) -> tuple[list[dict], list[dict]]:
    """(n good rows of a case, the messages rows they become)"""
    pairs = [GOOD[case](i) for i in range(n)]
    return [row for row, _ in pairs], [{"messages": messages} for _, messages in pairs]


@pytest.mark.parametrize("case", GOOD)
@pytest.mark.parametrize("data_format", ["auto", "named"])
def test_each_format_converts_to_messages(tmp_path, monkeypatch, case, data_format):
    rows, expected = good_rows(case)
    chosen = format_of(case) if data_format == "named" else "auto"
    data = local(tmp_path, monkeypatch, "rows.jsonl", jsonl(*rows), format=chosen)
    converted, counts, detected = load_data(data)
    assert converted == expected  # other columns (id) of converted formats are left out
    assert detected == format_of(case) and counts == {"rows_in": 3, "rows_kept": 3, "dropped": {}}


def test_messages_rows_keep_their_other_columns(tmp_path, monkeypatch):
    rows = [{"messages": qa(i), "reasoning_language": "German"} for i in range(2)]
    assert load_rows(local(tmp_path, monkeypatch, "rows.jsonl", jsonl(*rows)))[0] == rows


def test_builtin_rows_are_messages():
    _, _, detected = load_data(data_params(builtin_rows=20))
    assert detected == "messages"


# (the case whose good rows surround it, the bad third row, the reason it is dropped for, what the error names)
BAD = {
    "messages empty content": ("messages", {"messages": [msg("user", "a"), msg("assistant", "")]}, "empty_content",
                               r"messages\[1\]\.content: empty"),
    "prompt a number": ("prompt_completion", {"prompt": 7, "completion": "b"}, "not_a_conversation",
                        r"prompt: must be a string or a list of messages, got int"),
    "completion empty": ("prompt_completion", {"prompt": "a", "completion": " "}, "empty_content",
                         r"completion: empty"),
    "prompt text, completion list": ("prompt_completion", {"prompt": "a", "completion": [msg("assistant", "b")]},
                                     "not_a_conversation", r"completion: a list after a prompt that is a string"),
    "completion turn out of order": ("prompt_completion_conversational",
                                     {"prompt": [msg("user", "a")], "completion": [msg("assistant", "b")] * 2},
                                     "roles_out_of_order", r"completion\[1\]\.role: 'assistant' follows 'assistant'"),
    "prompt turn without content": ("prompt_completion_conversational",
                                    {"prompt": [{"role": "user"}], "completion": [msg("assistant", "b")]},
                                    "non_string_content", r"prompt\[0\]\.content: missing \(must be a string\)"),
    "sharegpt unknown from": ("sharegpt", {"conversations": [{"from": "human", "value": "a"},
                                                             {"from": "robot", "value": "b"}]},
                              "unknown_role", r"conversations\[1\]\.from: 'robot' is not one of \('human', 'gpt'"),
    "sharegpt value a number": ("sharegpt", {"conversations": [{"from": "human", "value": "a"},
                                                               {"from": "gpt", "value": 5}]},
                                "non_string_content", r"conversations\[1\]\.value: must be a string, got int"),
    "sharegpt two human turns": ("sharegpt", {"conversations": [{"from": "human", "value": "a"},
                                                                {"from": "human", "value": "b"},
                                                                {"from": "gpt", "value": "c"}]},
                                 "roles_out_of_order", r"conversations\[1\]\.from: 'user' follows 'user'"),
    "sharegpt no gpt turn": ("sharegpt", {"conversations": [{"from": "human", "value": "a"}]}, "no_assistant_turn",
                             r"conversations: no assistant turn"),
    "sharegpt turn not an object": ("sharegpt", {"conversations": ["a", {"from": "gpt", "value": "b"}]},
                                    "bad_message", r"conversations\[0\]: must be an object with from and value"),
    "sharegpt empty": ("sharegpt", {"conversations": []}, "not_a_conversation",
                       r"conversations: must be a non-empty list"),
    "sharegpt JSON text that does not parse": ("sharegpt", {"conversations": "[{"}, "conversations_not_json",
                                               r"conversations: text that is not valid JSON"),
    "alpaca without output": ("alpaca", {"instruction": "a", "input": "b"}, "not_a_conversation", r"output: missing"),
    "alpaca empty output": ("alpaca", {"instruction": "a", "output": ""}, "empty_content", r"output: empty"),
    "alpaca empty instruction": ("alpaca", {"instruction": " ", "input": "b", "output": "c"}, "empty_content",
                                 r"instruction: empty"),
    "alpaca input a number": ("alpaca", {"instruction": "a", "input": 3, "output": "c"}, "non_string_content",
                              r"input: must be a string or null, got int"),
    "alpaca duplicate": ("alpaca", GOOD["alpaca"](0)[0], "duplicate",
                         r"instruction, output: the same conversation as row 1"),
    "alpaca too long": ("alpaca", {"instruction": "a" * 30, "output": "b" * 30}, "too_long",
                        r"instruction, output: 60 characters of text, over data.max_chars 50"),
}


@pytest.mark.parametrize("kind", BAD)
def test_bad_row_fails_naming_file_row_and_source_field(tmp_path, monkeypatch, kind):
    case, bad, reason, fragment = BAD[kind]
    rows, _ = good_rows(case)
    data = local(tmp_path, monkeypatch, "rows.jsonl", jsonl(rows[0], rows[1], bad, rows[2]), max_chars=50,
                 duplicates="fail")
    with pytest.raises(DataError, match=rf"^data/local/rows\.jsonl row 3: {fragment}") as error:
        load_rows(data)
    setting = "data.duplicates" if reason == "duplicate" else "data.bad_rows"
    assert str(error.value).endswith(f"{setting}: drop drops and counts such rows")  # the way on


@pytest.mark.parametrize("kind", BAD)
def test_bad_row_is_dropped_and_counted(tmp_path, monkeypatch, kind):
    case, bad, reason, _ = BAD[kind]
    rows, expected = good_rows(case)
    data = local(tmp_path, monkeypatch, "rows.jsonl", jsonl(rows[0], rows[1], bad, rows[2]), bad_rows="drop",
                 max_chars=50)
    assert load_rows(data) == (expected, {"rows_in": 4, "rows_kept": 3, "dropped": {reason: 1}})


@pytest.mark.parametrize("bad_rows", ["fail", "drop"])
def test_a_file_of_mixed_formats_fails_whatever_bad_rows_says(tmp_path, monkeypatch, bad_rows):
    alpaca, _ = good_rows("alpaca")
    sharegpt, _ = good_rows("sharegpt")
    data = local(tmp_path, monkeypatch, "x.jsonl", jsonl(*alpaca[:2], sharegpt[0]), bad_rows=bad_rows)
    with pytest.raises(DataError, match=r"^data/local/x\.jsonl row 3: a sharegpt \(conversations\) row in a file "
                                        r"whose first row is alpaca \(instruction, output\)"):
        load_rows(data)
    named = local(tmp_path, monkeypatch, "x.jsonl", jsonl(*sharegpt), bad_rows=bad_rows, format="alpaca")
    with pytest.raises(DataError, match=r"^data/local/x\.jsonl row 1: a sharegpt \(conversations\) row where "
                                        r"data\.format is alpaca \(instruction, output\)"):
        load_rows(named)


def test_the_format_is_detected_from_the_first_object_row(tmp_path, monkeypatch):
    rows, expected = good_rows("sharegpt")
    text = "not JSON\n" + jsonl(*rows) + jsonl(*good_rows("messages")[0][:1])
    data = local(tmp_path, monkeypatch, "x.jsonl", text, bad_rows="drop")
    with pytest.raises(DataError, match=r"^data/local/x\.jsonl row 5: a messages \(messages\) row in a file whose "
                                        r"first row \(row 2\) is sharegpt"):
        load_rows(data)
    data = local(tmp_path, monkeypatch, "x.jsonl", "not JSON\n" + jsonl(*rows), bad_rows="drop")
    assert load_data(data) == (expected, {"rows_in": 4, "rows_kept": 3, "dropped": {"invalid_json": 1}}, "sharegpt")


@pytest.mark.parametrize("bad_rows", ["fail", "drop"])
def test_a_file_of_no_format_fails_naming_what_was_expected(tmp_path, monkeypatch, bad_rows):
    data = local(tmp_path, monkeypatch, "x.jsonl", jsonl({"question": "a", "answer": "b"}), bad_rows=bad_rows)
    with pytest.raises(DataError, match=r"^data/local/x\.jsonl row 1: matches no format \(no column of any format\); "
                                        r"expected one of: messages \(messages\), prompt_completion \(prompt, "
                                        r"completion\), sharegpt \(conversations\), alpaca \(instruction, output\), "
                                        r"text \(text\) \(columns: question, answer\); data\.columns maps a format's "
                                        r"fields to these columns"):
        load_rows(data)
    data = local(tmp_path, monkeypatch, "x.jsonl", jsonl({"instruction": "a", "answer": "b"}), bad_rows=bad_rows)
    with pytest.raises(DataError, match=r"^data/local/x\.jsonl row 1: matches no format \(alpaca lacks 'output'\); "
                                        r"expected one of: messages"):
        load_rows(data)
    table = local(tmp_path, monkeypatch, "x.csv", "question,answer\na,b\n", bad_rows=bad_rows)
    with pytest.raises(DataError, match=r"^data/local/x\.csv line 1: the columns match no format \(no column of any "
                                        r"format\); expected one of: messages \(messages\), .*text \(text\) "
                                        r"\(columns: "):
        load_rows(table)
    named = local(tmp_path, monkeypatch, "x.csv", "instruction,answer\na,b\n", bad_rows=bad_rows, format="alpaca")
    with pytest.raises(DataError, match=r"^data/local/x\.csv line 1: no 'output' column \(columns: instruction, "):
        load_rows(named)


def test_column_mapping_in_a_file(tmp_path, monkeypatch):
    columns = {"instruction": "question", "input": "context", "output": "answer"}
    rows = [{"question": f"q{i}", "context": "c" if i else None, "answer": f"a{i}"} for i in range(3)]
    data = local(tmp_path, monkeypatch, "x.jsonl", jsonl(*rows), columns=columns)
    converted, _, detected = load_data(data)
    assert detected == "alpaca"
    assert converted[0]["messages"] == [msg("user", "q0"), msg("assistant", "a0")]
    assert converted[1]["messages"][0] == msg("user", "q1\n\nc")
    bad = local(tmp_path, monkeypatch, "x.jsonl", jsonl(*rows, {"question": "q", "answer": 1}), columns=columns)
    with pytest.raises(DataError, match=r"^data/local/x\.jsonl row 4: answer: must be a string, got int"):
        load_rows(bad)
    unmapped = local(tmp_path, monkeypatch, "x.jsonl", jsonl(*rows), columns={"instruction": "question"})
    with pytest.raises(DataError, match=r"row 1: matches no format \(alpaca lacks 'output'\); .* alpaca \(question, "
                                        r"output\)"):
        load_rows(unmapped)
    dialogs = [{"dialog": [msg("user", f"q{i}"), msg("assistant", "")], "lang": "de"} for i in range(2)]
    renamed = local(tmp_path, monkeypatch, "x.jsonl", jsonl(*dialogs), columns={"messages": "dialog"})
    with pytest.raises(DataError, match=r"^data/local/x\.jsonl row 1: dialog\[1\]\.content: empty"):
        load_rows(renamed)
    dialogs[1]["dialog"][1]["content"] = "a"
    renamed = local(tmp_path, monkeypatch, "x.jsonl", jsonl(*dialogs), columns={"messages": "dialog"}, bad_rows="drop")
    kept, counts = load_rows(renamed)
    assert kept == [{"messages": dialogs[1]["dialog"], "lang": "de"}] and counts["dropped"] == {"empty_content": 1}


def test_column_mapping_in_a_csv_with_json_cells(tmp_path, monkeypatch):
    turns = [[{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": f"answer {i}"}] for i in range(2)]
    cells = [["dialog", "note"]] + [[json.dumps(t), "n"] for t in turns] + [["[{", "n"]]
    data = local(tmp_path, monkeypatch, "x.csv", csv_text(cells), columns={"conversations": "dialog"})
    with pytest.raises(DataError, match=r"^data/local/x\.csv row 3 \(line 4\): dialog: text that is not valid JSON"):
        load_rows(data)
    rows, counts, detected = load_data(data.model_copy(update={"bad_rows": "drop"}))
    assert rows == [{"messages": qa(i)} for i in range(2)] and detected == "sharegpt"
    assert counts["dropped"] == {"conversations_not_json": 1}

    prompt = json.dumps([msg("user", "question 0")])
    cells = [["ask", "say"], ["[1] plus [2]?", "3"], [prompt, json.dumps([msg("assistant", "answer 0")])]]
    columns = {"prompt": "ask", "completion": "say"}
    tsv = local(tmp_path, monkeypatch, "x.tsv", csv_text(cells, "\t"), columns=columns)
    assert load_data(tsv)[::2] == ([{"messages": [msg("user", "[1] plus [2]?"), msg("assistant", "3")]},
                                    {"messages": qa(0)}], "prompt_completion")


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".csv", ".tsv"])
def test_alpaca_in_every_file_type(tmp_path, monkeypatch, suffix):
    import pandas as pd

    rows, expected = good_rows("alpaca_input_system")
    data = local(tmp_path, monkeypatch, f"x{suffix}", "")
    frame = pd.DataFrame(rows)
    if suffix in (".jsonl", ".json"):
        frame.to_json(data.name, orient="records", lines=suffix == ".jsonl")
    elif suffix == ".parquet":
        frame.to_parquet(data.name)
    else:
        frame.to_csv(data.name, index=False, sep="\t" if suffix == ".tsv" else ",")
    assert load_data(data)[::2] == (expected, "alpaca")


def test_hub_rows_are_converted_and_named_by_their_fields(monkeypatch):
    import datasets

    rows, expected = good_rows("sharegpt", 2)
    bad = {"id": 9, "conversations": [{"from": "human", "value": "a"}, {"from": "robot", "value": "b"}]}
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.Dataset.from_list([rows[0], bad, rows[1]]))
    data = data_params(source="hub", name="org/set", bad_rows="fail", max_chars=0)
    with pytest.raises(DataError, match=r"^org/set \(train\) row 2: conversations\[1\]\.from: 'robot'") as error:
        load_rows(data)
    assert str(error.value).endswith("data.bad_rows: drop drops and counts such rows")
    assert load_data(data.model_copy(update={"bad_rows": "drop"}))[::2] == (expected, "sharegpt")
    with pytest.raises(DataError, match=r"^org/set \(train\): no 'instruction', 'output' columns \(columns: id, "):
        load_rows(data.model_copy(update={"format": "alpaca"}))


def test_params_name_the_formats_formats_py_reads():
    assert set(get_args(Data.model_fields["format"].annotation)) == {"auto", *FORMATS}


@pytest.mark.parametrize("changes, fragment", [
    ({"source": "local", "name": "data/local/x.jsonl", "format": "alpaca", "columns": {"answer": "a"}},
     r"data\.columns\.answer: not a field of format alpaca; allowed: \['instruction', 'output', 'input', 'system', "
     r"'history'\]"),
    ({"source": "hub", "name": "org/set", "columns": {"question": "q"}},
     r"data\.columns\.question: not a field of any format \(data\.format auto\); allowed: \['messages', 'tools', "
     r"'prompt'"),
    ({"format": "sharegpt"}, r"data\.format: sharegpt, but data\.source builtin yields messages rows"),
    ({"columns": {"messages": "dialog"}}, r"data\.columns: data\.source builtin has no columns to map"),
])
def test_format_params_that_cannot_apply(changes, fragment):
    with pytest.raises(FormatError, match=fragment):
        check_format(data_params(**changes))
    check_format(data_params(**{**changes, "columns": {}, "format": "auto"}))


# Preference rows as TRL's guide and LLaMA-Factory's demo files shape them, and the messages their chosen answer makes.
PREFERENCE = {
    "trl standard": lambda i: ({"prompt": f"question {i}", "chosen": f"answer {i}", "rejected": f"wrong {i}"}, qa(i)),
    "trl conversational": lambda i: ({"prompt": [msg("user", f"question {i}")],
                                      "chosen": [msg("assistant", f"answer {i}")],
                                      "rejected": [msg("assistant", f"wrong {i}")]}, qa(i)),
    "trl implicit prompt": lambda i: ({"chosen": qa(i), "rejected": [msg("user", f"question {i}"),
                                                                      msg("assistant", f"wrong {i}")]}, qa(i)),
    "llama-factory sharegpt": lambda i: ({"conversations": [{"from": "human", "value": f"question {i}"}],
                                          "chosen": {"from": "gpt", "value": f"answer {i}"},
                                          "rejected": {"from": "gpt", "value": f"wrong {i}"}}, qa(i)),
    "llama-factory alpaca": lambda i: ({"instruction": f"question {i}", "input": "", "chosen": f"answer {i}",
                                        "rejected": f"wrong {i}"}, qa(i)),
}


@pytest.mark.parametrize("case", PREFERENCE)
@pytest.mark.parametrize("bad_rows", ["fail", "drop"])
def test_paired_preference_rows_are_refused_naming_the_way_on(tmp_path, monkeypatch, case, bad_rows):
    rows = [PREFERENCE[case](i)[0] for i in range(3)]
    data = local(tmp_path, monkeypatch, "pairs.jsonl", jsonl(*rows), bad_rows=bad_rows)
    with pytest.raises(DataError) as error:
        load_rows(data)
    assert str(error.value) == ("data/local/pairs.jsonl row 1: preference data (chosen, rejected): SFT does not train "
                                "preferences; data.preference: chosen_only trains on the chosen answers only (or "
                                "train the preferences with TRL's DPOTrainer/KTOTrainer)")


@pytest.mark.parametrize("case", PREFERENCE)
def test_chosen_only_trains_the_chosen_answers(tmp_path, monkeypatch, case):
    pairs = [PREFERENCE[case](i) for i in range(3)]
    data = local(tmp_path, monkeypatch, "pairs.jsonl", jsonl(*[row for row, _ in pairs]), preference="chosen_only")
    rows, counts = load_rows(data)
    assert rows == [{"messages": messages} for _, messages in pairs]
    assert "wrong" not in json.dumps(rows) and counts["rows_kept"] == 3


def kto_rows(n: int, conversational: bool) -> list[dict]:
    """Unpaired preference rows (LLaMA-Factory's kto_en_demo: messages and a label; TRL: prompt, completion, label),
    every third answer marked bad."""
    rows = []
    for i in range(n):
        answer = f"answer {i}" if i % 3 else f"bad answer {i}"
        turns = {"messages": [msg("user", f"question {i}"), msg("assistant", answer)]} if conversational else \
            {"prompt": f"question {i}", "completion": answer}
        rows.append({**turns, "label": bool(i % 3)})
    return rows


@pytest.mark.parametrize("conversational", [True, False])
def test_a_label_false_answer_never_becomes_a_target(tmp_path, monkeypatch, conversational):
    rows = kto_rows(9, conversational)
    refused = local(tmp_path, monkeypatch, "kto.jsonl", jsonl(*rows), bad_rows="drop")
    with pytest.raises(DataError, match=r"^data/local/kto\.jsonl row 1: preference data \(label\): SFT does not train "
                                        r"preferences; data\.preference: chosen_only trains on the label: true answers "
                                        r"only"):
        load_rows(refused)
    for bad_rows in ("fail", "drop"):  # an answer marked bad is no bad row: it is counted, whatever bad_rows says
        data = local(tmp_path, monkeypatch, "kto.jsonl", jsonl(*rows), preference="chosen_only", bad_rows=bad_rows)
        kept, counts = load_rows(data)
        assert "bad answer" not in json.dumps(kept)
        assert [m["content"] for row in kept for m in row["messages"] if m["role"] == "assistant"] == \
            [r["messages"][1]["content"] if conversational else r["completion"] for r in rows if r["label"]]
        assert counts == {"rows_in": 9, "rows_kept": 6, "dropped": {"label_false": 3}}
    data = local(tmp_path, monkeypatch, "kto.jsonl", jsonl(*rows[:3], {**rows[3], "label": "yes"}),
                 preference="chosen_only")
    with pytest.raises(DataError, match=r"row 4: label: must be true or false, got 'yes'"):
        load_rows(data)


WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def tool_messages(i: int) -> list[dict]:
    """What a tool-calling row becomes: the call (arguments as JSON text), the tool's answer, the final answer."""
    return [msg("user", f"weather {i}?"), {"role": "assistant", "content": None, "tool_calls": [CALL]},
            msg("tool", '{"temp": 21}'), msg("assistant", f"21 degrees {i}")]


# Rows as their authors write them (TRL's guide, the OpenAI chat API, LLaMA-Factory's and axolotl's files), and
# the row each becomes.
AUTHORED = {
    "trl text": (lambda i: {"text": f"The sky is blue {i}."}, lambda i: {"text": f"The sky is blue {i}."}, "text"),
    "openai content parts": (
        lambda i: {"messages": [{"role": "user", "content": [{"type": "text", "text": f"question {i}"},
                                                             {"type": "text", "text": "please"}]},
                                {"role": "assistant", "content": [{"type": "text", "text": f"answer {i}"}]}]},
        lambda i: {"messages": [msg("user", f"question {i}\nplease"), msg("assistant", f"answer {i}")]}, "messages"),
    "openai tool calls": (
        lambda i: {"messages": [msg("user", f"weather {i}?"),
                                {"role": "assistant", "content": None,
                                 "tool_calls": [{"id": "call_1", "type": "function",
                                                 "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
                                msg("assistant", f"21 degrees {i}")],
                   "tools": [{"type": "function", "function": WEATHER}]},
        lambda i: {"messages": [tool_messages(i)[0], {**tool_messages(i)[1], "tool_calls": [{**CALL, "id": "call_1"}]},
                                {**tool_messages(i)[2], "tool_call_id": "call_1"}, tool_messages(i)[3]],
                   "tools": [{"type": "function", "function": WEATHER}]}, "messages"),
    "llama-factory sharegpt tools": (
        lambda i: {"conversations": [{"from": "human", "value": f"weather {i}?"},
                                     {"from": "function_call",
                                      "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
                                     {"from": "observation", "value": '{"temp": 21}'},
                                     {"from": "gpt", "value": f"21 degrees {i}"}],
                   "system": "be brief", "tools": json.dumps([WEATHER])},
        lambda i: {"messages": [msg("system", "be brief"), *tool_messages(i)],
                   "tools": [{"type": "function", "function": WEATHER}]}, "sharegpt"),
    "llama-factory alpaca history": (
        lambda i: {"instruction": f"question {i}", "input": "", "output": f"answer {i}", "system": "be brief",
                   "history": [["hello", "hi"], ["how are you?", "fine"]]},
        lambda i: {"messages": [msg("system", "be brief"), msg("user", "hello"), msg("assistant", "hi"),
                                msg("user", "how are you?"), msg("assistant", "fine"), *qa(i)]}, "alpaca"),
}


@pytest.mark.parametrize("case", AUTHORED)
def test_formats_are_read_as_their_authors_mean_them(tmp_path, monkeypatch, case):
    written, expected, data_format = AUTHORED[case]
    data = local(tmp_path, monkeypatch, "rows.jsonl", jsonl(*[written(i) for i in range(3)]))
    assert load_data(data) == ([expected(i) for i in range(3)], {"rows_in": 3, "rows_kept": 3, "dropped": {}},
                               data_format)


@pytest.mark.parametrize("shape", ["array", "one row", "a key holding the rows", "json lines"])
def test_a_json_file_holds_an_array_one_object_or_a_key_holding_the_rows(tmp_path, monkeypatch, shape):
    rows, expected = good_rows("sharegpt", 3)
    text = {"array": json.dumps(rows, indent=2), "one row": json.dumps(rows[0], indent=2),
            "a key holding the rows": json.dumps({"version": 1, "data": rows}, indent=2), "json lines": jsonl(*rows)}
    data = local(tmp_path, monkeypatch, "rows.json", text[shape])
    assert load_rows(data)[0] == (expected[:1] if shape == "one row" else expected)
    from lora_pipeline.data.local import local_rows

    assert local_rows(Path(data.name)) == (1 if shape == "one row" else 3)


@pytest.mark.parametrize("bad, fragment", [
    ({"messages": [msg("user", "a"), {"role": "assistant", "content": None}]},
     r"messages\[1\]\.content: must be a string, got NoneType"),
    ({"messages": [msg("user", "a"), {"role": "assistant", "content": None, "tool_calls": [CALL]},
                   msg("assistant", "b")]},
     r"messages\[2\]\.role: 'assistant' follows 'assistant'; an assistant turn that calls tools is followed by their "
     r"tool turns"),
    ({"messages": [msg("user", "a"), msg("tool", "b"), msg("assistant", "c")]},
     r"messages\[1\]\.role: 'tool' follows 'user'; user and assistant turns must alternate"),
    ({"messages": [msg("user", "a"), {"role": "assistant", "content": None, "tool_calls": [{"arguments": "{}"}]}]},
     r"messages\[1\]\.tool_calls: each call needs a function name"),
    ({"conversations": [{"from": "human", "value": "a"}, {"from": "function_call", "value": "get_weather("}]},
     r"conversations\[1\]\.value: a function_call must be JSON text"),
    ({"messages": qa(7), "tools": "[{"}, r"tools: text that is not valid JSON"),
])
def test_tool_calls_that_cannot_be_read_are_named(tmp_path, monkeypatch, bad, fragment):
    data = local(tmp_path, monkeypatch, "rows.jsonl", jsonl(bad))
    with pytest.raises(DataError, match=rf"^data/local/rows\.jsonl row 1: {fragment}"):
        load_rows(data)
