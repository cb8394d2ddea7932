"""MLflow for the register stage: provenance from dvc.lock, model versions, the champion/candidate aliases, and the
stage's run completed and its model registered (where runs go: lora_pipeline.train.tracking; the served model:
lora_pipeline.registry.serving; the gate's rule: lora_pipeline.registry.gate)."""
from __future__ import annotations

import csv
import hashlib
import json
import os
import subprocess
import time
from pathlib import Path

import mlflow
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from lora_pipeline.config import dvcfiles
from lora_pipeline.train import tracking
from lora_pipeline.config.outputs import METRICS
from lora_pipeline.config.params import flat_keys
from lora_pipeline.registry.gate import champion_decision, gate
from lora_pipeline.registry.mlflow_names import CANDIDATE, CHAMPION, name_filter

# What the register stage writes. REGISTRATION, its one DVC output: what it registered (model, pipeline run, gate
# figure), the same bytes on every machine that registers the same outputs, so dvc.lock, in git, holds nothing of one
# machine's store. RECORD: the version, aliases, run and store it registered in on this machine, declared by no stage.
# Neither is in git or a DVC remote: a clone lacks REGISTRATION, so its `dvc repro` registers in its own store.
STAGE, REGISTRATION, RECORD = "register", Path("models/registration.json"), Path("models/registered.json")


def lock_provenance(root: Path) -> tuple[dict, dict]:
    """(md5 of every stage output but register's own, params every stage ran with), both as recorded in dvc.lock."""
    md5s, params = {}, {}
    for name, stage in dvcfiles.locked(root).items():
        for out in stage.get("outs", []) if name != STAGE else []:
            md5s[out["path"]] = out.get("md5", "")
        for values in stage.get("params", {}).values():
            params.update(flat_keys(values))
    return md5s, params


def speed_metrics(speed: dict) -> dict[str, float]:
    """The train stage's timings as `speed.*` metrics (numbers only: the device name and the like stay in the file)."""
    return {f"speed.{key}": float(value) for key, value in flat_keys(speed).items()
            if isinstance(value, (int, float))}


def describe(run_params: dict, metrics: dict, commit: str) -> str:
    """A model version's description: base model, data set, LoRA and training params (as dvc.lock recorded them),
    evaluation figures and the git commit."""
    def origin(section):
        name, source = run_params.get(f"{section}.name") or "", run_params.get(f"{section}.source", "?")
        revision = run_params.get(f"{section}.revision") or "none"
        return f"{name} ({source}, revision {revision})" if name else f"built in ({source})"

    def listing(prefix, values):
        return ", ".join(f"{k[len(prefix):]}={v}" for k, v in sorted(values.items()) if k.startswith(prefix))

    figures = {k: f"{v:.4g}" for k, v in metrics.items()}
    return "\n".join([f"Base model: {origin('model')}", f"Data: {origin('data')}",
                      f"Quantization: {listing('quantization.', run_params)}",
                      f"LoRA: {listing('lora.', run_params)}", f"Training: {listing('train.', run_params)}",
                      f"Evaluation: {listing('eval.', figures)}", f"Git commit: {commit}"])


def git_commit(root: Path) -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def register_version(client: MlflowClient, model_name: str, model_info, tags: dict):
    """A new version of the registered model `model_name` (created if missing) for a logged model: what
    mlflow.register_model does, through MlflowClient's own calls, which print nothing on the console."""
    try:
        client.create_registered_model(model_name)
    except MlflowException as exc:
        if exc.error_code not in ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS"):
            raise
    return client.create_model_version(model_name, model_info.model_uri, tags=tags, model_id=model_info.model_id)


def find_version_by_tag(client: MlflowClient, model_name: str, key: str, value: str):
    """The registered version whose tag `key` equals `value`, or None."""
    try:
        versions = client.search_model_versions(name_filter(model_name))
    except mlflow.exceptions.MlflowException:
        return None
    return next((v for v in versions if v.tags.get(key) == value), None)


def completed_run(client: MlflowClient, experiment: str, pipeline_md5: str):
    """The FINISHED run that registered this pipeline run (tag registered_version), or None. Runs of it left
    RUNNING by an interrupted register are marked FAILED, so they neither block nor pass for a result."""
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.pipeline_md5 = '{pipeline_md5}'") if exp else []
    done = None
    for run in runs:
        if run.info.status == "FINISHED" and "registered_version" in run.data.tags:
            done = done or run
        elif run.info.status in ("RUNNING", "SCHEDULED"):
            client.set_terminated(run.info.run_id, "FAILED")
    return done


def run_completed(client: MlflowClient, run_id: str) -> bool:
    """Whether the run finished its registration (a version whose run did not was left without its aliases)."""
    run = client.get_run(run_id)
    return run.info.status == "FINISHED" and "registered_version" in run.data.tags


# What the register stage logs besides the metrics files (lora_pipeline.config.outputs.METRICS).
LOSS_LOG = Path("plots/train_loss.csv")
ARTIFACTS = [Path("reports/demo.txt"), Path("reports/report.png"), Path("reports/task.md")]
SPEED = Path("logs/train_speed.json")  # timings of the train stage: logged when present, never a DVC dependency
ADAPTER = Path("models/adapter")


def stage_metrics(gate_metric: str) -> dict:
    """Every number of the metrics files, as `<prefix>.<dotted key>` (the prefixes of METRICS); stops the stage,
    naming those known, when `gate_metric` is not among them."""
    metrics = {f"{stage}.{key}": value for stage, path in METRICS.items()
               for key, value in flat_keys(json.loads(path.read_text())).items() if isinstance(value, (int, float))}
    if gate_metric not in metrics:
        raise SystemExit(f"register.gate_metric '{gate_metric}' is not a metric; known: {sorted(metrics)}")
    return metrics


def csv_records(path: Path) -> list[dict]:
    """The train stage's per-step log as step records, for a run that has no live record of this training."""
    now = int(time.time() * 1000)
    with open(path) as f:
        return [{"step": int(row.pop("step")), "time": now, "metrics": {k: float(v) for k, v in row.items() if v}}
                for row in csv.DictReader(f)]


def continuable(run, pipeline_md5: str) -> bool:
    """The train run is this pipeline run's to complete: no register finished it, nor began it for other outputs."""
    return "registered_version" not in run.data.tags and run.data.tags.get("pipeline_md5", pipeline_md5) == pipeline_md5


def start_pipeline_run(client, uri, reg, pipeline_md5, tags, root: Path):
    """The train stage's run continued, or a new run with the step records (see stages/register.py's docstring)."""
    training = tracking.finished_training(client, uri, root, reg.experiment, ADAPTER)
    state, records, train_run = training or (None, csv_records(LOSS_LOG), None)
    if train_run is not None:
        tracking.deliver_late(client, state, records, train_run.info.run_id)
        if continuable(train_run, pipeline_md5):
            return mlflow.start_run(run_id=train_run.info.run_id)
        tags["train_run_id"] = train_run.info.run_id
    run = mlflow.start_run(run_name=os.environ.get("DVC_EXP_NAME"))
    tracking.log_records(client, run.info.run_id, records)
    return run


def log_run(client, uri, params, metrics, md5s, run_params, pipeline_md5, model_dir, root: Path,
            gate_rule: tuple[str, bool]):
    """This pipeline run's run completed; registers the model unless a finished run already did, its champion
    decided by `gate_rule` (gate metric, whether higher is better). -> (run id, version, gate decision)"""
    reg = params.register
    model_md5 = md5s.get(model_dir, "")
    tags = {"git_commit": git_commit(root), "dvc_exp_name": os.environ.get("DVC_EXP_NAME", "workspace"),
            "model_md5": model_md5, "pipeline_md5": pipeline_md5, **{f"md5.{path}": md5 for path, md5 in md5s.items()}}
    run = start_pipeline_run(client, uri, reg, pipeline_md5, tags, root)
    mlflow.set_tags(tags)
    mlflow.log_params({k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in run_params.items()})
    mlflow.log_metrics(metrics)
    if SPEED.is_file():
        mlflow.log_metrics(speed_metrics(json.loads(SPEED.read_text())))
        mlflow.log_artifact(str(SPEED))
    for artifact in ARTIFACTS:
        if artifact.is_file():
            mlflow.log_artifact(str(artifact))
    version = find_version_by_tag(client, reg.model_name, "model_md5", model_md5)
    if version is not None and run_completed(client, version.run_id):  # e.g. only eval params changed
        decision = {"promote": False, "reason": f"model already registered as v{version.version}"}
    else:  # a new model, or one whose registration was interrupted before its aliases were set
        if version is None:
            from lora_pipeline.registry import serving  # only to log a new model: most re-runs log none

            if reg.log_mode == "merged":
                info = serving.log_merged_model(Path(model_dir), params.model, params.quantization,
                                                reg.serve_batch_size)
            else:
                info = serving.log_adapter_model(Path(model_dir), params.model, params.quantization,
                                                 reg.serve_batch_size)
            version = register_version(client, reg.model_name, info, {"model_md5": model_md5})
        client.update_model_version(reg.model_name, version.version,
                                    describe(run_params, metrics, tags["git_commit"]))
        metric, greater_is_better = gate_rule
        decision = champion_decision(client, reg.model_name, metric, metrics[metric], greater_is_better)
        client.set_registered_model_alias(reg.model_name, CANDIDATE, version.version)
        if decision["promote"]:
            client.set_registered_model_alias(reg.model_name, CHAMPION, version.version)
    mlflow.set_tags({"gate.decision": "champion" if decision["promote"] else "candidate",
                     "gate.reason": decision["reason"], "registered_version": version.version})
    mlflow.log_dict(decision, "gate_decision.json")
    mlflow.end_run()
    return run.info.run_id, version, decision


def register_pipeline_run(params, metrics: dict, root: Path) -> tuple[dict, dict]:
    """This pipeline run logged to MLflow and its model registered, unless a finished run holds it already; an
    unreachable server stops the stage in bounded time with one line, RECORD untouched. -> (what REGISTRATION
    holds: the model, the pipeline run, the gate figure; what RECORD holds: the version, its aliases, the run, the
    store, the gate decision)"""
    reg = params.register
    metric, greater_is_better = gate(reg, params.data.source)
    md5s, run_params = lock_provenance(root)
    model_dir = "models/merged" if reg.log_mode == "merged" else "models/adapter"
    # This pipeline run: every output it produced, and how it is to be registered.
    pipeline_md5 = hashlib.md5(json.dumps([md5s, reg.dump()], sort_keys=True).encode()).hexdigest()

    uri = tracking.tracking_uri(root)
    try:
        tracking.use_experiment(reg.experiment, root)
        client = MlflowClient()
        logged = completed_run(client, reg.experiment, pipeline_md5)
        if logged is not None:  # this very pipeline run is in MLflow already
            print(f"run {logged.info.run_id} already holds these outputs (pipeline md5 {pipeline_md5}); nothing to log")
            run_id, tags = logged.info.run_id, logged.data.tags
            version = client.get_model_version(reg.model_name, tags["registered_version"])
            decision = {"promote": tags.get("gate.decision") == "champion", "reason": tags.get("gate.reason")}
        else:
            run_id, version, decision = log_run(client, uri, params, metrics, md5s, run_params, pipeline_md5,
                                                model_dir, root, (metric, greater_is_better))
            print(f"logged run {run_id}; {reg.model_name} v{version.version}: {decision['reason']}")
        aliases = client.get_model_version(reg.model_name, version.version).aliases
    except Exception as exc:
        reason, retries = tracking.unreachable(exc), os.environ.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES")
        kept = f"{RECORD} left as it was" if RECORD.exists() else f"nothing registered yet (no {RECORD})"
        tracking.end_run_failed()
        if reason is None:
            raise
        raise SystemExit(
            f"register: MLflow at {tracking.redact(uri)} unreachable ({reason}) after "
            f"{retries} retries (MLFLOW_HTTP_REQUEST_MAX_RETRIES, "
            f"_BACKOFF_FACTOR, _TIMEOUT set the bound); {kept}, re-run when the server is back") from None

    registration = {"model_name": reg.model_name, "model_md5": md5s.get(model_dir, ""), "pipeline_md5": pipeline_md5,
                    "gate": {"metric": metric, "value": metrics[metric], "greater_is_better": greater_is_better}}
    record = {"model_name": reg.model_name, "version": int(version.version),
              "model_uri": f"models:/{reg.model_name}/{version.version}", "aliases": sorted(aliases),
              "run_id": run_id, "tracking_uri": tracking.portable_uri(uri, root),
              "model_md5": md5s.get(model_dir, ""), "gate": decision}
    return registration, record
