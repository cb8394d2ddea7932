"""MLflow: where runs go, provenance from dvc.lock, model logging, and the champion/candidate aliases."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import mlflow
import yaml
from mlflow import MlflowClient

from lora_pipeline.params import flat_keys


def _repo(root: Path) -> Path:
    """The repository that holds the local store: DVC's temp experiment runs point DVC_ROOT at their parent."""
    return Path(os.environ.get("DVC_ROOT") or root).resolve()


def tracking_uri(root: Path) -> str:
    """MLFLOW_TRACKING_URI if set, else a sqlite store in the repository."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{_repo(root) / 'mlflow.db'}"


def use_experiment(name: str, root: Path) -> str:
    """Point MLflow at the store and experiment; local stores keep artifacts in <repo>/mlartifacts."""
    uri = tracking_uri(root)
    mlflow.set_tracking_uri(uri)
    if mlflow.get_experiment_by_name(name) is None:
        location = None
        if uri.startswith("sqlite:"):
            location = (_repo(root) / "mlartifacts").as_uri()
        mlflow.create_experiment(name, artifact_location=location)
    mlflow.set_experiment(name)
    return uri


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


def find_run_by_tag(client: MlflowClient, experiment: str, key: str, value: str):
    """The run of `experiment` whose tag `key` equals `value`, or None."""
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.{key} = '{value}'", max_results=1) if exp else []
    return runs[0] if runs else None


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


class AdapterModel(mlflow.pyfunc.PythonModel):
    """pyfunc for models too big to copy: the LoRA adapter, applied at load time to a referenced base model."""

    def load_context(self, context):
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        base = context.model_config["base"]
        revision = context.model_config.get("revision") or None
        kwargs = {"dtype": context.model_config.get("dtype", "auto")}
        if context.model_config.get("mxfp4_dequantize"):
            from transformers import Mxfp4Config

            kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
        self.tokenizer = AutoTokenizer.from_pretrained(context.artifacts["adapter"])
        model = AutoModelForCausalLM.from_pretrained(base, revision=revision, **kwargs)
        self.model = PeftModel.from_pretrained(model, context.artifacts["adapter"]).eval()

    def predict(self, context, model_input, params=None):
        prompts = list(model_input.iloc[:, 0]) if hasattr(model_input, "iloc") else list(model_input)
        max_new_tokens = int((params or {}).get("max_new_tokens", 64))
        texts = []
        for prompt in prompts:
            batch = self.tokenizer(prompt, return_tensors="pt", add_special_tokens=False).to(self.model.device)
            out = self.model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                                      pad_token_id=self.tokenizer.pad_token_id)
            texts.append(self.tokenizer.decode(out[0, batch["input_ids"].shape[1]:], skip_special_tokens=True))
        return texts


def _pip_requirements() -> list[str]:
    """Exact versions of what loading the model needs (inferred ones would add torchvision, which breaks)."""
    from importlib.metadata import version

    return [f"{name}=={version(name).split('+')[0]}" for name in
            ("torch", "transformers", "tokenizers", "safetensors", "accelerate", "peft")]


def _signature():
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, DataType, ParamSchema, ParamSpec, Schema

    return ModelSignature(inputs=Schema([ColSpec(DataType.string)]), outputs=Schema([ColSpec(DataType.string)]),
                          params=ParamSchema([ParamSpec("max_new_tokens", DataType.long, 64)]))


def log_merged_model(model_dir: Path):
    """The merged model through MLflow's transformers flavour (the weights are copied into the run)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return mlflow.transformers.log_model({"model": model, "tokenizer": tokenizer}, name="model",
                                         task="text-generation", pip_requirements=_pip_requirements(),
                                         signature=_signature())


def log_adapter_model(adapter_dir: Path, model_params):
    """Only the adapter, with a reference to its base (a Hub id and revision, or a local folder)."""
    base = model_params.name if model_params.source == "hub" else str(Path("models/base").resolve())
    config = {"base": base, "revision": model_params.revision if model_params.source == "hub" else "",
              "dtype": model_params.dtype, "mxfp4_dequantize": model_params.mxfp4_dequantize}
    return mlflow.pyfunc.log_model(name="model", python_model=AdapterModel(), artifacts={"adapter": str(adapter_dir)},
                                   model_config=config, pip_requirements=_pip_requirements(),
                                   signature=_signature(), code_paths=[str(Path(__file__).parent)])

