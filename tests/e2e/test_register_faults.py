"""register against a real MLflow server that dies mid-run: a bounded one-line error, the previous output kept, and
after a restart exactly one registration; credentials and machine paths never reach tracked files or logs."""
import json
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run, run_env
from helpers import free_port, start_server, stop

pytestmark = pytest.mark.e2e  # every test here runs the pipeline, DVC or an MLflow server

PASSWORD = "s3cret-Pa55"
# Few, short retries keep the test quick; the stage's own defaults bound a real outage to about 30 s.
FAST_RETRIES = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}


def runs_tagged(store: Path, key: str) -> list[tuple[str, str, str]]:
    """(run id, status, tag value) of every run with tag `key`, read from the server's own store."""
    with sqlite3.connect(store / "server.db") as db:
        return db.execute("SELECT runs.run_uuid, runs.status, tags.value FROM runs JOIN tags "
                          "ON runs.run_uuid = tags.run_uuid WHERE tags.key = ?", (key,)).fetchall()


def test_server_killed_mid_register_then_one_registration(pipeline_copy, tmp_path):
    import mlflow

    repo = pipeline_copy
    port = free_port()
    uri = f"http://alice:{PASSWORD}@127.0.0.1:{port}"
    saved = (repo / "models/registered.json").read_bytes()
    server = start_server(port, tmp_path)
    try:
        register = subprocess.Popen([sys.executable, "-m", "stages.register"], cwd=repo, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    env=run_env(MLFLOW_TRACKING_URI=uri, **FAST_RETRIES))
        while not runs_tagged(tmp_path, "pipeline_md5"):  # the run exists: register is under way
            assert register.poll() is None, register.stdout.read()
            time.sleep(0.05)
        stop(server, signal.SIGKILL)
        output = register.communicate(timeout=300)[0]
        assert register.returncode == 1, output
        error = output.strip().splitlines()[-1]
        assert error.startswith(f"register: MLflow at http://alice:***@127.0.0.1:{port} unreachable"), output
        assert PASSWORD not in output
        assert (repo / "models/registered.json").read_bytes() == saved
        [(_, status, pipeline_md5)] = runs_tagged(tmp_path, "pipeline_md5")
        assert status == "RUNNING" and not runs_tagged(tmp_path, "registered_version")  # half-logged

        server = start_server(port, tmp_path)
        output = run([sys.executable, "-m", "stages.register"], repo, env={"MLFLOW_TRACKING_URI": uri})
        assert PASSWORD not in output and "lora-pipeline v1: no champion yet" in output
        again = run([sys.executable, "-m", "stages.register"], repo, env={"MLFLOW_TRACKING_URI": uri})
        assert "nothing to log" in again

        statuses = sorted(status for _, status, value in runs_tagged(tmp_path, "pipeline_md5") if value == pipeline_md5)
        assert statuses == ["FAILED", "FINISHED"]
        mlflow.set_tracking_uri(f"http://127.0.0.1:{port}")
        client = mlflow.MlflowClient()
        assert [v.version for v in client.search_model_versions("name = 'lora-pipeline'")] == ["1"]
        text = (repo / "models/registered.json").read_text()
        assert PASSWORD not in text and json.loads(text)["tracking_uri"] == f"http://alice:***@127.0.0.1:{port}"
        finished = client.get_run(json.loads(text)["run_id"])
        assert PASSWORD not in json.dumps([finished.data.params, finished.data.tags])
    finally:
        stop(server)


def test_register_under_dvc_repro_with_the_server_down_keeps_its_record(pipeline_copy):
    """DVC removes a stage's outputs before it runs it, unless they persist: register's output (persist) and its
    record of this store (no DVC output) stay as they were."""
    repo = pipeline_copy
    saved = {path: (repo / path).read_bytes() for path in ("models/registered.json", "models/registration.json")}
    proc = subprocess.run(["dvc", "repro", "--force", "--single-item", "register"], cwd=repo, capture_output=True,
                          text=True, env=run_env(MLFLOW_TRACKING_URI="http://127.0.0.1:9", **FAST_RETRIES))
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in output, output
    assert "register: MLflow at http://127.0.0.1:9 unreachable" in output, output
    assert "models/registered.json left as it was, re-run when the server is back" in output, output
    assert {path: (repo / path).read_bytes() for path in saved} == saved


def test_registered_json_holds_no_machine_paths(repo):
    repo, _ = repo
    text = (repo / "models/registered.json").read_text()
    assert json.loads(text)["tracking_uri"] == "sqlite:///mlflow.db"
    assert str(repo) not in text and str(Path.home()) not in text and '"/' not in text


def test_train_speed_is_logged_but_no_dependency(repo):
    import mlflow

    repo, _ = repo
    speed = json.loads((repo / "logs/train_speed.json").read_text())
    mlflow.set_tracking_uri(f"sqlite:///{repo / 'mlflow.db'}")
    client = mlflow.MlflowClient()
    run_ = client.get_run(json.loads((repo / "models/registered.json").read_text())["run_id"])  # the latest run
    assert run_.data.metrics["speed.tokens_per_s"] == speed["tokens_per_s"]
    assert "train_speed.json" in [a.path for a in client.list_artifacts(run_.info.run_id)]
    (repo / "logs/train_speed.json").write_text(json.dumps({**speed, "tokens_per_s": 1.0}))
    try:
        assert "register" not in run(["dvc", "status", "register"], repo)  # timings changed, nothing to re-run
    finally:
        (repo / "logs/train_speed.json").write_text(json.dumps(speed))
