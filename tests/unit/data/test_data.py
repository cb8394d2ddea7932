"""Reading data in every supported format, bad rows (dropped and counted, or named in the error), and the split."""
import csv
import io
import json
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ROOT
from lora_pipeline.data import builtin as builtin_data
from helpers import load_rows
from lora_pipeline.config.outputs import read_jsonl, write_jsonl
from lora_pipeline.config.params import Data
from lora_pipeline.data.rows import row_problem
from lora_pipeline.data.sources import DataError, SourceRow, clean_rows, read_local
from lora_pipeline.data.splitting import prompt_key, remove_test_prompts, split_rows

ROWS = builtin_data.generate(50, seed=1)
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def data_params(**changes) -> Data:
    """The data section as params.yaml ships it, with some keys changed."""
    return Data.model_validate({**yaml.safe_load((ROOT / "params.yaml").read_text())["data"], **changes})


def turn(role, content, thinking=None):
    return {"role": role, "content": content, "thinking": thinking}


def chat(*turns):
    return {"messages": list(turns)}


GOOD = [chat(turn("user", f"question {i}"), turn("assistant", f"answer {i}")) for i in range(3)]


def local(tmp_path, monkeypatch, name: str, content, bad_rows="fail", max_chars=20000, duplicates="drop") -> Data:
    """A file under data/local/ in a temporary working directory, and the data params that name it."""
    monkeypatch.chdir(tmp_path)
    path = Path("data/local") / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return data_params(source="local", name=str(path), bad_rows=bad_rows, max_chars=max_chars, duplicates=duplicates)


def jsonl(*rows) -> str:
    """JSON lines; a str item is written as the line itself (for lines that are not valid JSON)."""
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


# (the third row of a file between good rows, the reason it is dropped for, what the error names)
BAD_ROWS = {
    "no assistant turn": (chat(turn("system", "be brief"), turn("user", "hi")), "no_assistant_turn",
                          r"messages: no assistant turn"),
    "empty content": (chat(turn("user", "hi"), turn("assistant", "")), "empty_content",
                      r"messages\[1\]\.content: empty"),
    "all empty": (chat(turn("system", ""), turn("user", "  "), turn("assistant", "")), "empty_content",
                  r"messages\[1\]\.content: empty"),
    "two user turns": (chat(turn("user", "a"), turn("user", "b"), turn("assistant", "c")), "roles_out_of_order",
                       r"messages\[1\]\.role: 'user' follows 'user'"),
    "assistant first": (chat(turn("assistant", "a"), turn("user", "b"), turn("assistant", "c")),
                        "roles_out_of_order", r"messages\[0\]\.role: 'assistant' comes before any user turn"),
    "system after the start": (chat(turn("user", "a"), turn("system", "b"), turn("assistant", "c")),
                               "roles_out_of_order", r"messages\[1\]\.role: 'system' after the first user turn"),
    "ends with a user turn": (chat(turn("user", "a"), turn("assistant", "b"), turn("user", "c")),
                              "roles_out_of_order", r"messages\[2\]\.role: the conversation ends with 'user'"),
    "content is a number": (chat(turn("user", "a"), turn("assistant", 7)), "non_string_content",
                            r"messages\[1\]\.content: must be a string, got int"),
    "content has a refusal part": (chat(turn("user", "a"), turn("assistant", [{"type": "refusal", "refusal": "no"}])),
                                   "non_text_content",
                                   r"messages\[1\]\.content\[0\]\.type: 'refusal' is not a text part; only text parts "
                                   r"are read"),
    "text part without text": (chat(turn("user", [{"type": "text"}]), turn("assistant", "b")), "non_string_content",
                               r"messages\[0\]\.content\[0\]\.text: missing \(a text part holds its text under 'text', "
                               r"or 'value'\)"),
    "weight not 0 or 1": (chat(turn("user", "a"), {**turn("assistant", "b"), "weight": 2}), "bad_weight",
                          r"messages\[1\]\.weight: 2; a weight is 0 \(not trained\) or 1, on an assistant turn only"),
    "weight on a user turn": (chat({**turn("user", "a"), "weight": 1}, turn("assistant", "b")), "bad_weight",
                              r"messages\[0\]\.weight: 1 on a 'user' turn; a weight is 0"),
    "every assistant turn of weight 0": (chat(turn("user", "a"), {**turn("assistant", "b"), "weight": 0}),
                                         "no_trained_turn", r"messages: every assistant turn has weight 0, so no turn "
                                                            r"is left to train"),
    "thinking is a number": (chat(turn("user", "a"), turn("assistant", "b", thinking=1)), "non_string_content",
                             r"messages\[1\]\.thinking: must be a string or null, got int"),
    "unknown role": (chat(turn("bot", "a"), turn("assistant", "b")), "unknown_role",
                     r"messages\[0\]\.role: 'bot' is not one of"),
    "message not an object": ({"messages": ["hi", turn("assistant", "b")]}, "bad_message",
                              r"messages\[0\]: must be an object"),
    "no messages": ({"question": "a", "answer": "b"}, "not_a_conversation", r"messages: missing"),
    "empty messages": ({"messages": []}, "not_a_conversation", r"messages: must be a non-empty list"),
    "messages as plain text": ({"messages": "hello there"}, "messages_not_json",
                               r"messages: text that is not valid JSON"),
    "row not an object": ([1, 2], "not_a_conversation", r"row: must be an object with 'messages', got list"),
    "invalid JSON line": ('{"messages": [', "invalid_json", r"line 3: not valid JSON"),
    "too long": (chat(turn("user", "x" * 30), turn("assistant", "y" * 30)), "too_long",
                 r"messages: 60 characters of text, over data.max_chars 50"),
    "duplicate": (GOOD[0], "duplicate", r"messages: the same conversation as row 1"),
}


@pytest.mark.parametrize("kind", BAD_ROWS)
def test_bad_row_fails_naming_file_row_and_field(tmp_path, monkeypatch, kind):
    bad, _, fragment = BAD_ROWS[kind]
    data = local(tmp_path, monkeypatch, "mydata.jsonl", jsonl(GOOD[0], GOOD[1], bad, GOOD[2]), max_chars=50,
                 duplicates="fail")
    with pytest.raises(DataError, match=rf"^data/local/mydata\.jsonl row 3: {fragment}") as error:
        load_rows(data)
    # the way on: the params that change the outcome
    setting = "data.duplicates" if kind == "duplicate" else "data.bad_rows"
    assert str(error.value).endswith(f"{setting}: drop drops and counts such rows")
    assert ("raise data.max_chars (0: no limit)" in str(error.value)) == (kind == "too long")


@pytest.mark.parametrize("kind", BAD_ROWS)
def test_bad_row_is_dropped_and_counted(tmp_path, monkeypatch, kind):
    bad, reason, _ = BAD_ROWS[kind]
    data = local(tmp_path, monkeypatch, "mydata.jsonl", jsonl(GOOD[0], GOOD[1], bad, GOOD[2]), "drop", 50)
    rows, counts = load_rows(data)
    assert rows == GOOD
    assert counts == {"rows_in": 4, "rows_kept": 3, "dropped": {reason: 1}}


def test_row_and_line_differ_after_a_blank_line(tmp_path, monkeypatch):
    data = local(tmp_path, monkeypatch, "mydata.jsonl", jsonl(GOOD[0]) + "\n" + jsonl(GOOD[1], {"messages": []}))
    with pytest.raises(DataError, match=r"^data/local/mydata\.jsonl row 3 \(line 4\): messages:"):
        load_rows(data)


def test_every_reason_is_counted_and_max_chars_zero_has_no_limit(tmp_path, monkeypatch):
    bad = [row for row, _, _ in BAD_ROWS.values()]
    content = jsonl(*GOOD, *bad)
    rows, counts = load_rows(local(tmp_path, monkeypatch, "mydata.jsonl", content, "drop", 50))
    reasons = [reason for _, reason, _ in BAD_ROWS.values()]
    assert rows == GOOD and counts["rows_in"] == len(GOOD) + len(bad)
    assert counts["dropped"] == {r: reasons.count(r) for r in sorted(set(reasons))}
    _, unlimited = load_rows(local(tmp_path, monkeypatch, "mydata.jsonl", content, "drop", 0))
    assert "too_long" not in unlimited["dropped"]


def test_nothing_left_names_the_filters(tmp_path, monkeypatch):
    long_row = chat(turn("user", "x" * 30), turn("assistant", "y"))
    content = jsonl(chat(turn("user", "a")), chat(turn("user", "b")), long_row)
    with pytest.raises(DataError, match=r"^data/local/mydata\.jsonl: no usable rows left of 3; removed by "
                                        r"no_assistant_turn \(2\), too_long \(1\) \(data\.max_chars 20\); raise "
                                        r"data\.max_chars \(0: no limit\) or fix the rows$"):
        load_rows(local(tmp_path, monkeypatch, "mydata.jsonl", content, "drop", 20))


@pytest.mark.parametrize("bad_rows", ["fail", "drop"])
@pytest.mark.parametrize("name, content, fragment", [
    ("mydata.jsonl", b"", r"data/local/mydata\.jsonl: the file is empty"),
    ("mydata.csv", b" \n\n", r"data/local/mydata\.csv: the file is empty"),
    ("mydata.jsonl", jsonl(*GOOD[:2]).encode() + b'{"messages": "caf\xe9"}\n',
     r"data/local/mydata\.jsonl line 3: not valid UTF-8 \(byte 0xe9"),
    ("mydata.csv", b"question,answer\na,b\n", r"data/local/mydata\.csv line 1: the columns match no format "
                                            r"\(no column of any format\); "
                                            r"expected one of: messages \(messages\), .* \(columns: question, answer\)"),
    ("mydata.json", b'[\n{"messages": []},\n{"messages": [}\n]', r"data/local/mydata\.json line 3: not valid JSON"),
    ("mydata.json", b"[]", r"data/local/mydata\.json: has no rows"),
    ("mydata.tsv", b"messages\treasoning_language\n", r"data/local/mydata\.tsv: has no rows"),
    ("mydata.parquet", b"PAR1 not really", r"data/local/mydata\.parquet: cannot be read as Parquet"),
])
def test_unreadable_file_always_fails_naming_file_and_line(tmp_path, monkeypatch, bad_rows, name, content, fragment):
    with pytest.raises(DataError, match="^" + fragment):
        load_rows(local(tmp_path, monkeypatch, name, content, bad_rows))


def test_parquet_without_messages_column(tmp_path, monkeypatch):
    import pandas as pd

    data = local(tmp_path, monkeypatch, "mydata.parquet", b"").model_copy(update={"format": "messages"})
    pd.DataFrame([{"prompt": "a", "completion": "b"}]).to_parquet(data.name)
    with pytest.raises(DataError, match=r"^data/local/mydata\.parquet: no 'messages' column \(columns: prompt, comp"):
        load_rows(data)


def csv_text(rows: list[list[str]], delimiter=",") -> str:
    out = io.StringIO()
    csv.writer(out, delimiter=delimiter).writerows(rows)
    return out.getvalue()


def test_csv_bad_json_cell_and_wrong_cell_count(tmp_path, monkeypatch):
    cells = [["messages", "note"], [json.dumps(GOOD[0]["messages"]), "multi\nline"],
             ['[{"role": "user", "content": "a"', "x"], [json.dumps(GOOD[1]["messages"])]]
    data = local(tmp_path, monkeypatch, "mydata.csv", csv_text(cells))
    with pytest.raises(DataError, match=r"^data/local/mydata\.csv row 2 \(line 4\): messages: text that is not "
                                        r"valid JSON"):
        load_rows(data)
    rows, counts = load_rows(local(tmp_path, monkeypatch, "mydata.csv", csv_text(cells), "drop"))
    assert rows == [{**GOOD[0], "note": "multi\nline"}]
    assert counts["dropped"] == {"messages_not_json": 1, "wrong_column_count": 1}


def test_max_rows_cuts_before_the_checks(tmp_path, monkeypatch):
    data = local(tmp_path, monkeypatch, "mydata.jsonl", jsonl(*GOOD, {"messages": []}))
    rows, counts = load_rows(data.model_copy(update={"max_rows": 3}))
    assert rows == GOOD and counts["rows_in"] == 3


def test_hub_rows_are_checked_under_the_data_set_name(monkeypatch):
    import datasets

    hub_rows = [{"messages": json.dumps(GOOD[0]["messages"])}, {"messages": json.dumps([turn("user", "a")])}]
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.Dataset.from_list(hub_rows))
    data = data_params(source="hub", name="org/set", bad_rows="fail", max_chars=0)
    with pytest.raises(DataError, match=r"^org/set \(train\) row 2: messages: no assistant turn"):
        load_rows(data)
    assert load_rows(data.model_copy(update={"bad_rows": "drop"}))[0] == [GOOD[0]]


def test_builtin_rows_are_all_usable():
    rows, counts = load_rows(data_params(builtin_rows=300, bad_rows="fail", max_chars=20000))
    assert len(rows) == 300 and counts == {"rows_in": 300, "rows_kept": 300, "dropped": {}}


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".csv", ".tsv"])
def test_local_files_of_every_format(tmp_path, monkeypatch, suffix):
    import pandas as pd

    data = local(tmp_path, monkeypatch, f"data{suffix}", b"")
    frame = pd.DataFrame([{"messages": r["messages"], "reasoning_language": r["reasoning_language"]} for r in ROWS])
    if suffix in (".jsonl", ".json"):
        frame.to_json(data.name, orient="records", lines=suffix == ".jsonl", force_ascii=False)
    elif suffix == ".parquet":
        frame.to_parquet(data.name)
    else:  # text formats carry the conversation as JSON
        frame.assign(messages=frame.messages.map(lambda m: json.dumps(m, ensure_ascii=False))).to_csv(
            data.name, index=False, sep="\t" if suffix == ".tsv" else ",")
    rows, counts = load_rows(data)
    assert len(rows) == len(ROWS) and counts["dropped"] == {}
    assert rows[3]["messages"][2]["thinking"] == ROWS[3]["messages"][2]["thinking"]
    assert rows[3]["messages"][1]["content"] == ROWS[3]["messages"][1]["content"]


# --- properties over generated conversations ---

text = st.text(max_size=40)
words = text.filter(str.strip)
optional_thinking = st.none() | text


@st.composite
def conversations(draw) -> dict:
    """Usable conversations: system/developer messages first, then user/assistant pairs."""
    messages = [turn(role, draw(text)) for role in draw(st.lists(st.sampled_from(["system", "developer"]), max_size=2))]
    for _ in range(draw(st.integers(1, 3))):
        messages += [turn("user", draw(words)), turn("assistant", draw(words), draw(optional_thinking))]
    return {"messages": messages}


def turns_from(row):
    """Indices of the user and assistant turns."""
    return [i for i, m in enumerate(row["messages"]) if m["role"] in ("user", "assistant")]


MUTATIONS = {
    "no_assistant_turn": lambda row, i: [m for m in row["messages"] if m["role"] != "assistant"],
    "empty_content": lambda row, i: _replace(row, i, content=" \n"),
    "non_string_content": lambda row, i: _replace(row, i, content=None),
    "unknown_role": lambda row, i: _replace(row, i, role="bot"),
    "roles_out_of_order": lambda row, i: row["messages"][:i] + [row["messages"][i]] + row["messages"][i:],
}


def _replace(row, i, **fields):
    return row["messages"][:i] + [{**row["messages"][i], **fields}] + row["messages"][i + 1:]


@FAST
@given(conversations())
def test_generated_conversations_are_usable(row):
    assert row_problem(row) is None


@FAST
@given(conversations(), st.sampled_from(sorted(MUTATIONS)), st.data())
def test_each_kind_of_damage_is_found_and_named(row, reason, data):
    i = data.draw(st.sampled_from(turns_from(row)))
    damaged = {"messages": MUTATIONS[reason](row, i)}
    problem = row_problem(damaged)
    assert problem is not None and problem.reason == reason
    if reason != "no_assistant_turn":
        assert problem.detail.startswith("messages[")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("formats")


@FAST
@given(st.lists(conversations(), min_size=1, max_size=5), st.sampled_from([".jsonl", ".json", ".csv", ".tsv"]))
def test_usable_rows_survive_every_text_format(folder, rows, suffix):
    path = folder / f"rows{suffix}"
    if suffix == ".jsonl":
        write_jsonl(rows, path)
    elif suffix == ".json":
        path.write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
    else:
        cells = [["messages"]] + [[json.dumps(r["messages"], ensure_ascii=False)] for r in rows]
        path.write_text(csv_text(cells, "\t" if suffix == ".tsv" else ","), encoding="utf-8")
    read = [source_row.row for source_row in read_local(path, str(path))]
    assert read == rows


row_or_damage = st.one_of(conversations(), st.sampled_from([row for row, _, _ in BAD_ROWS.values()]))


@FAST
@given(st.lists(row_or_damage, min_size=1, max_size=12), st.integers(0, 200))
def test_dropping_accounts_for_every_row(rows, max_chars):
    source_rows = [SourceRow(i, row) for i, row in enumerate(rows, 1) if not isinstance(row, str)]
    if not source_rows:
        return
    try:
        kept, counts = clean_rows(source_rows, "rows.jsonl", "drop", max_chars)
    except DataError as exc:
        assert "no usable rows left" in str(exc) or "no row has a turn left to train" in str(exc)
        return
    assert counts["rows_in"] == len(source_rows) == counts["rows_kept"] + sum(counts["dropped"].values())
    assert all(row_problem(row) is None for row in kept)
    keys = [json.dumps(row["messages"], sort_keys=True) for row in kept]
    assert len(set(keys)) == len(keys)
    if counts["dropped"]:
        with pytest.raises(DataError, match=r"^rows\.jsonl row \d+: "):
            clean_rows(source_rows, "rows.jsonl", "fail", max_chars, duplicates="fail")
    if set(counts["dropped"]) == {"duplicate"}:  # duplicates alone are dropped whatever bad_rows says
        assert clean_rows(source_rows, "rows.jsonl", "fail", max_chars) == (kept, counts)


@FAST
@given(st.lists(conversations(), min_size=3, max_size=20), st.integers(0, 5))
def test_no_test_prompt_is_left_in_train(rows, seed):
    train, test = split_rows(rows, 0.5, seed)
    try:
        kept, removed = remove_test_prompts(train, test)
    except DataError:
        assert {prompt_key(r) for r in train} <= {prompt_key(r) for r in test}
        return
    assert removed == len(train) - len(kept)
    assert {prompt_key(r) for r in kept}.isdisjoint(prompt_key(r) for r in test)
    assert all(r in train for r in kept)


def test_train_rows_asking_a_test_question_are_removed():
    question = [turn("system", "reasoning language: German"), turn("user", "2+2?")]
    test = [chat(*question, turn("assistant", "4"))]
    train = [chat(*question, turn("assistant", "vier")), GOOD[0], chat(turn("user", "2+2?"), turn("assistant", "4"))]
    kept, removed = remove_test_prompts(train, test)
    assert removed == 1 and kept == train[1:]
    with pytest.raises(DataError, match="every one of 1 train rows"):
        remove_test_prompts(train[:1], test)


# --- the split ---

def test_split_is_seeded_disjoint_and_complete():
    train, test = split_rows(ROWS, 0.2, seed=42)
    assert len(test) == 10 and len(train) == 40
    assert split_rows(ROWS, 0.2, seed=42) == (train, test)
    assert split_rows(ROWS, 0.2, seed=43)[1] != test
    def key(row):
        return json.dumps(row, sort_keys=True)

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
