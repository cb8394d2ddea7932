"""Live training metrics: rank 0 alone sends each logged step to a real MLflow server while training runs, training
outlives the server, the figures it missed land later, and register completes the very run train opened."""
import json
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import run, run_env, set_params
from test_register_faults import free_port, start_server, stop

STEPS = 30
SHORT = {"train.sft.max_steps": STEPS, "train.sft.logging_steps": 1, "train.checkpoint_steps": 0}
# A dead server is found dead at once; the stage's defaults give it about 30 s per attempt.
NO_RETRIES = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}


@pytest.fixture(scope="module")
def live_repo(repo, tmp_path_factory):
    """A copy of the reproduced pipeline (no MLflow store) whose training is 30 logged steps."""
    source, _ = repo
    copy = tmp_path_factory.mktemp("live") / "repo"
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("cache", "mlflow.db", "mlartifacts"))
    set_params(copy, **SHORT)
    return copy


def start_training(repo, uri, config):
    set_params(repo, **{"train.accelerate_config": config})
    return subprocess.Popen(["accelerate", "launch", "--config_file", f"configs/accelerate/{config}.yaml",
                             "-m", "stages.train"], cwd=repo, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=run_env(MLFLOW_TRACKING_URI=uri, **NO_RETRIES))


def step_losses(client, run_id):
    return client.get_metric_history(run_id, "train.step_loss")


def wait_for_live_steps(client, train):
    """Poll the server until a run of the experiment has step figures; return that run's id and whether the
    training was still running when they were seen."""
    while True:
        running = train.poll() is None
        exp = client.get_experiment_by_name("lora-pipeline")
        for found in client.search_runs([exp.experiment_id]) if exp else []:
            if step_losses(client, found.info.run_id):
                return found.info.run_id, running
        if not running:
            pytest.fail(f"training ended and the server has no step figures:\n{train.stdout.read()[-4000:]}")
        time.sleep(0.2)


def test_two_processes_one_live_run(live_repo, tmp_path):
    from mlflow import MlflowClient

    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server = start_server(port, tmp_path)
    try:
        client = MlflowClient(uri)
        train = start_training(live_repo, uri, "cpu_ddp")
        run_id, running = wait_for_live_steps(client, train)
        output = train.communicate()[0]
        assert train.returncode == 0, output[-4000:]
        assert running, "the step figures reached the server only after training had ended"
        assert json.loads((live_repo / "metrics/train.json").read_text())["world_size"] == 2
        [only] = client.search_runs([client.get_experiment_by_name("lora-pipeline").experiment_id])
        assert only.info.run_id == run_id and only.info.status == "FINISHED"
        assert [m.step for m in step_losses(client, run_id)] == list(range(1, STEPS + 1))  # rank 0's, once each
        for name in ("learning_rate", "grad_norm", "tokens_per_s"):
            assert f"train.step_{name}" in only.data.metrics
        assert only.data.metrics["train.step_tokens_per_s"] > 0
    finally:
        stop(server)


def test_training_outlives_the_server_and_register_completes_its_run(live_repo, tmp_path):
    from mlflow import MlflowClient

    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server = start_server(port, tmp_path)
    try:
        client = MlflowClient(uri)
        train = start_training(live_repo, uri, "cpu")
        run_id, running = wait_for_live_steps(client, train)
        stop(server, signal.SIGKILL)
        output = train.communicate()[0]
        assert train.returncode == 0, output[-4000:]  # trained to the end without the server
        state = json.loads((live_repo / "logs/train_mlflow.json").read_text())
        records = (live_repo / "logs/train_metrics.jsonl").read_text().splitlines()
        assert len(records) == STEPS and state["run_id"] == run_id and state["sent"] < STEPS
        assert f"{STEPS - state['sent']} of {STEPS} step records kept in logs/train_metrics.jsonl" in output

        server = start_server(port, tmp_path)
        run([sys.executable, "-m", "stages.register"], live_repo, env={"MLFLOW_TRACKING_URI": uri})
        registered = json.loads((live_repo / "models/registered.json").read_text())
        assert registered["run_id"] == run_id  # the run train opened, completed
        done = client.get_run(run_id)
        assert done.info.status == "FINISHED" and done.data.tags["registered_version"] == "1"
        assert "eval.compliance.overall" in done.data.metrics and done.data.params["lora.r"] == "8"
        assert client.get_model_version("lora-pipeline", "1").run_id == run_id
        assert int(done.data.tags["train_records_late"]) == STEPS - state["sent"]
        assert {m.step for m in step_losses(client, run_id)} == set(range(1, STEPS + 1))  # every step, late or not
        assert json.loads((live_repo / "logs/train_mlflow.json").read_text())["sent"] == STEPS
    finally:
        stop(server)


def test_records_wait_on_disk_when_no_server_answers(tmp_path, monkeypatch):
    from lora_pipeline.tracking import LiveRun

    monkeypatch.chdir(tmp_path)
    for key, value in {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{free_port()}", **NO_RETRIES,
                       "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}.items():
        monkeypatch.setenv(key, value)
    live = LiveRun("lora-pipeline", "fingerprint", tmp_path)
    for step in (1, 2, 3):
        live.record(step, {"loss": 1.0 / step})
    note = live.finish("FINISHED", adapter_hash="abc")
    assert "Connection refused" in note and "3 of 3 step records kept in logs/train_metrics.jsonl" in note
    state = json.loads((tmp_path / "logs/train_mlflow.json").read_text())
    assert state["sent"] == 0 and state["run_id"] is None and state["finished"] and state["adapter"] == "abc"
    records = [json.loads(line) for line in (tmp_path / "logs/train_metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and records[2]["metrics"] == {"loss": 1 / 3}
