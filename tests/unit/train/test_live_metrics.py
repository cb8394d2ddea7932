"""Live training metrics: rank 0 alone sends each logged step to a real MLflow server while training runs, training
outlives the server, the figures it missed land later, and register completes the very run train opened. Its
training is the suite's two-process (data-parallel) training through accelerate launch: both ranks train, rank 0
alone writes, and Liger, asked for on a machine without a GPU, is declined and recorded."""
import json
import signal
import subprocess
import sys
import time

import pytest

from conftest import run, run_env, set_params
from helpers import free_port, start_server, stop

STEPS = 16
# 16 rows a step over the 2 processes, split by train.global_batch_size into micro-batches of 4 accumulated twice in
# each; what else is checked does not depend on the batch.
SHORT = {"train.accelerate_config": "cpu_ddp", "train.sft.max_steps": STEPS, "train.global_batch_size": 16,
         "train.sft.per_device_train_batch_size": 4, "train.sft.logging_steps": 1, "train.checkpoint_steps": 0,
         "train.liger": True}
# A dead server is found dead at once; the stage's defaults give it about 30 s per attempt.
NO_RETRIES = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}


def start_training(repo, uri, log):
    """The train stage's command, as dvc.yaml has it, with two processes (DDP over gloo); its output goes to `log`."""
    with open(log, "w") as out:
        return subprocess.Popen(["accelerate", "launch", "--config_file", "configs/accelerate/cpu_ddp.yaml",
                                 "-m", "stages.train"], cwd=repo, stdout=out, stderr=subprocess.STDOUT,
                                env=run_env(MLFLOW_TRACKING_URI=uri, **NO_RETRIES))


def step_losses(client, run_id):
    return client.get_metric_history(run_id, "train.step_loss")


def wait_for_live_steps(client, train, log):
    """Poll the server until a run of the experiment has step figures; return that run's id and whether the
    training was still running when they were seen."""
    while True:
        running = train.poll() is None
        exp = client.get_experiment_by_name("lora-pipeline")
        for found in client.search_runs([exp.experiment_id]) if exp else []:
            if step_losses(client, found.info.run_id):
                return found.info.run_id, running
        if not running:
            pytest.fail(f"training ended and the server has no step figures:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)


def test_live_run_of_two_processes_outlives_the_server_and_register_completes_it(pipeline_copy, tmp_path):
    from mlflow import MlflowClient

    live_repo, store, log = pipeline_copy, tmp_path / "server", tmp_path / "train.log"
    store.mkdir()
    set_params(live_repo, **SHORT)
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server = start_server(port, store)
    try:
        client = MlflowClient(uri)
        train = start_training(live_repo, uri, log)
        run_id, running = wait_for_live_steps(client, train, log)
        assert running, "the step figures reached the server only after training had ended"
        stop(server, signal.SIGKILL)
        train.wait()
        output = log.read_text()
        assert train.returncode == 0, output[-4000:]  # trained to the end without the server
        metrics = json.loads((live_repo / "metrics/train.json").read_text())
        # one global batch = per-device batch x 2 processes: both ranks fed tokens into the count
        assert metrics["world_size"] == 2 and metrics["steps"] == STEPS and metrics["tokens"] > 0
        assert (metrics["global_batch_size"], metrics["micro_batch_size"], metrics["gradient_accumulation_steps"]) \
            == (16, 4, 2)  # the batch that ran, split for the 2 processes the launch started
        assert (live_repo / "models/adapter/adapter_model.safetensors").is_file()
        assert output.count('"trainable_params"') == 1  # rank 0 alone writes and prints the metrics
        info = json.loads((live_repo / "models/adapter/training_info.json").read_text())
        assert info["implementations"]["liger"] == {"applied": False, "kernels": [],
                                                    "reason": "Liger kernels need a CUDA GPU; none is present"}
        assert "Liger requested but not applied" in output and metrics["liger_applied"] == 0
        state = json.loads((live_repo / "logs/train_mlflow.json").read_text())
        records = [json.loads(line) for line in (live_repo / "logs/train_metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # rank 0's alone, once each
        assert state["run_id"] == run_id and state["sent"] < STEPS
        assert f"{STEPS - state['sent']} of {STEPS} step records kept in logs/train_metrics.jsonl" in output

        server = start_server(port, store)
        [only] = client.search_runs([client.get_experiment_by_name("lora-pipeline").experiment_id])
        assert only.info.run_id == run_id  # one run for both processes
        run([sys.executable, "-m", "stages.register"], live_repo, env={"MLFLOW_TRACKING_URI": uri})
        assert json.loads((live_repo / "models/registered.json").read_text())["run_id"] == run_id
        done = client.get_run(run_id)  # the run train opened, completed
        assert done.info.status == "FINISHED" and done.data.tags["registered_version"] == "1"
        assert client.get_model_version("lora-pipeline", "1").run_id == run_id
        assert "eval.compliance.overall" in done.data.metrics and done.data.params["lora.r"] == "8"
        assert int(done.data.tags["train_records_late"]) == STEPS - state["sent"]
        assert {m.step for m in step_losses(client, run_id)} == set(range(1, STEPS + 1))  # every step, late or not
        for name in ("learning_rate", "grad_norm", "tokens_per_s"):
            assert f"train.step_{name}" in done.data.metrics
        assert done.data.metrics["train.step_tokens_per_s"] > 0
        assert (done.data.metrics["train.global_batch_size"], done.data.metrics["train.micro_batch_size"],
                done.data.metrics["train.gradient_accumulation_steps"]) == (16, 4, 2)
        assert json.loads((live_repo / "logs/train_mlflow.json").read_text())["sent"] == STEPS
    finally:
        stop(server)


def test_records_wait_on_disk_when_no_server_answers(tmp_path, monkeypatch):
    from lora_pipeline.train.tracking import LiveRun

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


def test_a_resumed_training_goes_on_in_the_same_run(tmp_path, monkeypatch):
    import mlflow
    from lora_pipeline.train.tracking import HTTP_DEFAULTS, LiveRun

    monkeypatch.chdir(tmp_path)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for key, value in {"MLFLOW_TRACKING_URI": store, **HTTP_DEFAULTS}.items():
        monkeypatch.setenv(key, value)
    client = mlflow.MlflowClient(store)
    first = LiveRun("lora-pipeline", "fingerprint", tmp_path)
    first.record(1, {"loss": 2.0})
    first.record(2, {"loss": 1.5})
    assert first.finish("KILLED") is None
    run_id = first.state["run_id"]
    assert client.get_run(run_id).info.status == "KILLED"
    with open("logs/train_metrics.jsonl", "a") as f:
        f.write('{"step": 3, "ti')  # killed in the middle of a line

    second = LiveRun("lora-pipeline", "fingerprint", tmp_path)  # the same training, resumed
    second.record(3, {"loss": 1.0})
    assert second.finish("FINISHED", adapter_hash="abc") is None
    assert second.state["run_id"] == run_id and client.get_run(run_id).info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run_id, "train.step_loss")] == [1, 2, 3]

    third = LiveRun("lora-pipeline", "fingerprint", tmp_path)  # trained again after it finished: a run of its own
    assert third.finish("FINISHED") is None and third.state["run_id"] != run_id


def test_records_go_in_batches_and_each_delivered_batch_is_counted():
    from lora_pipeline.train.tracking import log_records

    class Client:  # takes two batches, then the server is gone
        def __init__(self):
            self.batches = []

        def log_batch(self, run_id, metrics, synchronous):
            if len(self.batches) == 2:
                raise ConnectionError("gone")
            self.batches.append(metrics)

    records = [{"step": s, "time": s, "metrics": {"loss": 1.0, "learning_rate": 0.1}} for s in range(250)]
    client, delivered = Client(), []
    with pytest.raises(ConnectionError):
        log_records(client, "run", records, delivered.append)
    assert delivered == [100, 100]  # what the server took before it failed, and no more
    assert [len(b) for b in client.batches] == [200, 200]
    assert client.batches[1][0].key == "train.step_loss" and client.batches[1][0].step == 100
