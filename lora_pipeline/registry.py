"""MLflow for the register stage: provenance from dvc.lock, model versions, and the champion/candidate aliases
(where runs go: lora_pipeline.tracking; the served model: lora_pipeline.serving)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import mlflow
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from lora_pipeline import dvcfiles
from lora_pipeline.params import flat_keys


def lock_provenance(root: Path) -> tuple[dict, dict]:
    """(md5 of every stage output, params every stage ran with), both as recorded in dvc.lock."""
    md5s, params = {}, {}
    for stage in dvcfiles.locked(root).values():
        for out in stage.get("outs", []):
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
        versions = client.search_model_versions(f"name = '{model_name}'")
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


def champion_decision(client: MlflowClient, model_name: str, metric: str, value: float,
                      greater_is_better: bool) -> dict:
    """Whether a new version with gate `metric` = `value` beats the current @champion (which may not exist)."""
    try:
        champion = client.get_model_version_by_alias(model_name, "champion")
    except mlflow.exceptions.MlflowException:
        return {"promote": True, "reason": "no champion yet", "champion_version": None, "champion_value": None}
    current = client.get_run(champion.run_id).data.metrics.get(metric)
    if current is None:
        better = True
    else:
        better = value > current if greater_is_better else value < current
    verdict = "beats" if better else "does not beat"
    return {"promote": better, "champion_version": champion.version, "champion_value": current,
            "reason": f"{metric} {value:.4g} {verdict} champion v{champion.version}'s {current}"}
