"""The curated experiment table: what each row changed from its baseline, the decision metrics, sorted by the gate,
in 120 columns."""
import copy
import shutil
import sys

import pytest

from conftest import ROOT, run

from cli.experiments import WIDTH, compact, experiment_rows, table

BASE_PARAMS = {"data": {"name": ""},
               "quantization": {"method": "none", "double_quant": True},
               "train": {"sft": {"learning_rate": 0.005, "lr_scheduler_kwargs": {}, "seed": 42}},
               "lora": {"r": 8, "lora_alpha": 16, "target_parameters": []},
               "eval": {"languages": ["en", "de", "es", "fr", "it"],
                        "mgsm": {"path": "", "languages": ["en", "de", "es", "fr"], "limit": 10}}}


def rev(sha, name, changes, overall, loss):
    """One entry as `dvc exp show --json` gives it (DVC 3.67): the workspace, a commit or an experiment's rev."""
    params = copy.deepcopy(BASE_PARAMS)
    for key, value in changes.items():
        *parents, leaf = key.split(".")
        node = params
        for part in parents:
            node = node[part]
        node[leaf] = value
    metrics = {"metrics/eval.json": {"data": {"test": {"loss": loss}, "final_language_rate": 0.5,
                                              "compliance": {"de": overall, "en": 1.0, "overall": overall}}},
               "metrics/merge.json": {"data": {"relative_logit_diff": 1e-7}}}
    data = {"rev": sha, "timestamp": None, "params": {"params.yaml": {"data": params}}, "metrics": metrics,
            "deps": {}, "outs": {}, "meta": {}}
    return {"rev": sha, "name": name, "data": data, "error": None, "experiments": None}


def experiment(name, changes, overall, loss):
    return {"revs": [rev(f"{name:0<40}"[:40], name, changes, overall, loss)], "executor": None, "name": name}


TWO_KEYS = {"lora.r": 16, "lora.lora_alpha": 32}
# After `dvc repro` on main and five `dvc exp run -S ...` (newest first, as DVC lists them); the last one's values
# are left in the workspace.
SHOWN = [rev("workspace", None, TWO_KEYS, 0.93, 0.33),
         {**rev("c0ffee" + "0" * 34, "main", {}, 0.86, 0.38), "experiments": [
             experiment("r16-alpha32", TWO_KEYS, 0.93, 0.33),
             experiment("mgsm-2", {"eval.mgsm.languages": ["en", "fr"]}, 0.84, 0.40),
             experiment("mgsm-3", {"eval.mgsm.languages": ["en", "de", "es"]}, 0.87, 0.37),
             experiment("nf4", {"quantization.method": "nf4"}, 0.80, 0.30),
             experiment("r16", {"lora.r": 16}, 0.90, 0.35)]}]


def changed_cells(text: str) -> dict[str, list[str]]:
    """{row name: the lines of its 'changed' cell}, read off the table's layout (a row's later lines start blank)."""
    lines = text.splitlines()
    start = lines[0].index("changed")
    cells = {}
    for line in lines[2:]:
        if line.startswith("sorted by"):
            break
        if not line.startswith(" "):
            name = line.split()[0]
            cells[name] = []
        if line[start:].strip():
            cells[name].append(line[start:].strip())
    return cells


def test_each_row_shows_what_it_changed_from_its_baseline_and_only_that():
    text = table(experiment_rows(SHOWN), "eval.compliance.overall", True)
    assert changed_cells(text) == {
        "workspace": ["lora.lora_alpha=32", "lora.r=16"], "r16-alpha32": ["lora.lora_alpha=32", "lora.r=16"],
        "r16": ["lora.r=16"], "mgsm-3": ["eval.mgsm.languages=[en,de,es]"], "main": [],
        "mgsm-2": ["eval.mgsm.languages=[en,fr]"], "nf4": ["quantization.method=nf4"]}, text
    assert all(len(line) <= WIDTH for line in text.splitlines()), text


def test_rows_are_sorted_by_the_gate_with_the_metric_columns():
    text = table(experiment_rows(SHOWN), "eval.compliance.overall", True)
    lines = text.splitlines()
    assert lines[0].split() == ["experiment", "loss", "comp", "de", "en", "final", "mgsm", "merge", "changed"]
    assert list(changed_cells(text)) == ["workspace", "r16-alpha32", "r16", "mgsm-3", "main", "mgsm-2", "nf4"]
    assert lines[2].split() == ["workspace", "0.33", "0.93", "0.93", "1", "0.5", "-", "1.0e-07", "lora.lora_alpha=32"]


def test_the_task_columns_show_where_a_row_has_them():
    """Data asked as it asks (an Alpaca file, tool calls): its answers' figures against the references, in columns
    that the built-in data's table does not have."""
    text = table(experiment_rows(SHOWN), "eval.compliance.overall", True)
    assert not {"match", "rougeL", "chrF", "call", "nocall"} & set(text.splitlines()[0].split())
    shown = copy.deepcopy(SHOWN)
    shown[1]["experiments"][0]["revs"][0]["data"]["metrics"]["metrics/eval.json"]["data"]["task"] = {
        "exact_match": 0.25, "rouge_l": 0.5, "chrf": 41.27, "questions": 4}
    text = table(experiment_rows(shown), "eval.task.rouge_l", True)
    lines = text.splitlines()
    assert lines[0].split() == ["experiment", "loss", "comp", "de", "en", "final", "mgsm", "match", "rougeL", "chrF",
                                "merge", "changed"]
    assert lines[2].split()[:1] + lines[2].split()[7:10] == ["r16-alpha32", "0.25", "0.5", "41.3"], text
    assert "rougeL: their mean ROUGE-L F1" in text and "call:" not in text
    assert all(len(line) <= WIDTH for line in lines), text


def test_a_figure_of_the_catalogue_shows_as_its_column_where_a_row_has_it():
    """The answers' length in words (eval.answer_words): a column after the task columns once an experiment has it,
    named in the legend."""
    shown = copy.deepcopy(SHOWN)
    shown[1]["experiments"][0]["revs"][0]["data"]["metrics"]["metrics/eval.json"]["data"]["answer_words"] = 9.46
    text = table(experiment_rows(shown), "eval.compliance.overall", True)
    lines = text.splitlines()
    assert lines[0].split() == ["experiment", "loss", "comp", "de", "en", "final", "mgsm", "words", "merge", "changed"]
    rows = lines[2:next(i for i, line in enumerate(lines) if line.startswith("sorted by"))]
    words = {line.split()[0]: line.split()[7] for line in rows if not line.startswith(" ")}
    assert words == {"r16-alpha32": "9.46", "workspace": "-", "r16": "-", "mgsm-3": "-", "main": "-", "mgsm-2": "-",
                     "nf4": "-"}, text
    assert "; words: mean words of the held-out answers; merge:" in " ".join(text.split())  # the legend, wrapped


def test_lower_is_better_gate_puts_the_smallest_loss_first():
    names = list(changed_cells(table(experiment_rows(SHOWN), "eval.test.loss", False)))
    assert names[0] == "nf4" and names[-1] == "mgsm-2", names


def test_long_values_are_wrapped_whole_within_the_width():
    languages = ["en", "de", "es", "fr", "it", "pt", "nl", "sv", "pl", "cs", "ja", "zh", "ko", "ar", "hi", "tr"]
    name = "an-organisation-with-a-long-name/multilingual-reasoning-traces-with-a-long-name"
    changes = {"eval.languages": languages, "data.name": name, "train.sft.lr_scheduler_kwargs": {"min_lr": 1e-05}}
    shown = [{**rev("c0ffee" + "0" * 34, "main", {}, 0.86, 0.38),
              "experiments": [experiment("long", changes, 0.9, 0.35)]}]
    text = table(experiment_rows(shown), "eval.compliance.overall", True)
    cell = "".join(changed_cells(text)["long"])
    for item in (f"data.name={name}", "eval.languages=[" + ",".join(languages) + "]",
                 "train.sft.lr_scheduler_kwargs={min_lr:1e-05}"):
        assert item in cell, text
    assert all(len(line) <= WIDTH for line in text.splitlines()), text
    assert (compact(""), compact(True), compact(None), compact([])) == ('""', "true", "null", "[]")


EVALUATE = """import json, pathlib, yaml
params = yaml.safe_load(open("params.yaml"))
score = params["lora"]["r"] / 100 + len(params["eval"]["mgsm"]["languages"]) / 10
pathlib.Path("metrics").mkdir(exist_ok=True)
json.dump({"test": {"loss": 1 - score}, "compliance": {"overall": score}}, open("metrics/eval.json", "w"))
"""
DVC_YAML = """stages:
  evaluate:
    cmd: python evaluate.py
    deps: [evaluate.py]
    params: [lora, quantization, eval]
    metrics:
      - metrics/eval.json:
          cache: false
"""


@pytest.mark.e2e  # dvc exp run
def test_the_command_on_a_dvc_repository_with_real_experiments(tmp_path):
    """`python -m cli.experiments` over what DVC itself writes: the project's params.yaml, one tiny stage,
    an experiment that sets a list and one that sets two keys, the last left in the workspace."""
    repo = tmp_path / "exps"
    repo.mkdir()
    shutil.copy(ROOT / "params.yaml", repo)
    (repo / "evaluate.py").write_text(EVALUATE)
    (repo / "dvc.yaml").write_text(DVC_YAML)
    env = {"DVC_NO_ANALYTICS": "1", "PYTHONPATH": str(ROOT)}
    for cmd in (["git", "init", "-q", "-b", "main"], [sys.executable, "-m", "dvc", "init", "-q"],
                [sys.executable, "evaluate.py"], ["git", "add", "-A"], ["git", "commit", "-qm", "baseline"],
                [sys.executable, "-m", "dvc", "exp", "run", "-q", "-S", "eval.mgsm.languages=[en,fr]", "-n", "mgsm-2"],
                ["git", "checkout", "-q", "HEAD", "--", "params.yaml"],
                [sys.executable, "-m", "dvc", "exp", "run", "-q", "-S", "lora.r=16", "-S", "quantization.method=nf4",
                 "-n", "r16-nf4"]):
        run(cmd, repo, env)
    text = run([sys.executable, "-m", "cli.experiments"], repo, env)
    assert changed_cells(text) == {"workspace": ["lora.r=16", "quantization.method=nf4"],
                                   "r16-nf4": ["lora.r=16", "quantization.method=nf4"], "main": [],
                                   "mgsm-2": ["eval.mgsm.languages=[en,fr]"]}, text
    assert text.splitlines()[2].split()[:3] == ["workspace", "0.44", "0.56"], text
