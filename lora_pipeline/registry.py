"""MLflow for the register stage: provenance from dvc.lock, model logging, and the champion/candidate aliases
(where runs go: lora_pipeline.tracking)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import mlflow
import pandas as pd
import yaml
from mlflow import MlflowClient

from lora_pipeline.params import flat_keys


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
                      f"Quantization: {listing('quantization.', run_params)}",
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


# The model params the registered model is loaded with (lora_pipeline.modeling.load_model).
LOAD_KEYS = ("dtype", "attn_implementation", "experts_implementation", "trust_remote_code")
# Generation params a caller may pass to predict (params=...): greedy, hence deterministic, unless do_sample.
GENERATION_DEFAULTS = {"max_new_tokens": 256, "do_sample": False, "temperature": 1.0, "top_p": 1.0}


class ChatModel(mlflow.pyfunc.PythonModel):
    """pyfunc over the merged model, or over the adapter applied at load time to a referenced base (for models too
    big to copy). Input: prompts rendered with the chat template; output: the assistant's new text only, its
    reasoning and its final answer."""

    def load_context(self, context):
        from types import SimpleNamespace

        from transformers import AutoTokenizer

        from lora_pipeline.modeling import load_model

        config = context.model_config
        options = SimpleNamespace(**{key: config[key] for key in LOAD_KEYS})
        if "model" in context.artifacts:
            self.tokenizer = AutoTokenizer.from_pretrained(context.artifacts["model"], trust_remote_code=options.trust_remote_code)
            self.model = load_model(context.artifacts["model"], options).eval()
            return
        from peft import PeftModel

        # The base in full precision (MXFP4 experts dequantized), as the merge uses it, whatever it was trained in.
        self.tokenizer = AutoTokenizer.from_pretrained(context.artifacts["adapter"],
                                                       trust_remote_code=options.trust_remote_code)
        model = load_model(config["base"], options, revision=config.get("revision") or None)
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


def _load_config(model_params, quantization) -> dict:
    """How the registered model loads, and the quantization its adapter was trained with (a record only)."""
    return {**{key: getattr(model_params, key) for key in LOAD_KEYS}, "trained_quantization": quantization.method}


def log_merged_model(model_dir: Path, model_params, quantization):
    """The merged model, its weights copied into the run."""
    return _log_chat_model({"model": str(model_dir)}, _load_config(model_params, quantization))


def log_adapter_model(adapter_dir: Path, model_params, quantization):
    """Only the adapter, with a reference to its base (a Hub id and revision, or a local folder)."""
    base = model_params.name if model_params.source == "hub" else str(Path("models/base").resolve())
    config = {"base": base, "revision": model_params.revision if model_params.source == "hub" else "",
              **_load_config(model_params, quantization)}
    return _log_chat_model({"adapter": str(adapter_dir)}, config)
