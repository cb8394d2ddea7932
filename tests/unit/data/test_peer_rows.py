"""Rows as other tools write them: tool calls, per-turn weights, media, v1 parts, .txt files, duplicates, sizes."""
import csv
import io
import json
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ROOT
from helpers import load_rows
from lora_pipeline.config.params import Data, Split
from lora_pipeline.data.formats import Converter
from lora_pipeline.data.local import check_text_only, local_rows
from lora_pipeline.data.rows import messages_key, row_key
from lora_pipeline.data.sources import DataError, clean_rows, load_data, read_local
from lora_pipeline.data.splitting import (MIN_TEST_ROWS, prompt_key, remove_test_prompts, rows_needed, split_problem,
                                          split_rows)
from lora_pipeline.validation.all_checks import check_split


def data_params(**changes) -> Data:
    return Data.model_validate({**yaml.safe_load((ROOT / "params.yaml").read_text())["data"], **changes})


def local(tmp_path, monkeypatch, name: str, content, **changes) -> Data:
    """A file under data/local/ in a temporary working directory, and the data params that name it."""
    monkeypatch.chdir(tmp_path)
    path = Path("data/local") / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return data_params(**{"source": "local", "name": str(path), "bad_rows": "fail", "max_chars": 0, **changes})


def jsonl(*rows) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def msg(role, content, **more):
    return {"role": role, "content": content, **more}


def qa(i: int) -> list[dict]:
    return [msg("user", f"question {i}"), msg("assistant", f"answer {i}")]


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}


# --- tool calls as TRL's dataset_formats.md and OpenAI's function-calling fine-tuning guide write them ---

def trl_tool_row(i: int) -> dict:
    """The calling turn has no content key; the call an id and its arguments an object (JSON text for odd i); the
    tool turn a tool_call_id and a name."""
    arguments = {"city": f"city {i}"}
    return {"messages": [
        msg("user", f"Weather in city {i}?"),
        {"role": "assistant", "tool_calls": [{"id": f"call_{i}", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps(arguments) if i % 2 else arguments}}]},
        {"role": "tool", "tool_call_id": f"call_{i}", "name": "get_weather", "content": f"{i} degrees"},
        msg("assistant", f"It is {i} degrees.")], "tools": [WEATHER]}


def test_tool_calls_without_content_are_read_with_their_ids_and_names(tmp_path, monkeypatch):
    rows = [trl_tool_row(i) for i in range(3)]
    read, counts, data_format = load_data(local(tmp_path, monkeypatch, "tools.jsonl", jsonl(*rows)))
    assert data_format == "messages" and counts == {"rows_in": 3, "rows_kept": 3, "dropped": {}}
    for i, row in enumerate(read):
        call = row["messages"][1]
        assert call == {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": f"city {i}"})},
             "id": f"call_{i}"}]}
        assert row["messages"][2] == rows[i]["messages"][2] and row["tools"] == [WEATHER]
    assert len({row_key(row) for row in read}) == 3


def test_openai_function_calling_rows_end_with_the_call(tmp_path, monkeypatch):
    """OpenAI's guide: the last assistant turn calls a function (no content key), parallel_tool_calls a column."""
    rows = [{"messages": [msg("user", f"Weather in city {i}?"),
                          {"role": "assistant", "tool_calls": [{"id": "call_id", "type": "function", "function": {
                              "name": "get_weather", "arguments": json.dumps({"city": f"city {i}"})}}]}],
             "parallel_tool_calls": False, "tools": [WEATHER]} for i in range(2)]
    read, counts = load_rows(local(tmp_path, monkeypatch, "fc.jsonl", jsonl(*rows)))
    assert counts["rows_kept"] == 2 and read[0]["parallel_tool_calls"] is False
    assert read[0]["messages"][1]["content"] is None and read[0]["messages"][1]["tool_calls"][0]["id"] == "call_id"


@pytest.mark.parametrize("bad, reason, fragment", [
    ({"messages": [msg("user", "a"), {"role": "assistant"}]}, "non_string_content",
     r"messages\[1\]\.content: missing \(must be a string\)"),
    ({"messages": [{"role": "user"}, msg("assistant", "b")]}, "non_string_content",
     r"messages\[0\]\.content: missing \(must be a string\)"),
    ({"messages": [msg("user", "a"), {"role": "assistant", "tool_calls": []}]}, "bad_tool_call",
     r"messages\[1\]\.tool_calls: a non-empty list"),
    ({"messages": [msg("user", "a"), {"role": "assistant", "tool_calls": [{"id": 1}]}]}, "bad_tool_call",
     r"messages\[1\]\.tool_calls: each call needs a function name"),
    ({"messages": [msg("user", "a"), {"role": "tool"}, msg("assistant", "b")]}, "non_string_content",
     r"messages\[1\]\.content: missing"),
])
def test_turns_without_content_that_cannot_be_read_are_bad_rows(tmp_path, monkeypatch, bad, reason, fragment):
    content = jsonl({"messages": qa(0)}, bad, {"messages": qa(1)})
    with pytest.raises(DataError, match=rf"^data/local/x\.jsonl row 2: {fragment}"):
        load_rows(local(tmp_path, monkeypatch, "x.jsonl", content))
    assert load_rows(local(tmp_path, monkeypatch, "x.jsonl", content, bad_rows="drop"))[1]["dropped"] == {reason: 1}


# --- OpenAI's per-turn weight ---

def weighted(i: int, first: int = 0, second: int | None = 1) -> dict:
    second_turn = msg("assistant", f"second {i}", **({} if second is None else {"weight": second}))
    return {"messages": [msg("system", "Be sarcastic."), msg("user", f"question {i}"),
                         msg("assistant", f"first {i}", weight=first), msg("user", f"again {i}"), second_turn]}


def test_weights_are_kept_on_the_assistant_turns_through_fetch_and_split(tmp_path, monkeypatch):
    rows = [weighted(i, first=i % 2, second=None if i % 3 else 1) for i in range(12)]
    read, counts = load_rows(local(tmp_path, monkeypatch, "w.jsonl", jsonl(*rows)))
    assert read == rows and counts["dropped"] == {}
    train, test = split_rows(read, 4, seed=0)
    kept, _ = remove_test_prompts(train, test)
    assert all(row in rows for row in kept + test)
    assert [m.get("weight") for m in read[4]["messages"]] == [None, None, 0, None, None]
    # what a row asks is the same whatever weight its earlier answers have; two rows of other weights are no duplicates
    assert prompt_key(weighted(0, first=0)) == prompt_key(weighted(0, first=1))
    assert messages_key(weighted(0, first=0)["messages"]) != messages_key(weighted(0, first=1)["messages"])


def test_a_null_weight_is_no_weight_and_a_float_one_is_an_int(tmp_path, monkeypatch):
    """Arrow (Parquet, the Hub) gives every message every key: a null weight is left out."""
    import pandas as pd

    rows = [{"messages": [msg("user", f"q{i}", weight=None), msg("assistant", f"a{i}", weight=[None, 1.0][i % 2])]}
            for i in range(4)]
    data = local(tmp_path, monkeypatch, "w.parquet", b"")
    pd.DataFrame(rows).to_parquet(data.name)
    read, _ = load_rows(data)
    assert [[m.get("weight", "none") for m in r["messages"]] for r in read] == [["none", "none"], ["none", 1]] * 2
    assert all(type(r["messages"][1].get("weight", 0)) is int for r in read)


@pytest.mark.parametrize("weight", [2, -1, 0.5, "1", True, [1]])
def test_a_weight_other_than_0_or_1_is_a_bad_row(tmp_path, monkeypatch, weight):
    rows = [weighted(0), {"messages": [msg("user", "q"), msg("assistant", "a", weight=weight)]}, weighted(1)]
    with pytest.raises(DataError, match=r"^data/local/w\.jsonl row 2: messages\[1\]\.weight: .*; a weight is 0 \(not "
                                        r"trained\) or 1, on an assistant turn only; fix the row"):
        load_rows(local(tmp_path, monkeypatch, "w.jsonl", jsonl(*rows)))


def test_rows_with_no_turn_to_train_are_dropped_and_a_file_of_them_refused(tmp_path, monkeypatch):
    rows = [weighted(0), weighted(1, first=0, second=0), weighted(2)]
    content = jsonl(*rows)
    with pytest.raises(DataError, match=r"^data/local/w\.jsonl row 2: messages: every assistant turn has weight 0, so "
                                        r"no turn is left to train; give an assistant turn weight 1 \(or none\), or "
                                        r"data\.bad_rows: drop drops and counts such rows$"):
        load_rows(local(tmp_path, monkeypatch, "w.jsonl", content))
    read, counts = load_rows(local(tmp_path, monkeypatch, "w.jsonl", content, bad_rows="drop"))
    assert read == [rows[0], rows[2]] and counts["dropped"] == {"no_trained_turn": 1}
    for bad_rows in ("fail", "drop"):  # no row left to train: one line that says so, whatever bad_rows says
        data = local(tmp_path, monkeypatch, "w.jsonl", jsonl(*[weighted(i, 0, 0) for i in range(3)]),
                     bad_rows=bad_rows)
        with pytest.raises(DataError) as error:
            load_rows(data)
        assert str(error.value) == ("data/local/w.jsonl: no row has a turn left to train: every assistant turn of its "
                                    "3 rows has weight 0; weight 1 (or no weight) on an assistant turn trains it")


# --- images, audio and video ---

def mllm_demo(i: int) -> dict:
    """LLaMA-Factory's mllm_demo.json: an images column, <image> in the user turn."""
    return {"messages": [{"role": "user", "content": f"<image>Who are they {i}?"},
                         {"role": "assistant", "content": "They are players."}], "images": [f"mllm_demo_data/{i}.jpg"]}


@pytest.mark.parametrize("row, field, what", [
    (mllm_demo(0), "images", "a column of image data"),
    ({"conversations": [{"from": "human", "value": "<video>What happens?"}, {"from": "gpt", "value": "A goal."}]},
     r"conversations\[0\]\.value", "holds the placeholder <video>, where video data goes"),
    ({"instruction": "Transcribe <audio>", "output": "hello"}, "instruction",
     "holds the placeholder <audio>, where audio data goes"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                                {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]},
                   msg("assistant", "A cat.")]}, r"messages\[0\]\.content\[1\]", "a content part of type 'image_url'"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "UklGR"}}]},
                   msg("assistant", "Hello.")]},
     r"messages\[0\]\.content\[0\]", "a content part of type 'input_audio'"),
])
@pytest.mark.parametrize("bad_rows", ["fail", "drop"])
def test_image_audio_and_video_data_is_refused_in_one_line(tmp_path, monkeypatch, row, field, what, bad_rows):
    content = jsonl({"messages": qa(0)}, row) if "messages" in row else jsonl(row)
    number = 2 if "messages" in row else 1
    refusal = (rf"^data/local/m\.jsonl row {number}: {field}: {what}; the pipeline trains text models, not image, "
               r"audio or video ones: give it rows of text alone$")
    data = local(tmp_path, monkeypatch, "m.jsonl", content, bad_rows=bad_rows)
    with pytest.raises(DataError, match=refusal):
        load_rows(data)
    with pytest.raises(ValueError, match=f"^data.name: {refusal[1:]}"):  # validate refuses it before fetch
        check_text_only(data)


def test_media_in_json_text_cells_and_in_a_json_array_is_refused(tmp_path, monkeypatch):
    parts = [{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": "x.png"}}]
    out = io.StringIO()
    csv.writer(out).writerows([["messages"], [json.dumps(qa(0))], [json.dumps([msg("user", parts),
                                                                             msg("assistant", "A cat.")])]])
    with pytest.raises(DataError, match=r"^data/local/m\.csv row 2 \(line 3\): messages\[0\]\.content\[1\]: a content "
                                        r"part of type 'image_url'; the pipeline trains text models"):
        load_rows(local(tmp_path, monkeypatch, "m.csv", out.getvalue(), bad_rows="drop"))
    data = local(tmp_path, monkeypatch, "mllm_demo.json", json.dumps([mllm_demo(i) for i in range(3)], indent=2))
    with pytest.raises(DataError, match=r"^data/local/mllm_demo\.json row 1: images: a column of image data"):
        load_rows(data)
    text_only = local(tmp_path, monkeypatch, "t.jsonl", jsonl({"messages": qa(0), "images": []}, {"messages": qa(1)}))
    assert load_rows(text_only)[1]["rows_kept"] == 2  # an empty images column holds no image
    check_text_only(text_only)


# --- content parts ---

def test_llama_factory_v1_text_parts_are_read(tmp_path, monkeypatch):
    rows = [{"messages": [{"role": "user", "content": [{"type": "text", "value": f"question {i}"}]},
                          {"role": "assistant", "content": [{"type": "text", "value": f"answer {i}"},
                                                            {"type": "text", "text": "done"}]}]} for i in range(2)]
    read, _ = load_rows(local(tmp_path, monkeypatch, "v1.jsonl", jsonl(*rows)))
    assert read == [{"messages": [msg("user", f"question {i}"), msg("assistant", f"answer {i}\ndone")]}
                    for i in range(2)]


@pytest.mark.parametrize("part, fragment", [
    ({"type": "text"}, r"messages\[0\]\.content\[0\]\.text: missing \(a text part holds its text under 'text', or "
                       r"'value'\)"),
    ({"type": "text", "value": 3}, r"messages\[0\]\.content\[0\]\.value: must be a string, got int"),
    ({"text": None}, r"messages\[0\]\.content\[0\]\.text: must be a string, got NoneType"),
    ("plain", r"messages\[0\]\.content\[0\]: must be a \{type, text\} part, got str"),
])
def test_a_part_that_cannot_be_read_names_what_it_lacks(tmp_path, monkeypatch, part, fragment):
    rows = [{"messages": [msg("user", [part]), msg("assistant", "a")]}, {"messages": qa(1)}]
    with pytest.raises(DataError, match=rf"^data/local/p\.jsonl row 1: {fragment}"):
        load_rows(local(tmp_path, monkeypatch, "p.jsonl", jsonl(*rows)))
    prompt = [{"prompt": [msg("user", [part])], "completion": [msg("assistant", "a")]}]
    with pytest.raises(DataError, match=rf"^data/local/p\.jsonl row 1: {fragment.replace('messages', 'prompt')}"):
        load_rows(local(tmp_path, monkeypatch, "p.jsonl", jsonl(*prompt)))


# --- .txt files ---

WIKI = ["Anarchism is a political philosophy.", "  Autism is a developmental disorder.  ",
        "Albedo is the fraction of sunlight that is reflected."]


def test_a_txt_file_is_a_text_row_a_line(tmp_path, monkeypatch):
    content = f"{WIKI[0]}\r\n\n{WIKI[1]}\n   \n{WIKI[2]}\n{WIKI[0]}"  # a blank line, CRLF, no final newline
    data = local(tmp_path, monkeypatch, "wiki_demo.txt", content)
    read, counts, data_format = load_data(data)
    assert data_format == "text" and read == [{"text": line} for line in WIKI]
    assert counts == {"rows_in": 4, "rows_kept": 3, "dropped": {"duplicate": 1}}
    assert local_rows(Path(data.name)) == 4
    with pytest.raises(DataError, match=r"^data/local/wiki_demo\.txt row 4 \(line 6\): text: the same conversation as "
                                        r"row 1; remove the row, or data\.duplicates: drop drops and counts such rows"):
        load_rows(data.model_copy(update={"duplicates": "fail"}))
    with pytest.raises(DataError, match=r"^data/local/wiki_demo\.txt row 1: a text \(text\) row where data\.format is "
                                        r"alpaca"):
        load_rows(data.model_copy(update={"format": "alpaca"}))
    empty = local(tmp_path, monkeypatch, "empty.txt", "\n \n")
    with pytest.raises(DataError, match=r"^data/local/empty\.txt: the file is empty$"):
        load_rows(empty)


# --- exact duplicates ---

@pytest.mark.parametrize("bad_rows", ["fail", "drop"])
def test_duplicates_are_dropped_by_default_and_refused_with_data_duplicates_fail(tmp_path, monkeypatch, bad_rows):
    rows = [{"messages": qa(0)}, {"messages": qa(1)}, {"messages": qa(0)}, {"messages": qa(1)}]
    data = local(tmp_path, monkeypatch, "d.jsonl", jsonl(*rows), bad_rows=bad_rows)
    assert load_rows(data) == (rows[:2], {"rows_in": 4, "rows_kept": 2, "dropped": {"duplicate": 2}})
    with pytest.raises(DataError, match=r"^data/local/d\.jsonl row 3: messages: the same conversation as row 1; "
                                        r"remove the row, or data\.duplicates: drop drops and counts such rows$"):
        load_rows(data.model_copy(update={"duplicates": "fail"}))
    # other bad rows still stop under bad_rows fail, duplicates or not
    bad = local(tmp_path, monkeypatch, "d.jsonl", jsonl(*rows, {"messages": [msg("user", "a")]}), bad_rows=bad_rows)
    if bad_rows == "fail":
        with pytest.raises(DataError, match=r"^data/local/d\.jsonl row 5: messages: no assistant turn"):
            load_rows(bad)
    else:
        assert load_rows(bad)[1]["dropped"] == {"duplicate": 2, "no_assistant_turn": 1}


def test_the_shipped_params_drop_duplicates_and_the_builtin_counts_are_as_committed():
    data = data_params()
    assert data.duplicates == "drop" and data.source == "builtin"
    _, counts, data_format = load_data(data)
    committed = json.loads((ROOT / "metrics/data.json").read_text())
    assert {"format": data_format, **counts} == committed


# --- empty files and too few rows: validate's answer before fetch ---

@pytest.mark.parametrize("name, content, fragment", [
    ("x.jsonl", "", r"data\.name: data/local/x\.jsonl is empty; put the data set's rows in it$"),
    ("x.jsonl", "\n  \n", r"data\.name: data/local/x\.jsonl is empty"),
    ("x.txt", "\n", r"data\.name: data/local/x\.txt is empty"),
    ("x.json", "[]", r"data\.name: data/local/x\.json holds no rows; put the data set's rows in it$"),
    ("x.csv", "instruction,output\n", r"data\.name: data/local/x\.csv holds no rows"),
    ("x.jsonl", jsonl({"messages": qa(0)}, {"messages": qa(1)}),
     r"data\.name: data/local/x\.jsonl holds 2 rows; the split needs at least 3 rows \(2 test rows and one to train; "
     r"15 at split\.test_size 0\.1\): add rows$"),
    ("x.txt", "one line\n", r"data\.name: data/local/x\.txt holds 1 row; the split needs at least 3 rows"),
])
def test_an_empty_file_or_one_too_small_for_any_split_says_so(tmp_path, monkeypatch, name, content, fragment):
    data = local(tmp_path, monkeypatch, name, content)
    with pytest.raises(ValueError, match="^" + fragment):
        check_split(data, Split(test_size=0.1, seed=0))


def test_too_few_rows_kept_by_max_rows_names_it():
    with pytest.raises(ValueError, match=r"^data\.max_rows: 2 keeps 2 rows; the split needs at least 3 rows \(2 test "
                                         r"rows and one to train\)$"):
        check_split(data_params(max_rows=2), Split(test_size=2, seed=0))


@settings(max_examples=200, deadline=None)
@given(st.floats(0.0005, 0.9995) | st.integers(1, 50).map(float))
def test_rows_needed_is_the_least_count_the_split_accepts(test_size):
    needed = rows_needed(test_size)
    if needed is None:
        assert test_size >= 1 and int(test_size) < MIN_TEST_ROWS
        return
    assert split_problem(needed, test_size) is None and split_problem(needed - 1, test_size) is not None
    assert all(split_problem(n, test_size) is None for n in range(needed, needed + 50))


def test_rows_needed_gives_up_on_a_test_size_no_data_set_reaches():
    assert rows_needed(1e-300) is None and rows_needed(1 - 1e-16) is None


# --- no row ends in a traceback ---

values = st.recursive(st.none() | st.booleans() | st.integers(-1, 2) | st.sampled_from(["", "x", "user", "{}", "[1]"]),
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(
                          ["type", "text", "value", "name", "function", "arguments", "id"]), inner, max_size=3),
                      max_leaves=6)


def some(fields: dict):
    return st.fixed_dictionaries({}, optional=fields)


call = some({"id": values, "type": values, "function": some({"name": st.just("f") | values, "arguments": values})})
message = some({"role": st.sampled_from(["user", "assistant", "tool", "system"]) | values,
                "content": st.just("hi") | st.lists(some({"type": st.just("text") | values, "text": values,
                                                          "value": values}), max_size=2) | values,
                "thinking": values, "tool_calls": st.lists(call, max_size=2) | values, "tool_call_id": values,
                "name": values, "weight": st.sampled_from([0, 1]) | values})
turn = some({"from": st.sampled_from(["human", "gpt", "function_call", "observation"]) | values,
             "value": st.just("hi") | values})
rows = (some({"messages": st.lists(message, max_size=4) | values, "tools": values, "label": values})
        | some({"conversations": st.lists(turn, max_size=4) | values, "system": values, "tools": values})
        | some({"prompt": st.lists(message, max_size=2) | values, "completion": st.lists(message, max_size=2) | values})
        | some({"instruction": values, "output": values, "input": values, "history": values, "chosen": values})
        | some({"text": values}) | values)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(rows, min_size=1, max_size=3), st.sampled_from(["auto", "messages", "sharegpt", "text"]),
       st.sampled_from(["fail", "drop"]))
def test_no_row_ends_in_a_traceback(folder, written, data_format, bad_rows):
    """Any row is read, or is a bad row named and counted, or stops fetch with one DataError line."""
    path = folder / "rows.jsonl"
    path.write_text(jsonl(*written))
    try:
        source_rows = read_local(path, "rows.jsonl", Converter(data_format, {}, "file", "chosen_only"))
        kept, counts = clean_rows(source_rows, "rows.jsonl", bad_rows, 100)
    except DataError as exc:
        assert "\n" not in str(exc)
        return
    assert counts["rows_in"] == counts["rows_kept"] + sum(counts["dropped"].values())
    json.dumps(kept)


def test_rows_nested_too_deeply_are_bad_rows(tmp_path, monkeypatch):
    deep = "[" * 500 + "]" * 500  # read by json, deeper than a row may be
    content = (jsonl({"messages": qa(0)}) + '{"messages": ' + deep + "}\n" + "[" * 5000 + "\n"
               + jsonl({"messages": qa(1)}))
    read, counts = load_rows(local(tmp_path, monkeypatch, "deep.jsonl", content, bad_rows="drop"))
    assert counts["dropped"] == {"invalid_json": 1, "not_a_conversation": 1} and len(read) == 2


# --- a long row cannot stall fetch's tiny tokenizer ---

def test_the_tiny_tokenizer_trains_on_a_bounded_corpus(tmp_path):
    from lora_pipeline.model.tiny import (TOKEN_CHARS, TOKENIZER_CORPUS_CHARS, TOKENIZER_TEXT_CHARS, bounded_corpus,
                                          cut_to_tokens, pretraining_corpus, tokenizer_corpus, train_tokenizer)

    long_rows = [{"messages": [msg("user", "q"), msg("assistant", "x" * 10_000_000)]}] + [
        {"messages": [msg("user", f"q{i}"), msg("assistant", "y" * TOKENIZER_TEXT_CHARS)]} for i in range(3000)]
    corpus = bounded_corpus(tokenizer_corpus(long_rows))
    assert max(map(len, corpus)) == TOKENIZER_TEXT_CHARS and sum(map(len, corpus)) == TOKENIZER_CORPUS_CHARS
    builtin = tokenizer_corpus(load_data(data_params())[0])  # the shipped data reaches neither bound
    assert bounded_corpus(builtin) == builtin
    assert sum(map(len, builtin)) < TOKENIZER_CORPUS_CHARS / 4 and max(map(len, builtin)) < TOKENIZER_TEXT_CHARS / 4
    tokenizer = train_tokenizer(bounded_corpus(tokenizer_corpus(long_rows[:2])), 300, "tiny-qwen2", tmp_path,
                                max_token_length=TOKEN_CHARS)
    assert max(len(token) for token in tokenizer.get_vocab()) <= TOKEN_CHARS
    [cut] = cut_to_tokens(pretraining_corpus(long_rows[:1]), tokenizer, 128)  # what pretrain tokenizes of the row
    assert len(cut) <= 4 * 128 * TOKEN_CHARS
