"""MLflow: one run per pipeline run with provenance tags, the champion loads through pyfunc and generates,
and the same stage against a real MLflow tracking server."""
import json
import re
import subprocess
import sys

import pytest
import yaml

from conftest import edited_params, run
from helpers import free_port, start_server, stop

pytestmark = pytest.mark.e2e  # every test here runs the pipeline, DVC or an MLflow server


def test_run_has_provenance_and_step_metrics(repo):
    import mlflow
    from mlflow import MlflowClient

    repo, _ = repo
    mlflow.set_tracking_uri(f"sqlite:///{repo / 'mlflow.db'}")
    client = MlflowClient()
    run_ = client.get_run(client.get_model_version("lora-pipeline", "1").run_id)  # the default's run
    lock = subprocess.run(["git", "show", "HEAD:dvc.lock"], cwd=repo, capture_output=True, text=True).stdout
    assert run_.data.tags["git_commit"] and len(run_.data.tags["git_commit"]) == 40
    assert run_.data.tags["model_md5"] and run_.data.tags["model_md5"] in lock
    assert run_.data.tags["md5.data/split"] in lock
    assert run_.data.params["lora.r"] == "8"
    assert "eval.compliance.overall" in run_.data.metrics and "eval.test.loss" in run_.data.metrics
    steps = client.get_metric_history(run_.info.run_id, "train.step_loss")
    assert len(steps) > 5 and steps[0].step < steps[-1].step
    # the run the train stage opened and fed while training, completed by register
    assert run_.data.tags["train_fingerprint"] and "train.step_tokens_per_s" in run_.data.metrics
    assert run_.data.tags["gate.decision"] == "champion"
    assert run_.data.tags["dvc_exp_name"] == "workspace"  # `dvc repro`, not an experiment
    experiment = client.get_run(client.get_model_version("lora-pipeline", "2").run_id)  # dvc exp run -n r16
    assert experiment.data.tags["dvc_exp_name"] == "r16" and experiment.info.run_name == "r16"
    assert experiment.data.params["lora.r"] == "16"


def answers_like_a_chat_model(model, prompt: str):
    """Only the new text, reasoning apart from the answer, the same twice (greedy by default)."""
    out = model.predict([prompt], params={"max_new_tokens": 24})
    assert list(out.columns) == ["text", "reasoning", "answer"] and len(out) == 1
    prompt_text = re.sub(r"<\|[a-z_]+\|>", "", prompt).strip()  # what echoing the prompt would begin with
    assert out.loc[0, "text"].strip() and not out.loc[0, "text"].startswith(prompt_text[:12])
    assert "<think>" not in out.loc[0, "reasoning"] + out.loc[0, "answer"]
    assert out.equals(model.predict([prompt], params={"max_new_tokens": 24}))
    assert len(model.predict([prompt], params={"max_new_tokens": 2}).loc[0, "text"]) < len(out.loc[0, "text"])


def test_champion_loads_through_pyfunc_and_generates(repo):
    import mlflow
    from transformers import AutoTokenizer

    repo, _ = repo
    mlflow.set_tracking_uri(f"sqlite:///{repo / 'mlflow.db'}")
    model = mlflow.pyfunc.load_model("models:/lora-pipeline@champion")
    tokenizer = AutoTokenizer.from_pretrained(repo / "models/merged")
    prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": "reasoning language: German"},
         {"role": "user", "content": "Anna hat 5 Äpfel und kauft 3 dazu. Wie viele Äpfel hat sie?"}],
        tokenize=False, add_generation_prompt=True)
    answers_like_a_chat_model(model, prompt)
    declared = {param.name for param in model.metadata.get_params_schema().params}
    assert declared == {"max_new_tokens", "do_sample", "temperature", "top_p"}
    # the most prompts a request may hold, kept with the model for wherever it is served
    serve_batch_size = yaml.safe_load((repo / "params.yaml").read_text())["register"]["serve_batch_size"]
    assert model.model_config["serve_batch_size"] == serve_batch_size


def test_version_describes_its_model_data_params_and_figures(repo):
    import mlflow

    repo, _ = repo
    mlflow.set_tracking_uri(f"sqlite:///{repo / 'mlflow.db'}")
    client = mlflow.MlflowClient()
    version = client.get_model_version("lora-pipeline", "1")
    run_ = client.get_run(version.run_id)
    lines = dict(line.split(": ", 1) for line in version.description.splitlines())
    assert lines["Base model"] == "built in (tiny-qwen2)" and lines["Data"] == "built in (builtin)"
    assert "r=8" in lines["LoRA"].split(", ") and "sft.learning_rate=" in lines["Training"]
    assert f"compliance.overall={run_.data.metrics['eval.compliance.overall']:.4g}" in lines["Evaluation"]
    assert lines["Git commit"] == run_.data.tags["git_commit"]


def test_register_against_a_tracking_server(pipeline_copy, tmp_path):
    import mlflow

    repo, store = pipeline_copy, tmp_path / "server"
    port = free_port()
    server = start_server(port, store)
    uri = f"http://127.0.0.1:{port}"
    try:
        # tokens in the environment (the server ignores them) must reach neither the run nor any output
        secrets = {"HF_TOKEN": "hf_fakeTOKEN4tests", "MLFLOW_TRACKING_USERNAME": "alice",
                   "MLFLOW_TRACKING_PASSWORD": "fake-PASSWORD-4tests"}
        output = run([sys.executable, "-m", "stages.register"], repo, env={"MLFLOW_TRACKING_URI": uri, **secrets})
        assert "lora-pipeline v1: no champion yet" in output
        registered = json.loads((repo / "models/registered.json").read_text())
        assert registered["tracking_uri"] == uri and "champion" in registered["aliases"]
        mlflow.set_tracking_uri(uri)
        logged = mlflow.MlflowClient().get_run(registered["run_id"]).data
        assert logged.params["lora.r"] == str(yaml.safe_load((repo / "params.yaml").read_text())["lora"]["r"])
        assert logged.tags["model_md5"]
        shown = [output, json.dumps(registered), json.dumps(logged.params), json.dumps(logged.tags)]
        stored = [path.read_bytes() for path in store.rglob("*") if path.is_file()]  # the server's db, artifacts
        for secret in (secrets["HF_TOKEN"], secrets["MLFLOW_TRACKING_PASSWORD"]):
            assert not any(secret in text for text in shown), secret
            assert not any(secret.encode() in data for data in stored), secret
        version = mlflow.MlflowClient().get_model_version_by_alias("lora-pipeline", "champion")
        assert version.version == "1"
        model = mlflow.pyfunc.load_model("models:/lora-pipeline@champion")
        out = model.predict(["<|im_start|>user\nHallo<|im_end|>\n<|im_start|>assistant\n"], params={"max_new_tokens": 4})
        assert isinstance(out.loc[0, "text"], str)
    finally:
        stop(server)


def test_adapter_mode_registers_a_pyfunc_that_loads_its_base(repo, tmp_path):
    """For models too big to copy: only the adapter is logged, with a reference to its base."""
    import mlflow

    repo, _ = repo
    saved = (repo / "models/registered.json").read_text()
    try:
        with edited_params(repo, **{"register.log_mode": "adapter", "register.model_name": "lora-adapter"}):
            output = run([sys.executable, "-m", "stages.register"], repo)
        assert "lora-adapter v1: no champion yet" in output
        mlflow.set_tracking_uri(f"sqlite:///{repo / 'mlflow.db'}")
        model = mlflow.pyfunc.load_model("models:/lora-adapter@champion")
        answers_like_a_chat_model(model, "<|im_start|>system\nreasoning language: German<|im_end|>\n<|im_start|>user\n"
                                         "Anna hat 5 Äpfel.<|im_end|>\n<|im_start|>assistant\n")
    finally:
        (repo / "models/registered.json").write_text(saved)


# `python -m stages.register`, then the top-level packages it imported, on one line.
REGISTER_THEN_IMPORTED = ("import atexit, runpy, sys\n"
                          "atexit.register(lambda: print('imported:', *sorted({m.split('.')[0] for m in sys.modules})))\n"
                          "runpy.run_module('stages.register', run_name='__main__', alter_sys=True)")


def test_register_imports_no_model_library(pipeline_copy, tmp_path):
    """register logs and registers the model files as they are on disk: it loads no model, so it imports neither
    torch nor transformers nor peft (their import alone takes seconds), logging a new model included."""
    store = f"sqlite:///{tmp_path / 'store.db'}"  # a store of its own: the whole registration, model logged
    output = run([sys.executable, "-c", REGISTER_THEN_IMPORTED], pipeline_copy, env={"MLFLOW_TRACKING_URI": store})
    assert "lora-pipeline v1: no champion yet" in output
    imported = set(re.search(r"^imported: (.*)$", output, re.M).group(1).split())
    assert "mlflow" in imported
    assert not imported & {"torch", "transformers", "peft", "trl", "accelerate", "datasets", "bitsandbytes"}
