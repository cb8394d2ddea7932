"""The fetch stage on a local file, through DVC: edits re-run it, bad rows are counted or stop it with one line."""
import json
import subprocess
import sys

import pytest

from conftest import copy_repo, edited_params, run, run_env, set_params
from lora_pipeline.data import builtin as builtin_data

ROWS = builtin_data.generate(30, seed=2)
NO_ANSWER = {"messages": [{"role": "user", "content": "hello?"}]}


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """A copy of the repository that reads data/local/mydata.jsonl and builds the smallest tiny model."""
    repo = copy_repo(tmp_path_factory.mktemp("fetch") / "repo")
    set_params(repo, **{"data.source": "local", "data.name": "data/local/mydata.jsonl", "data.bad_rows": "drop",
                        "model.tiny.pretrain_steps": 0, "model.tiny.vocab_size": 300})
    return repo


def test_editing_the_local_file_reruns_fetch_and_counts_dropped_rows(repo):
    write_rows(repo / "data/local/mydata.jsonl", ROWS[:20] + [NO_ANSWER])
    assert "Running stage 'fetch'" in run(["dvc", "repro", "fetch"], repo)
    metrics = json.loads((repo / "metrics/data.json").read_text())
    assert metrics == {"format": "messages", "rows_in": 21, "rows_kept": 20, "dropped": {"no_assistant_turn": 1}}
    assert "Running stage 'fetch'" not in run(["dvc", "repro", "fetch"], repo)  # nothing changed

    write_rows(repo / "data/local/mydata.jsonl", ROWS[:20] + [NO_ANSWER, ROWS[0], ROWS[20]])
    assert "data/local" in run(["dvc", "status", "fetch"], repo)
    assert "Running stage 'fetch'" in run(["dvc", "repro", "fetch"], repo)
    metrics = json.loads((repo / "metrics/data.json").read_text())
    assert metrics == {"format": "messages", "rows_in": 23, "rows_kept": 21,
                       "dropped": {"duplicate": 1, "no_assistant_turn": 1}}
    assert "metrics/data.json" in run(["dvc", "metrics", "show"], repo)


def test_a_bad_row_stops_fetch_with_one_line(repo):
    write_rows(repo / "data/local/mydata.jsonl", ROWS[:5] + [NO_ANSWER])
    set_params(repo, **{"data.bad_rows": "fail"})
    proc = subprocess.run([sys.executable, "-m", "stages.fetch"], cwd=repo, env=run_env(), capture_output=True,
                          text=True)
    assert proc.returncode == 1
    assert proc.stderr.strip() == ("fetch: data/local/mydata.jsonl row 6: messages: no assistant turn to learn from "
                                   "(roles ['user']); fix the row, or data.bad_rows: drop drops and counts such rows; "
                                   "data/raw, models/base and metrics/data.json are as they were")


FETCHED = ["data/raw/data.jsonl", "models/base/model.safetensors", "metrics/data.json"]
SPLIT = ["data/split/train.jsonl", "data/split/test.jsonl", "metrics/split.json"]


def contents(repo, paths) -> dict:
    return {path: (repo / path).read_bytes() for path in paths}


def failed_repro(repo, *args) -> str:
    """The output of a `dvc repro` that must fail; no stage may end in a traceback."""
    proc = subprocess.run(["dvc", "repro", *args], cwd=repo, env=run_env(), capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "Traceback" not in output, output
    return output


def test_a_file_too_small_to_split_is_refused_by_validate_before_fetch(repo):
    write_rows(repo / "data/local/five.jsonl", ROWS[:5])
    with edited_params(repo, **{"data.name": "data/local/five.jsonl"}):
        output = failed_repro(repo, "split")
    assert "split.test_size: 0.1 leaves 0 test and 5 train rows of at most 5 (the rows of data.name " \
           "data/local/five.jsonl); allowed: a fraction below 1 or a whole row count" in output
    assert "Running stage 'fetch'" not in output


def test_a_fetch_that_refuses_a_row_keeps_its_outputs_under_dvc_repro(repo):
    write_rows(repo / "data/local/mydata.jsonl", ROWS[:20])
    run(["dvc", "repro", "fetch"], repo)
    before = contents(repo, FETCHED)
    write_rows(repo / "data/local/mydata.jsonl", ROWS[:20] + [ROWS[3]])
    with edited_params(repo, **{"data.bad_rows": "fail", "data.max_chars": 100}):
        output = failed_repro(repo, "fetch")
    assert ("fetch: data/local/mydata.jsonl row 1: messages: " in output
            and "over data.max_chars 100; raise data.max_chars (0: no limit), or data.bad_rows: drop drops and "
                "counts such rows; data/raw, models/base and metrics/data.json are as they were" in output), output
    set_params(repo, **{"data.bad_rows": "fail"})
    with edited_params(repo, **{"data.duplicates": "fail"}):
        output = failed_repro(repo, "fetch")
    assert ("fetch: data/local/mydata.jsonl row 21: messages: the same conversation as row 4; remove the row, or "
            "data.duplicates: drop drops and counts such rows; data/raw, models/base and metrics/data.json are as they "
            "were") in output, output
    assert contents(repo, FETCHED) == before


def test_a_split_of_too_few_fetched_rows_stops_with_one_line_and_keeps_its_outputs(repo):
    set_params(repo, **{"data.bad_rows": "drop"})
    write_rows(repo / "data/local/mydata.jsonl", ROWS[:20])
    run(["dvc", "repro", "split"], repo)
    before = contents(repo, SPLIT)
    # 30 rows in the file pass validate; fetch drops 24, which leaves split 6
    write_rows(repo / "data/local/mydata.jsonl", ROWS[:6] + [NO_ANSWER] * 24)
    output = failed_repro(repo, "split")
    assert "Running stage 'fetch'" in output
    assert ("split: split.test_size: 0.1 leaves 1 test and 5 train rows of 6 fetched into data/raw/data.jsonl; "
            "allowed: a fraction below 1 or a whole row count that leaves at least 2 test rows and one to train; "
            "data/split and metrics/split.json are as they were") in output, output
    assert contents(repo, SPLIT) == before


OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
# Nothing listens on port 9 of the loopback: the Hub "server" refuses every connection at once.
UNREACHABLE = {"HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}


@pytest.mark.parametrize("changes, env, key, why", [
    ({"model.source": "hub", "model.name": "someone/model-x", "model.revision": "abc123"}, OFFLINE,
     "model.name 'someone/model-x' at revision 'abc123'", "offline mode is on (HF_HUB_OFFLINE=1)"),
    ({"model.source": "hub", "model.name": "someone/model-x", "model.revision": "abc123"}, UNREACHABLE,
     "model.name 'someone/model-x' at revision 'abc123'", "the Hugging Face Hub is unreachable"),
    ({"data.source": "hub", "data.name": "someone/data-x", "data.revision": "v1"}, OFFLINE,
     "data.name 'someone/data-x' at revision 'v1'", "offline mode is on (HF_HUB_OFFLINE=1)"),
])
def test_hub_out_of_reach_fails_naming_id_and_revision_and_keeps_the_outputs(tmp_path, changes, env, key, why):
    repo = copy_repo(tmp_path / "repo")
    set_params(repo, **{"data.builtin_rows": 50, **changes})
    previous = {"data/raw/data.jsonl": "previous rows\n", "models/base/config.json": "{}\n",
                "metrics/data.json": "{}\n"}
    for path, text in previous.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    proc = subprocess.run([sys.executable, "-m", "stages.fetch"], cwd=repo, env=run_env(**env), capture_output=True,
                          text=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"fetch: {key} could not be fetched: {why}"), proc.stderr
    assert "not in the local Hugging Face cache" in last
    # the previous outputs are untouched, and nothing staged is left beside them
    assert {path: (repo / path).read_text() for path in previous} == previous
    assert sorted(p.name for p in (repo / "models").iterdir()) == ["base"]
    assert sorted(p.name for p in (repo / "data").iterdir()) == ["local", "raw"]
