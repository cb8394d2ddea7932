"""MLflow: where runs go, provenance from dvc.lock, model logging, and the champion/candidate aliases."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

import mlflow
import pandas as pd
import yaml
from mlflow import MlflowClient

from lora_pipeline.params import flat_keys


# A stopped or unreachable server fails the stage in about 30 s (retries after 0, 4, 8, 16 s) instead of MLflow's
# several minutes per request; each of these MLflow variables, when set, wins.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "4", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "2",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}


def _repo(root: Path) -> Path:
    """The repository that holds the local store: DVC's temp experiment runs point DVC_ROOT at their parent."""
    return Path(os.environ.get("DVC_ROOT") or root).resolve()


def tracking_uri(root: Path) -> str:
    """MLFLOW_TRACKING_URI if set, else a sqlite store in the repository."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{_repo(root) / 'mlflow.db'}"


def redact(uri: str) -> str:
    """The URI with any password (or token given as the user part) replaced by ***."""
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri
    userinfo, host = parts.netloc.rsplit("@", 1)
    user, has_password, _ = userinfo.partition(":")
    hidden = f"{user}:***" if has_password else "***"
    return urlunsplit(parts._replace(netloc=f"{hidden}@{host}"))


def portable_uri(uri: str, root: Path) -> str:
    """The URI as it may be written into a tracked file: redacted, and a local sqlite store relative to the repo."""
    if uri.startswith("sqlite:///"):
        path = Path(uri[len("sqlite:///"):])
        if path.is_absolute():
            return f"sqlite:///{os.path.relpath(path, _repo(root))}"
    return redact(uri)


def _without_credentials(uri: str) -> str:
    """The URI minus user:password, which go to MLflow's own variables (so MLflow never prints them)."""
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or parts.password is None:
        return uri
    os.environ["MLFLOW_TRACKING_USERNAME"] = unquote(parts.username or "")
    os.environ["MLFLOW_TRACKING_PASSWORD"] = unquote(parts.password)
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


def use_experiment(name: str, root: Path) -> str:
    """Point MLflow at the store and experiment with bounded retries; local stores keep artifacts in
    <repo>/mlartifacts. Returns the URI as given (with any credentials: redact it before showing it)."""
    for key, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)
    uri = tracking_uri(root)
    os.environ["MLFLOW_TRACKING_URI"] = _without_credentials(uri)
    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    if mlflow.get_experiment_by_name(name) is None:
        location = None
        if uri.startswith("sqlite:"):
            location = (_repo(root) / "mlartifacts").as_uri()
        mlflow.create_experiment(name, artifact_location=location)
    mlflow.set_experiment(name)
    return uri


def unreachable(exc: BaseException) -> str | None:
    """Why MLflow could not be reached (e.g. "Failed to establish a new connection: [Errno 111] Connection
    refused"), or None if `exc` is another error."""
    import requests

    lost = (requests.exceptions.ConnectionError, requests.exceptions.Timeout, requests.exceptions.ChunkedEncodingError)
    while exc is not None:
        if isinstance(exc, lost):
            inner = exc.args[0] if exc.args else exc
            inner = getattr(inner, "reason", inner)  # urllib3's MaxRetryError: the last attempt's error
            text = inner.args[0] if getattr(inner, "args", None) and isinstance(inner.args[0], str) else str(inner)
            return re.sub(r"^<[^>]*>: ", "", text)[:200]
        exc = exc.__cause__ or exc.__context__
    return None


def end_run_failed() -> None:
    """Mark the active run FAILED with a single attempt: after a connection error, retrying only delays the exit."""
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    try:
        mlflow.end_run("FAILED")
    except Exception:  # the server is gone; the next register run marks this run FAILED
        pass


def lock_provenance(lock_path: Path) -> tuple[dict, dict]:
    """(md5 of every stage output, params every stage ran with), both as recorded in dvc.lock."""
    lock = yaml.safe_load(lock_path.read_text()) if lock_path.is_file() else {}
    md5s, params = {}, {}
    for stage in (lock or {}).get("stages", {}).values():
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
                      f"LoRA: {listing('lora.', run_params)}", f"Training: {listing('train.', run_params)}",
                      f"Evaluation: {listing('eval.', figures)}", f"Git commit: {commit}"])


def git_commit(root: Path) -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


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


# Generation params a caller may pass to predict (params=...): greedy, hence deterministic, unless do_sample.
GENERATION_DEFAULTS = {"max_new_tokens": 256, "do_sample": False, "temperature": 1.0, "top_p": 1.0}


class ChatModel(mlflow.pyfunc.PythonModel):
    """pyfunc over the merged model, or over the adapter applied at load time to a referenced base (for models too
    big to copy). Input: prompts rendered with the chat template; output: the assistant's new text only, its
    reasoning and its final answer."""

    def load_context(self, context):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        config = context.model_config
        kwargs = {"dtype": config.get("dtype", "auto")}
        if config.get("mxfp4_dequantize"):
            from transformers import Mxfp4Config

            kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
        if "model" in context.artifacts:
            self.tokenizer = AutoTokenizer.from_pretrained(context.artifacts["model"])
            self.model = AutoModelForCausalLM.from_pretrained(context.artifacts["model"], **kwargs).eval()
            return
        from peft import PeftModel

        self.tokenizer = AutoTokenizer.from_pretrained(context.artifacts["adapter"])
        model = AutoModelForCausalLM.from_pretrained(config["base"], revision=config.get("revision") or None, **kwargs)
        self.model = PeftModel.from_pretrained(model, context.artifacts["adapter"]).eval()

    # The DataFrame hint (the signature turns a list of prompts into one) also spares MLflow's type-hint warning.
    def predict(self, context, model_input: pd.DataFrame, params: dict | None = None) -> pd.DataFrame:
        from lora_pipeline.chat import split_reasoning
        from lora_pipeline.metrics import generate_from_prompts

        prompts = list(model_input.iloc[:, 0])
        options = {**GENERATION_DEFAULTS, **(params or {})}
        sampling = {"do_sample": bool(options["do_sample"])}
        if sampling["do_sample"]:
            sampling.update(temperature=float(options["temperature"]), top_p=float(options["top_p"]))
        generated = generate_from_prompts(self.model, self.tokenizer, prompts, int(options["max_new_tokens"]),
                                          batch_size=8, **sampling)
        rows = []
        for raw in generated:
            reasoning, answer = split_reasoning(raw)
            text = self.tokenizer.decode(self.tokenizer(raw, add_special_tokens=False)["input_ids"],
                                         skip_special_tokens=True).strip()
            rows.append({"text": text, "reasoning": reasoning, "answer": answer})
        return pd.DataFrame(rows, columns=["text", "reasoning", "answer"])


def _pip_requirements() -> list[str]:
    """Exact versions of what loading the model needs (inferred ones would add torchvision, which breaks)."""
    from importlib.metadata import version

    return [f"{name}=={version(name).split('+')[0]}" for name in
            ("torch", "transformers", "tokenizers", "safetensors", "accelerate", "peft", "pandas")]


def _signature():
    from mlflow.models import infer_signature

    example_output = pd.DataFrame([{"text": "", "reasoning": "", "answer": ""}])
    return infer_signature(["<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"], example_output,
                           params=GENERATION_DEFAULTS)


def _log_chat_model(artifacts: dict, config: dict):
    return mlflow.pyfunc.log_model(name="model", python_model=ChatModel(), artifacts=artifacts, model_config=config,
                                   pip_requirements=_pip_requirements(), signature=_signature(),
                                   code_paths=[str(Path(__file__).parent)])


def log_merged_model(model_dir: Path, model_params):
    """The merged model, its weights copied into the run; one saved in MXFP4 loads as the base does."""
    from lora_pipeline.mxfp4 import is_mxfp4_checkpoint

    config = {"dtype": model_params.dtype,
              "mxfp4_dequantize": model_params.mxfp4_dequantize and is_mxfp4_checkpoint(model_dir)}
    return _log_chat_model({"model": str(model_dir)}, config)


def log_adapter_model(adapter_dir: Path, model_params):
    """Only the adapter, with a reference to its base (a Hub id and revision, or a local folder)."""
    base = model_params.name if model_params.source == "hub" else str(Path("models/base").resolve())
    config = {"base": base, "revision": model_params.revision if model_params.source == "hub" else "",
              "dtype": model_params.dtype, "mxfp4_dequantize": model_params.mxfp4_dequantize}
    return _log_chat_model({"adapter": str(adapter_dir)}, config)
