"""The data users bring, through `dvc repro`: a file in each public format (written here in the shape of the peer
projects' example files: TRL's guide, LLaMA-Factory's data/ folder, axolotl's fixtures, the OpenAI chat API) is
fetched and split as its authors mean it; preference rows are refused or read for their chosen answers alone; a
tool-calling file trains with its tools in the chat template and both models' calls are scored against the held-out
ones; an Alpaca file trains and registers, gated on its held-out answers against their references."""
import json
import subprocess

import pytest

from conftest import copy_repo, run, run_env, set_params

pytestmark = pytest.mark.e2e  # every test here runs DVC

# The smallest run that still trains: a one-layer model, no pretraining, the least vocabulary, 2 held-out rows,
# 3 steps, a short eval.
SMALL = {"data.source": "local", "model.tiny.pretrain_steps": 0, "model.tiny.vocab_size": 300,
         "model.tiny.hidden_size": 32, "model.tiny.intermediate_size": 32, "model.tiny.num_hidden_layers": 1,
         "split.test_size": 2,
         "train.sft.max_steps": 3, "train.sft.logging_steps": 1, "train.checkpoint_steps": 0, "eval.prompts": 2,
         "eval.max_new_tokens": 4, "eval.include_base": False}
N = 10  # rows a file

WEATHER = {"name": "get_weather", "description": "Get the current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
                          "required": ["city"]}}
CITIES = ["Paris", "Berlin", "Madrid", "Rome", "Lisbon", "Vienna", "Oslo", "Dublin", "Prague", "Athens"]


def glaive_toolcall(i: int) -> dict:
    """LLaMA-Factory's glaive_toolcall_en_demo.json: ShareGPT with function_call/observation turns, tools as JSON
    text, a system column."""
    return {"conversations": [
        {"from": "human", "value": f"What is the weather in {CITIES[i]} now?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": CITIES[i]}})},
        {"from": "observation", "value": json.dumps({"temperature": 10 + i, "unit": "celsius"})},
        {"from": "gpt", "value": f"It is {10 + i} degrees Celsius in {CITIES[i]}."}],
        "system": "You are a helpful assistant with access to functions.", "tools": json.dumps([WEATHER])}


# (the file, its rows, the params it needs, the format fetch detects)
FILES = {
    "text": ("c4_demo.jsonl", lambda i: {"text": f"Document {i}: the city of {CITIES[i]} has a river and a bridge."},
             {}, "text"),
    "content parts": ("v1_sft_demo.jsonl", lambda i: {"messages": [
        {"role": "user", "content": [{"type": "text", "text": f"Name a fact about {CITIES[i]}."}]},
        {"role": "assistant", "content": [{"type": "text", "text": f"{CITIES[i]} is a capital city."}]}]},
        {}, "messages"),
    # TRL's dataset_formats.md and OpenAI's function-calling guide: no content key on the calling turn, an id on the
    # call, arguments an object (TRL) or JSON text (OpenAI), tool_call_id and name on the tool turn
    "trl tool calls": ("trl_tool_calls.jsonl", lambda i: {"messages": [
        {"role": "user", "content": f"Weather in {CITIES[i]}?"},
        {"role": "assistant", "tool_calls": [
            {"id": f"call_{i}", "type": "function", "function": {
                "name": "get_weather",
                "arguments": json.dumps({"city": CITIES[i]}) if i % 2 else {"city": CITIES[i]}}}]},
        {"role": "tool", "tool_call_id": f"call_{i}", "name": "get_weather",
         "content": json.dumps({"temperature": 10 + i})},
        {"role": "assistant", "content": f"{10 + i} degrees."}], "tools": [{"type": "function", "function": WEATHER}]},
        {}, "messages"),
    "trl prompt-completion": ("trl_prompt_completion.jsonl", lambda i: {
        "prompt": [{"role": "user", "content": f"What is {CITIES[i]}?"}],
        "completion": [{"role": "assistant", "content": f"{CITIES[i]} is a city."}]}, {}, "prompt_completion"),
    "sharegpt tools": ("glaive_toolcall_en_demo.json", glaive_toolcall, {}, "sharegpt"),
    "alpaca history": ("alpaca_history.json", lambda i: {
        "instruction": f"And the river of {CITIES[i]}?", "input": "", "output": f"It has river {i}.",
        "system": "Answer briefly.", "history": [[f"Tell me about {CITIES[i]}.", f"{CITIES[i]} is a city."]]},
        {}, "alpaca"),
    "kto": ("kto_en_demo.json", lambda i: {"messages": [
        {"role": "user", "content": f"Describe {CITIES[i]}."},
        {"role": "assistant", "content": f"{CITIES[i]} is lovely." if i % 3 else f"BAD ANSWER {i}"}],
        "label": bool(i % 3)}, {"data.preference": "chosen_only"}, "messages"),
    "dpo": ("dpo_en_demo.json", lambda i: {
        "conversations": [{"from": "human", "value": f"Which river runs through {CITIES[i]}?"}],
        "chosen": {"from": "gpt", "value": f"River {i}."}, "rejected": {"from": "gpt", "value": f"REJECTED {i}"}},
        {"data.preference": "chosen_only"}, "sharegpt"),
}


def failed_repro(repo, *args) -> str:
    """The output of a `dvc repro` that must fail, with no traceback."""
    proc = subprocess.run(["dvc", "repro", *args], cwd=repo, env=run_env(), capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in output, output
    return output


def write_file(repo, name: str, rows: list) -> str:
    path = repo / "data/local" / name
    if name.endswith(".jsonl"):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:  # LLaMA-Factory's files: one JSON array, indented
        path.write_text(json.dumps(rows, indent=2))
    return f"data/local/{name}"


def read_rows(repo, path: str) -> list[dict]:
    return [json.loads(line) for line in (repo / path).read_text().splitlines()]


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    repo = copy_repo(tmp_path_factory.mktemp("user-data") / "repo")
    set_params(repo, **SMALL)
    return repo


@pytest.fixture
def own_repo(tmp_path):
    """A copy of its own, for a test that trains: it runs from fetch on anyway, and in an xdist_group of its own
    it can run on the other worker beside this module's other tests."""
    repo = copy_repo(tmp_path / "repo")
    set_params(repo, **SMALL)
    return repo


def use(repo, case: str, **changes) -> list[dict]:
    """The case's file written into data/local and named in params.yaml; its rows."""
    name, row, params, _ = FILES[case]
    rows = [row(i) for i in range(N)]
    set_params(repo, **{"data.name": write_file(repo, name, rows), "data.preference": "refuse", **params, **changes})
    return rows


# Two files go on to train (below): fetch and split are checked on their way there, not in a run of their own.
TRAINED = ("sharegpt tools", "alpaca history")


@pytest.mark.parametrize("case", [case for case in FILES if case not in TRAINED])
def test_each_format_is_fetched_and_split_as_its_authors_mean_it(repo, case):
    written = use(repo, case)
    run(["dvc", "repro", "split"], repo)
    check_fetched_and_split(repo, case, written)


def check_fetched_and_split(repo, case: str, written: list[dict]):
    """data/raw and data/split after fetch and split of the case's rows (written): its format detected, every
    fetched row in one split, each read as its authors mean it."""
    fetched = json.loads((repo / "metrics/data.json").read_text())
    assert fetched["format"] == FILES[case][3]
    split = read_rows(repo, "data/split/train.jsonl") + read_rows(repo, "data/split/test.jsonl")
    assert sorted(map(json.dumps, split)) == sorted(map(json.dumps, read_rows(repo, "data/raw/data.jsonl")))
    text = json.dumps(split)
    if case == "text":
        assert sorted(r["text"] for r in split) == sorted(r["text"] for r in written)
    elif case == "content parts":
        assert all(isinstance(m["content"], str) for r in split for m in r["messages"])
        assert "Paris is a capital city." in text
    elif case in ("trl tool calls", "sharegpt tools"):
        assert all(r["tools"] == [{"type": "function", "function": WEATHER}] for r in split)
        calls = [m for r in split for m in r["messages"] if m.get("tool_calls")]
        assert len(calls) == N and all(m["content"] is None for m in calls)
        assert {json.loads(m["tool_calls"][0]["function"]["arguments"])["city"] for m in calls} == set(CITIES)
        assert sum(m["role"] == "tool" for r in split for m in r["messages"]) == N
        if case == "trl tool calls":  # the ids that pair each call with its tool turn, and the tool's name, kept
            for row in split:
                call, tool = row["messages"][1:3]
                assert call["tool_calls"][0]["id"] == tool["tool_call_id"] and tool["name"] == "get_weather"
    elif case == "alpaca history":
        assert all([m["role"] for m in r["messages"]] == ["system", "user", "assistant", "user", "assistant"]
                   for r in split)
    elif case == "kto":  # the answers marked bad are counted, and in neither split
        assert "BAD ANSWER" not in text and fetched["dropped"] == {"label_false": 4}
        assert len(split) == sum(r["label"] for r in written)
    elif case == "dpo":  # the chosen answers alone
        assert "REJECTED" not in text and "River 3." in text and len(split) == N


def test_preference_data_is_refused_naming_the_way_on(repo):
    for case, answers in (("dpo", "the chosen answers"), ("kto", "the label: true answers")):
        use(repo, case, **{"data.preference": "refuse"})
        output = failed_repro(repo, "split")
        fields = "label" if case == "kto" else "chosen, rejected"
        assert (f"fetch: data/local/{FILES[case][0]} row 1: preference data ({fields}): SFT does not train "
                f"preferences; data.preference: chosen_only trains on {answers} only") in output, output


def test_a_text_file_is_a_row_a_line_and_a_repeated_line_is_dropped(repo):
    """LLaMA-Factory's wiki_demo.txt: one document a line. A repeated line is dropped and counted under the shipped
    data.bad_rows: fail (data.duplicates: drop)."""
    lines = [f"{city} is a city of Europe, with a river and a bridge." for city in CITIES]
    (repo / "data/local/wiki_demo.txt").write_text("\n".join(lines[:5] + ["", lines[0]] + lines[5:]) + "\n")
    set_params(repo, **{"data.name": "data/local/wiki_demo.txt", "data.bad_rows": "fail", "data.preference": "refuse"})
    output = run(["dvc", "repro", "fetch"], repo)
    assert (f"data: {N} rows from local data/local/wiki_demo.txt, format text (detected) -> data/raw (dropped: 1 "
            "duplicate)") in output, output
    assert json.loads((repo / "metrics/data.json").read_text()) == {
        "format": "text", "rows_in": N + 1, "rows_kept": N, "dropped": {"duplicate": 1}}
    assert read_rows(repo, "data/raw/data.jsonl") == [{"text": line} for line in lines]


def test_image_data_is_refused_by_validate_in_one_line(repo):
    """LLaMA-Factory's mllm_demo.json: an images column, and <image> in the text."""
    rows = [{"messages": [{"role": "user", "content": f"<image>Who is in {CITIES[i]}?"},
                          {"role": "assistant", "content": "Two players."}], "images": [f"mllm_demo_data/{i}.jpg"]}
            for i in range(N)]
    set_params(repo, **{"data.name": write_file(repo, "mllm_demo.json", rows), "data.preference": "refuse"})
    output = failed_repro(repo, "fetch")
    assert ("data.name: data/local/mllm_demo.json row 1: images: a column of image data; the pipeline trains text "
            "models, not image, audio or video ones: give it rows of text alone") in output, output
    assert "Running stage 'fetch'" not in output


def test_every_file_gets_its_own_answer(repo):
    """What a user may bring, each through `dvc repro fetch`: an empty file and one of 2 rows are named as such by
    validate; LLaMA-Factory v1's {type, value} parts are read as text; a file whose every assistant turn has OpenAI's
    weight 0 is refused; a row of 10 million characters under data.max_chars 0 is fetched (the tiny tokenizer trains
    on a bounded share of it)."""
    base = {"data.preference": "refuse", "data.bad_rows": "fail"}
    (repo / "data/local/empty.jsonl").write_text("\n")
    set_params(repo, **base, **{"data.name": "data/local/empty.jsonl"})
    output = failed_repro(repo, "fetch")
    assert "data.name: data/local/empty.jsonl is empty; put the data set's rows in it" in output, output
    set_params(repo, **{"data.name": write_file(repo, "two.jsonl", [FILES["trl prompt-completion"][1](i)
                                                                     for i in range(2)])})
    output = failed_repro(repo, "fetch")
    assert ("data.name: data/local/two.jsonl holds 2 rows; the split needs at least 3 rows (2 test rows and one to "
            "train): add rows") in output, output

    v1 = [{"messages": [{"role": "user", "content": [{"type": "text", "value": f"Name a fact about {city}."}]},
                        {"role": "assistant", "content": [{"type": "text", "value": f"{city} is a capital city."}]}]}
          for city in CITIES]
    set_params(repo, **{"data.name": write_file(repo, "v1_sft_demo.jsonl", v1)})
    run(["dvc", "repro", "fetch"], repo)
    assert [row["messages"][1]["content"] for row in read_rows(repo, "data/raw/data.jsonl")] == \
        [f"{city} is a capital city." for city in CITIES]

    unweighted = [{"messages": [{"role": "user", "content": f"Weather in {city}?"},
                                {"role": "assistant", "content": "Sunny.", "weight": 0}]} for city in CITIES]
    set_params(repo, **{"data.name": write_file(repo, "weights.jsonl", unweighted)})
    output = failed_repro(repo, "fetch")
    assert ("fetch: data/local/weights.jsonl: no row has a turn left to train: every assistant turn of its 10 rows has "
            "weight 0") in output, output

    long = [{"text": f"{city} has a river. " * (500_000 if i == 0 else 1)} for i, city in enumerate(CITIES)]
    set_params(repo, **{"data.name": write_file(repo, "long.jsonl", long), "data.max_chars": 0})
    run(["dvc", "repro", "fetch"], repo)
    assert json.loads((repo / "metrics/data.json").read_text())["rows_kept"] == N
    set_params(repo, **{"data.max_chars": 20000})


def test_a_link_to_a_file_outside_the_repository_is_refused_by_validate(repo, tmp_path):
    outside = tmp_path / "hostname"
    outside.write_text("a file that is not the repository's\n")
    (repo / "data/local/link.jsonl").symlink_to(outside)
    try:
        set_params(repo, **{"data.name": "data/local/link.jsonl"})
        output = failed_repro(repo, "split")
    finally:
        (repo / "data/local/link.jsonl").unlink()
    assert f"data.name: data/local/link.jsonl is a link to {outside}, outside the repository" in output, output
    assert "Running stage 'fetch'" not in output


@pytest.mark.xdist_group("user-data-tools")
def test_a_tool_calling_file_trains_with_its_tools_in_the_chat_template(own_repo):
    """A file in TRL's exact tool-calling shape (no content key on the calling turn, ids, tool_call_id and name on
    the tool turn) trains for a few steps; TRL's own tokenization of its rows (what train ran) holds the function
    schema, the call and the tool's answer, and trains on the call; evaluate asks each held-out row up to its call and
    scores both models' calls against it."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from lora_pipeline.model.chat import training_rows

    repo = own_repo
    written = use(repo, "trl tool calls", **{"eval.include_base": True})
    run(["dvc", "repro", "evaluate"], repo)
    check_fetched_and_split(repo, "trl tool calls", written)
    assert json.loads((repo / "metrics/train.json").read_text())["steps"] == 3
    evaluated = json.loads((repo / "metrics/eval.json").read_text())
    for figures in (evaluated, evaluated["base"]):  # every held-out row calls get_weather where it is asked
        calls = figures["tool_call"]
        assert calls["questions"] == calls["calls_expected"] == 2 and calls["answers_expected"] == 0, figures
        assert 0 <= calls["right_call"] <= calls["right_name"] <= 1 and "task" not in figures, figures
    asked = [r for r in read_rows(repo, "reports/generations.jsonl") if r["set"] == "heldout"]
    assert [[m["role"] for m in r["prompt"]] for r in asked] == [["user"]] * 2
    report = (repo / "reports/task.md").read_text()
    assert "| figure | base | fine-tuned |" in report and "| right call (share) |" in report
    for row in read_rows(repo, "data/split/test.jsonl"):
        call = next(m for m in row["messages"] if m.get("tool_calls"))["tool_calls"][0]
        city = json.loads(call["function"]["arguments"])["city"]
        assert f'get_weather({{"city": "{city}"}})' in report, report
    rows = read_rows(repo, "data/split/train.jsonl")
    tokenizer = AutoTokenizer.from_pretrained(repo / "models/base")
    trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(repo / "models/base"),
                         args=SFTConfig(output_dir=str(repo / "tmp-sft"), report_to="none", use_cpu=True,
                                        assistant_only_loss=True, max_length=1024),
                         train_dataset=Dataset.from_list(training_rows(rows)), processing_class=tokenizer)
    example = trainer.train_dataset[0]
    rendered = tokenizer.decode(example["input_ids"])
    city = json.loads(next(m for m in rows[0]["messages"] if m.get("tool_calls"))["tool_calls"][0]["function"]
                      ["arguments"])["city"]
    for part in ("<tools>", '"name": "get_weather"', "Get the current weather of a city", "<tool_call>",
                 f'"arguments": {{"city": "{city}"}}', "<tool_response>", '"temperature"'):
        assert part in rendered, rendered
    trained = tokenizer.decode([t for t in example["labels"] if t != -100])  # TRL's targets: the assistant turns
    assert f'"arguments": {{"city": "{city}"}}' in trained and "<tool_response>" not in trained


@pytest.mark.xdist_group("user-data-alpaca")
def test_an_alpaca_file_trains_and_registers_gated_on_its_answers(own_repo):
    repo = own_repo
    # a gate this data cannot measure
    written = use(repo, "alpaca history", **{"register.gate_metric": "eval.compliance.overall"})
    output = failed_repro(repo, "register")
    assert ("register.gate_metric: 'eval.compliance.overall' needs rows that ask for a reasoning language, and no row "
            "of data/local/alpaca_history.json does; gate on the held-out loss (eval.test.loss, or auto)") in output
    assert "Running stage 'fetch'" not in output

    set_params(repo, **{"register.gate_metric": "auto"})  # as params.yaml ships it: no gate named
    output = run(["dvc", "repro", "validate"], repo)
    assert ("data: local data/local/alpaca_history.json, not the built-in set: the model will be registered as "
            "'lora-pipeline' (register.model_name), gated on eval.test.loss (lower is better)") in output

    set_params(repo, **{"register.gate_metric": "eval.task.chrf", "eval.include_base": True})
    output = run(["dvc", "repro"], repo)
    check_fetched_and_split(repo, "alpaca history", written)
    assert "gated on eval.task.chrf (higher is better)" in output
    evaluated = json.loads((repo / "metrics/eval.json").read_text())
    assert evaluated["compliance"] == "not applicable: no held-out row asks for a reasoning language"
    for figures in (evaluated, evaluated["base"]):  # the answers against the held-out rows' last turns
        task = figures["task"]
        assert task["questions"] == 2 and "tool_call" not in figures, figures
        assert 0 <= task["exact_match"] <= 1 and 0 <= task["rouge_l"] <= 1 and 0 <= task["chrf"] <= 100, figures
    report = (repo / "reports/task.md").read_text()
    assert "| figure | base | fine-tuned |" in report and "| chrF (corpus, 0-100) |" in report
    for row in read_rows(repo, "data/split/test.jsonl"):
        assert row["messages"][-1]["content"] in report and row["messages"][-2]["content"] in report
    registered = json.loads((repo / "models/registered.json").read_text())
    assert registered["model_name"] == "lora-pipeline" and registered["version"] == 1
    assert registered["gate"]["metric"] == "eval.task.chrf" and registered["gate"]["promote"]
    assert "champion" in registered["aliases"]
    import mlflow
    from mlflow import MlflowClient

    mlflow.set_tracking_uri(f"sqlite:///{repo / 'mlflow.db'}")
    run_data = MlflowClient().get_run(registered["run_id"]).data
    assert run_data.metrics["eval.test.loss"] == evaluated["test"]["loss"]
    assert run_data.metrics["eval.task.chrf"] == evaluated["task"]["chrf"]
    assert run_data.metrics["eval.base.task.rouge_l"] == evaluated["base"]["task"]["rouge_l"]
    assert not any(key.startswith("eval.compliance") for key in run_data.metrics)
