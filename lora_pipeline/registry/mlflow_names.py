"""The names a run gives MLflow (register.model_name, register.experiment, the aliases register sets), checked by
MLflow's own rules before any stage runs, and the filter that finds a registered model's versions by its name."""
from __future__ import annotations

import hashlib
import json
import os
from importlib.metadata import PackageNotFoundError, version
from urllib.parse import urlsplit

from lora_pipeline.config.cache import cached
from lora_pipeline.config.child import run_apart

# The aliases register sets: a new version is the candidate; the champion only if it beats the last one.
CANDIDATE, CHAMPION = "candidate", "champion"
ALIASES = (CANDIDATE, CHAMPION)


def name_filter(model_name: str) -> str:
    """MLflow's search filter for the versions of `model_name`: its filter strings have no escapes, so the name is
    quoted with the quote it does not contain (check_mlflow_names refuses one holding both)."""
    quote = "'" if "'" not in model_name else '"'
    return f"name = {quote}{model_name}{quote}"


def _is_file_store() -> bool:
    """Whether runs go to a folder (MLFLOW_TRACKING_URI with no scheme, or file:): MLflow's file store, whose registry
    refuses more names. Unset, they go to the repository's sqlite store (lora_pipeline.train.tracking)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    return bool(uri) and urlsplit(uri).scheme in ("", "file")


def mlflow_name_problems(model_name: str, experiment: str) -> list[str]:
    """One line per name MLflow would refuse (register.model_name, register.experiment, the aliases): the key, then
    MLflow's own message, which names the rule."""
    from mlflow.exceptions import MlflowException
    from mlflow.store.model_registry import file_store
    from mlflow.utils import validation

    model_rule = file_store._validate_model_name if _is_file_store() else validation._validate_model_name
    checks = [("register.model_name", model_name, model_rule),
              ("register.experiment", experiment, validation._validate_experiment_name)]
    for alias in ALIASES:
        checks += [(f"the alias '{alias}' that register sets", alias, rule)
                   for rule in (validation._validate_model_alias_name, validation._validate_model_alias_name_reserved)]
    problems = []
    for key, name, rule in checks:
        try:
            rule(name)
        except MlflowException as exc:
            problems.append(f"{key}: {exc.message} (MLflow's own rule, checked before any stage runs)")
    if "'" in model_name and '"' in model_name:
        problems.append(f"register.model_name: {model_name!r} holds both quote characters, and MLflow's "
                        "search filters (which register uses to find its versions) cannot quote such a name")
    return problems


def mlflow_version() -> str:
    """The installed MLflow's version without importing it: the `mlflow` distribution's, else `mlflow-skinny`'s
    (the same `mlflow` package without the server and UI)."""
    try:
        return version("mlflow")
    except PackageNotFoundError:
        return version("mlflow-skinny")


def check_mlflow_names(register) -> None:
    """mlflow_name_problems, asked in a child process and kept per MLflow version, store kind and names (the aliases
    too): importing MLflow takes seconds, and its verdict on the same names is the same."""
    asked = [mlflow_version(), _is_file_store(), register.model_name, register.experiment, *ALIASES]
    key = hashlib.sha256(json.dumps(asked).encode()).hexdigest()[:20]
    names = register.model_name, register.experiment
    if problems := cached(f"mlflow-names-{key}.json", lambda: run_apart(mlflow_name_problems, *names)):
        raise ValueError("\n".join(problems))
