"""register: completes this pipeline run's MLflow run (tags, params, metrics, per-step figures) and registers the model.

    python -m stages.register
The run is the one the train stage opened for the adapter on disk (logs/train_mlflow.json), when this server has it
and no register completed it yet; step records the train stage could not deliver are sent to it first. Otherwise
(register re-run alone, e.g. only eval or gate params changed; a training restored from DVC's cache; another
server) a new run, tagged train_run_id when the train run is on this server, with the per-step figures again.
The new version gets the alias `candidate`; it becomes `champion` only if register.gate_metric beats the
current champion's. Outputs already logged (same md5s in dvc.lock) log nothing; a new run whose model is
already registered (e.g. only eval params changed) logs its run and links the existing version. An unreachable
server fails the stage in bounded time with one line, models/registered.json untouched (persist in dvc.yaml).
models/registered.json describes this machine's store: it is in neither git nor a DVC remote, so in a clone, where
it is missing, `dvc repro` runs this stage, which registers the model in the clone's own store.
"""
import csv
import hashlib
import json
import os
import time
from pathlib import Path

# Everything registered is on disk; offline, MLflow does not wait on the Hub for a model card it cannot use.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlflow
from mlflow import MlflowClient

from lora_pipeline import registry, serving, tracking
from lora_pipeline.outputs import write_json
from lora_pipeline.params import ROOT, flat_keys, load_params
from lora_pipeline.stage_outputs import METRICS

LOSS_LOG, ARTIFACTS = Path("plots/train_loss.csv"), [Path("reports/demo.txt"), Path("reports/report.png")]
SPEED = Path("logs/train_speed.json")  # timings of the train stage: logged when present, never a DVC dependency
OUT, ADAPTER = Path("models/registered.json"), Path("models/adapter")


def csv_records(path: Path) -> list[dict]:
    """The train stage's per-step log as step records, for a run that has no live record of this training."""
    now = int(time.time() * 1000)
    with open(path) as f:
        return [{"step": int(row.pop("step")), "time": now, "metrics": {k: float(v) for k, v in row.items() if v}}
                for row in csv.DictReader(f)]


def continuable(run, pipeline_md5: str) -> bool:
    """The train run is this pipeline run's to complete: no register finished it, nor began it for other outputs."""
    return "registered_version" not in run.data.tags and run.data.tags.get("pipeline_md5", pipeline_md5) == pipeline_md5


def start_pipeline_run(client, uri, reg, pipeline_md5, tags):
    """The train stage's run continued, or a new run with the step records (see the module docstring)."""
    training = tracking.finished_training(client, uri, ROOT, reg.experiment, ADAPTER)
    state, records, train_run = training or (None, csv_records(LOSS_LOG), None)
    if train_run is not None:
        tracking.deliver_late(client, state, records, train_run.info.run_id)
        if continuable(train_run, pipeline_md5):
            return mlflow.start_run(run_id=train_run.info.run_id)
        tags["train_run_id"] = train_run.info.run_id
    run = mlflow.start_run(run_name=os.environ.get("DVC_EXP_NAME"))
    tracking.log_records(client, run.info.run_id, records)
    return run


def log_run(client, uri, params, metrics, md5s, run_params, pipeline_md5, model_dir):
    """This pipeline run's run completed; registers the model unless a finished run already did. -> (run id, version,
    gate decision)"""
    reg = params.register
    model_md5 = md5s.get(model_dir, "")
    tags = {"git_commit": registry.git_commit(ROOT), "dvc_exp_name": os.environ.get("DVC_EXP_NAME", "workspace"),
            "model_md5": model_md5, "pipeline_md5": pipeline_md5, **{f"md5.{path}": md5 for path, md5 in md5s.items()}}
    run = start_pipeline_run(client, uri, reg, pipeline_md5, tags)
    mlflow.set_tags(tags)
    mlflow.log_params({k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in run_params.items()})
    mlflow.log_metrics(metrics)
    if SPEED.is_file():
        mlflow.log_metrics(registry.speed_metrics(json.loads(SPEED.read_text())))
        mlflow.log_artifact(str(SPEED))
    for artifact in ARTIFACTS:
        if artifact.is_file():
            mlflow.log_artifact(str(artifact))
    version = registry.find_version_by_tag(client, reg.model_name, "model_md5", model_md5)
    if version is not None and registry.run_completed(client, version.run_id):  # e.g. only eval params changed
        decision = {"promote": False, "reason": f"model already registered as v{version.version}"}
    else:  # a new model, or one whose registration was interrupted before its aliases were set
        if version is None:
            if reg.log_mode == "merged":
                info = serving.log_merged_model(Path(model_dir), params.model, params.quantization)
            else:
                info = serving.log_adapter_model(Path(model_dir), params.model, params.quantization)
            version = registry.register_version(client, reg.model_name, info, {"model_md5": model_md5})
        client.update_model_version(reg.model_name, version.version,
                                    registry.describe(run_params, metrics, tags["git_commit"]))
        decision = registry.champion_decision(client, reg.model_name, reg.gate_metric, metrics[reg.gate_metric],
                                              reg.gate_greater_is_better)
        client.set_registered_model_alias(reg.model_name, "candidate", version.version)
        if decision["promote"]:
            client.set_registered_model_alias(reg.model_name, "champion", version.version)
    mlflow.set_tags({"gate.decision": "champion" if decision["promote"] else "candidate",
                     "gate.reason": decision["reason"], "registered_version": version.version})
    mlflow.log_dict(decision, "gate_decision.json")
    mlflow.end_run()
    return run.info.run_id, version, decision


def main():
    params = load_params("register")
    reg = params.register
    metrics = {f"{stage}.{key}": value for stage, path in METRICS.items()
               for key, value in flat_keys(json.loads(path.read_text())).items() if isinstance(value, (int, float))}
    if reg.gate_metric not in metrics:
        raise SystemExit(f"register.gate_metric '{reg.gate_metric}' is not a metric; known: {sorted(metrics)}")
    md5s, run_params = registry.lock_provenance(ROOT)
    md5s.pop(str(OUT), None)
    model_dir = "models/merged" if reg.log_mode == "merged" else "models/adapter"
    # This pipeline run: every output it produced, and how it is to be registered.
    pipeline_md5 = hashlib.md5(json.dumps([md5s, reg.dump()], sort_keys=True).encode()).hexdigest()

    uri = tracking.tracking_uri(ROOT)
    try:
        tracking.use_experiment(reg.experiment, ROOT)
        client = MlflowClient()
        logged = registry.completed_run(client, reg.experiment, pipeline_md5)
        if logged is not None:  # this very pipeline run is in MLflow already
            print(f"run {logged.info.run_id} already holds these outputs (pipeline md5 {pipeline_md5}); nothing to log")
            run_id, tags = logged.info.run_id, logged.data.tags
            version = client.get_model_version(reg.model_name, tags["registered_version"])
            decision = {"promote": tags.get("gate.decision") == "champion", "reason": tags.get("gate.reason")}
        else:
            run_id, version, decision = log_run(client, uri, params, metrics, md5s, run_params, pipeline_md5,
                                                model_dir)
            print(f"logged run {run_id}; {reg.model_name} v{version.version}: {decision['reason']}")
        aliases = client.get_model_version(reg.model_name, version.version).aliases
    except Exception as exc:
        reason, retries = tracking.unreachable(exc), os.environ.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES")
        kept = f"{OUT} left as it was" if OUT.exists() else f"nothing registered yet (no {OUT})"
        tracking.end_run_failed()
        if reason is None:
            raise
        raise SystemExit(
            f"register: MLflow at {tracking.redact(uri)} unreachable ({reason}) after "
            f"{retries} retries (MLFLOW_HTTP_REQUEST_MAX_RETRIES, "
            f"_BACKOFF_FACTOR, _TIMEOUT set the bound); {kept}, re-run when the server is back") from None

    write_json(OUT, {"model_name": reg.model_name, "version": int(version.version),
                     "model_uri": f"models:/{reg.model_name}/{version.version}", "aliases": sorted(aliases),
                     "run_id": run_id, "tracking_uri": tracking.portable_uri(uri, ROOT),
                     "model_md5": md5s.get(model_dir, ""), "gate": decision})
    print(OUT.read_text())


if __name__ == "__main__":
    main()
