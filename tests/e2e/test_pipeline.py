"""The whole pipeline, for real, on the tiny default: dvc repro, an experiment, MLflow, and the champion."""
import json
import re
import subprocess
import sys

import pytest

from conftest import MGSM, edited_params, run, run_env

pytestmark = pytest.mark.e2e  # every test here runs the pipeline, DVC or an MLflow server

STAGES = ["validate", "fetch", "split", "train", "merge", "evaluate_base", "evaluate", "register"]


def ran_stages(output: str) -> list[str]:
    return re.findall(r"Running stage '([\w-]+)'", output)


def test_repro_runs_every_stage_and_learns(repo):
    repo, output = repo
    assert ran_stages(output) == STAGES
    for path in ["data/raw/data.jsonl", "data/split/train.jsonl", "models/base/config.json",
                 "models/adapter/adapter_config.json", "models/merged/model.safetensors", "reports/demo.txt",
                 "reports/report.png", "plots/train_loss.csv", "plots/compliance/base.csv",
                 "plots/compliance/finetuned.csv"]:
        assert (repo / path).is_file(), path
    train = json.loads((repo / "metrics/train.json").read_text())
    merge = json.loads((repo / "metrics/merge.json").read_text())
    ev = json.loads((repo / "metrics/eval.json").read_text())
    assert train["world_size"] == 1 and train["steps"] > 0
    assert merge["max_abs_logit_diff"] < 1e-3
    # every weight checked: the adapted ones within float32's rounding of base + delta, the others the base's
    assert merge["weights"]["adapted"] > 0 and merge["weights"]["unchanged"] > 0, merge
    assert merge["weights"]["max_error_over_bound"] <= 1 and merge["weights"]["delta_kept"] > 0.99, merge
    # fine-tuning learned: held-out loss well below the base model's
    assert ev["test"]["loss"] < 0.7 * ev["base"]["test"]["loss"], ev
    assert set(ev["compliance"]) == {"en", "de", "es", "fr", "it", "overall"}
    # accuracy: the share of the held-out answers that reports/generations.jsonl marks correct
    generations = [json.loads(line) for line in (repo / "reports/generations.jsonl").read_text().splitlines()]
    answered = [r["correct"] for r in generations if r["set"] == "heldout" and "correct" in r]
    assert answered and ev["accuracy"]["builtin"] == sum(answered) / len(answered)
    demo = (repo / "reports/demo.txt").read_text()
    assert "¿Cuál es el capital de Australia?" in demo and "== base model ==" in demo
    losses = (repo / "plots/train_loss.csv").read_text().splitlines()
    assert losses[0].startswith("step,loss") and len(losses) > 5
    # each stage with model work records its start-up from `python -m lora_pipeline.launch` to its own code
    for log in ("train_speed", "merge_speed", "evaluate_base", "evaluate"):
        startup = json.loads((repo / f"logs/{log}.json").read_text())["startup_seconds"]
        assert isinstance(startup, float) and startup > 0, (log, startup)


def test_repro_scores_mgsm_in_each_language(repo):
    """The fixture points eval.mgsm.path at the shared MGSM copy when there is one; without it MGSM is not scored."""
    if not MGSM.is_dir():
        pytest.skip(f"no MGSM at {MGSM}: eval.mgsm is not scored")
    repo, _ = repo
    ev = json.loads((repo / "metrics/eval.json").read_text())
    assert set(ev["accuracy"]["mgsm"]) == {"en", "de", "es", "fr", "overall"}


def test_nothing_changed_runs_nothing(repo):
    repo, _ = repo
    before = (repo / "models/registered.json").read_text()
    output = run(["dvc", "repro"], repo)
    assert ran_stages(output) == []
    assert (repo / "models/registered.json").read_text() == before


def test_moving_the_default_gate_re_runs_only_validate_and_register(repo):
    """The gate's rule lives in lora_pipeline/registry/gate.py, which only validate and register depend on: the
    built-in data's default gate moved to another figure leaves every other stage as it was."""
    repo, _ = repo
    module = repo / "lora_pipeline/registry/gate.py"
    original = module.read_text()
    moved = original.replace('BUILTIN_GATE, HELD_OUT_GATE = "eval.compliance.overall"',
                             'BUILTIN_GATE, HELD_OUT_GATE = "eval.final_language_rate"')
    assert moved != original
    module.write_text(moved)
    try:
        status = json.loads(run(["dvc", "status", "--json"], repo))
    finally:
        module.write_text(original)
    assert sorted(status) == ["register", "validate"], status


def test_register_is_idempotent_for_the_same_model(repo):
    repo, _ = repo
    first = json.loads((repo / "models/registered.json").read_text())
    assert first["version"] == 1 and set(first["aliases"]) == {"candidate", "champion"}
    output = run(["dvc", "repro", "-f", "-s", "register"], repo)
    assert "already holds these outputs" in output
    again = json.loads((repo / "models/registered.json").read_text())
    assert again["version"] == 1 and again["run_id"] == first["run_id"]


def test_bad_param_fails_first_and_keeps_every_output(repo):
    repo, _ = repo
    before = {p: (repo / p).read_bytes() for p in ("models/adapter/adapter_model.safetensors", "metrics/train.json",
                                                   "plots/train_loss.csv", "metrics/eval.json")}
    proc = subprocess.run(["dvc", "exp", "run", "-S", "lora.r=0"], cwd=repo, capture_output=True, text=True,
                          env=run_env())
    assert proc.returncode != 0
    assert "lora.r: Input should be greater than or equal to 1 (got 0)" in proc.stdout + proc.stderr
    assert ran_stages(proc.stdout + proc.stderr) == ["validate"]
    assert {p: (repo / p).read_bytes() for p in before} == before
    run(["git", "checkout", "params.yaml"], repo)


def test_experiment_reruns_only_what_lora_r_affects(repo):
    repo, _ = repo
    # lora.r alone: validate (which checks every params change) and train; the stages after train re-run once
    # train's outputs change
    with edited_params(repo, **{"lora.r": 16}):
        status = json.loads(run(["dvc", "status", "--json"], repo))
    assert sorted(status) == ["train", "validate"], status
    # The experiment trains 20 steps instead of the default's three epochs (max_steps, a train param as lora.r is):
    # the same stages re-run, in less time.
    output = run(["dvc", "exp", "run", "-S", "lora.r=16", "-S", "train.sft.max_steps=20", "-n", "r16"], repo)
    # validate checks every params change first; of the pipeline's work, only what lora.r affects re-runs
    assert ran_stages(output) == ["validate", "train", "merge", "evaluate", "register"]
    for skipped in ("fetch", "split", "evaluate_base"):  # the base is evaluated once, not per adapter
        assert f"Stage '{skipped}' didn't change, skipping" in output
    registered = json.loads((repo / "models/registered.json").read_text())
    assert registered["version"] == 2 and "candidate" in registered["aliases"]
    # @champion moves to v2 only if its gate metric (compliance) beats v1's
    v1 = json.loads(run(["git", "show", "HEAD:metrics/eval.json"], repo))["compliance"]["overall"]
    v2 = json.loads((repo / "metrics/eval.json").read_text())["compliance"]["overall"]
    assert registered["gate"]["champion_value"] == v1 and registered["gate"]["promote"] == (v2 > v1)
    assert ("champion" in registered["aliases"]) == (v2 > v1)
    shown = json.loads(run(["dvc", "exp", "show", "--json"], repo))
    rows = {}
    for commit in shown:
        rows[commit["rev"]] = commit
        for exp in commit.get("experiments") or []:
            for rev in exp.get("revs", []):
                rows[exp.get("name") or rev["rev"]] = rev
    assert "r16" in rows, list(rows)
    data = rows["r16"]["data"]
    assert data["params"]["params.yaml"]["data"]["lora"]["r"] == 16
    assert "compliance" in data["metrics"]["metrics/eval.json"]["data"]
    # the baseline commit keeps r=8 and its own metrics
    baseline = next(c for c in shown if c["rev"] != "workspace")
    assert baseline["data"]["params"]["params.yaml"]["data"]["lora"]["r"] == 8
    assert "test" in baseline["data"]["metrics"]["metrics/eval.json"]["data"]


def test_curated_view_lines_up_the_experiments_in_120_columns(repo):
    repo, _ = repo
    output = run([sys.executable, "-m", "cli.experiments"], repo)
    lines = output.splitlines()
    assert all(len(line) <= 120 for line in lines), output
    assert lines[0].startswith("experiment") and "comp" in lines[0] and "loss" in lines[0]
    assert any(line.startswith("r16 ") and "r=16" in line for line in lines), output


@pytest.mark.parametrize("lever, value, also", [
    ("train.liger", True, []),
    ("train.sft.padding_free", True, []),
    ("train.sft.torch_compile", True, []),
    ("train.sft.gradient_checkpointing", True, []),
    ("train.sft.per_device_train_batch_size", 8, []),
    ("train.sft.max_grad_norm", 0.5, []),  # any SFTConfig field, not only those params.yaml lists
    ("model.attn_implementation", "flex_attention", ["evaluate", "evaluate_base", "merge"]),
    ("model.experts_implementation", "grouped_mm", ["evaluate", "evaluate_base", "merge"]),
])
def test_speed_levers_touch_train_onward_and_nothing_before(repo, lever, value, also):
    repo, _ = repo
    with edited_params(repo, **{lever: value}):
        status = json.loads(run(["dvc", "status", "--json"], repo))
    assert "train" in status and "fetch" not in status and "split" not in status, status
    # merge and evaluate re-run once train's outputs change; before that only a change of their own params shows
    assert sorted(set(status) & {"merge", "evaluate", "evaluate_base"}) == also, status


def test_new_evaluation_of_the_same_model_logs_a_run_but_no_version(repo):
    import mlflow

    repo, _ = repo
    before = json.loads((repo / "models/registered.json").read_text())
    with edited_params(repo, **{"eval.prompts": 4}):
        output = run(["dvc", "repro"], repo)
    assert ran_stages(output) == ["validate", "evaluate_base", "evaluate", "register"]
    after = json.loads((repo / "models/registered.json").read_text())
    assert after["version"] == before["version"] and after["run_id"] != before["run_id"]
    assert after["gate"]["reason"] == f"model already registered as v{before['version']}"
    mlflow.set_tracking_uri(f"sqlite:///{repo / 'mlflow.db'}")
    client = mlflow.MlflowClient()
    versions = client.search_model_versions("name = 'lora-pipeline'")
    assert len(versions) == 2  # the default's and r16's
    # the training's own run was completed by the first register: this one is new and links to it
    assert client.get_run(after["run_id"]).data.tags["train_run_id"] == before["run_id"]
