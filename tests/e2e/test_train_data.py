"""What train keeps of a file's rows, through `dvc repro train`: the rows cut at train.sft.max_length and those left
with no trained token are counted in metrics/train.json and named in one line at train's start; a run shorter than
train.sft.logging_steps still logs its last step, and its train_loss is that step's; assistant turns of weight 0
train as context, and only with the assistant-only loss."""
import json
import subprocess

import pytest

from conftest import copy_repo, run, run_env, set_params

pytestmark = pytest.mark.e2e  # runs DVC

MAX_LENGTH = 64
# The smallest run that still trains (a one-layer model, no pretraining), 2 steps logged every 5, rows cut at 64 tokens.
SMALL = {"data.source": "local", "data.name": "data/local/lengths.jsonl", "model.tiny.pretrain_steps": 0,
         "model.tiny.vocab_size": 300, "model.tiny.hidden_size": 32, "model.tiny.intermediate_size": 32,
         "model.tiny.num_hidden_layers": 1, "split.test_size": 2, "train.sft.max_steps": 2,
         "train.sft.logging_steps": 5, "train.sft.max_length": MAX_LENGTH, "train.checkpoint_steps": 0,
         "eval.prompts": 2, "eval.max_new_tokens": 4, "eval.include_base": False}
WORDS = ["river", "bridge", "city", "north", "south", "market", "tower", "garden", "harbour", "station"]


def words(n: int, start: int) -> str:
    return " ".join(WORDS[(start + i) % len(WORDS)] for i in range(n))


def rows() -> list[dict]:
    """Short rows, rows whose answer runs past MAX_LENGTH tokens (cut, still trained) and rows whose question alone
    does (cut, nothing left to train)."""
    short = [{"messages": [{"role": "user", "content": f"Name a {WORDS[i]} {i}."},
                           {"role": "assistant", "content": f"The {words(2, i)}."}]} for i in range(8)]
    long_answer = [{"messages": [{"role": "user", "content": f"Describe city {i}."},
                                 {"role": "assistant", "content": "LONGANSWER " + words(120 + i, i)}]}
                   for i in range(3)]
    long_question = [{"messages": [{"role": "user", "content": "LONGQUESTION " + words(120 + i, i)},
                                   {"role": "assistant", "content": "Yes."}]} for i in range(3)]
    return short + long_answer + long_question


def test_rows_cut_at_max_length_are_counted_and_named_and_a_short_run_logs_its_last_step(tmp_path):
    from transformers import AutoTokenizer

    repo = copy_repo(tmp_path / "repo")
    (repo / "data/local/lengths.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows()))
    set_params(repo, **SMALL)
    output = run(["dvc", "repro", "train"], repo)

    trained = [json.loads(line) for line in (repo / "data/split/train.jsonl").read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(repo / "models/base")
    lengths = [len(tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=True)["input_ids"])
               for row in trained]
    long = [n for n in lengths if n > MAX_LENGTH]
    no_target = sum("LONGQUESTION" in json.dumps(row) for row in trained)
    assert len(long) == sum("LONG" in json.dumps(row) for row in trained) >= 4 and no_target >= 1
    metrics = json.loads((repo / "metrics/train.json").read_text())
    assert {key: metrics[key] for key in ("rows_truncated", "tokens_truncated", "rows_dropped_no_target")} == {
        "rows_truncated": len(long), "tokens_truncated": sum(n - MAX_LENGTH for n in long),
        "rows_dropped_no_target": no_target}
    lines = [line for line in output.splitlines() if line.startswith("train: rows longer than train.sft.max_length")]
    assert lines == [f"train: rows longer than train.sft.max_length ({MAX_LENGTH}), cut to it: {len(long)} of "
                     f"{len(trained)} ({metrics['tokens_truncated']} tokens cut off); rows with no trained token "
                     f"left, not trained: {no_target}. See metrics/train.json; raise train.sft.max_length in "
                     "params.yaml to keep them (memory per step grows with it), or shorten those rows"], output[-3000:]

    # 2 steps, logged every 5: the last step is logged, and train_loss is its loss (the mean over both steps)
    assert metrics["steps"] == 2 and metrics["train_loss"] == metrics["final_loss"] is not None
    plot = (repo / "plots/train_loss.csv").read_text().splitlines()
    assert plot[0] == "step,loss,learning_rate,grad_norm" and [row.split(",")[0] for row in plot[1:]] == ["2"]


def weighted_rows() -> list[dict]:
    """OpenAI's fine-tuning rows: the first answer is context (weight 0), the second a target (weight 1)."""
    return [{"messages": [{"role": "user", "content": f"Where is the {WORDS[i]} {i}?"},
                          {"role": "assistant", "content": f"Not sure: {words(2, i)}.", "weight": 0},
                          {"role": "user", "content": "Look again."},
                          {"role": "assistant", "content": f"North of the {words(2, i + 3)}.", "weight": 1}]}
            for i in range(10)]


def test_turns_of_weight_zero_train_only_with_the_assistant_only_loss(tmp_path):
    """With train.sft.assistant_only_loss false, train refuses the data at its start in one line, naming the setting;
    with it true (the default), it trains."""
    repo = copy_repo(tmp_path / "repo")
    (repo / "data/local/weighted.jsonl").write_text("".join(json.dumps(row) + "\n" for row in weighted_rows()))
    set_params(repo, **{**SMALL, "data.name": "data/local/weighted.jsonl", "train.sft.max_length": 512,
                        "train.sft.assistant_only_loss": False})
    proc = subprocess.run(["dvc", "repro", "train"], cwd=repo, env=run_env(), capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in output, output[-3000:]
    trained = [json.loads(line) for line in (repo / "data/split/train.jsonl").read_text().splitlines()]
    assert all([m.get("weight") for m in row["messages"]] == [None, 0, None, 1] for row in trained)
    assert (f"train: {len(trained)} assistant turns of the training data have weight 0 (context, not a target), but "
            "train.sft.assistant_only_loss is false: the whole sequence would be trained, those turns included; set "
            "train.sft.assistant_only_loss: true in params.yaml") in output, output[-3000:]

    set_params(repo, **{"train.sft.assistant_only_loss": True})
    output = run(["dvc", "repro", "train"], repo)
    metrics = json.loads((repo / "metrics/train.json").read_text())
    assert metrics["steps"] == 2 and metrics["rows_dropped_no_target"] == 0
    assert "train: rows" not in output
