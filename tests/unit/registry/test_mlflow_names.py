"""The names a run gives MLflow: the aliases register sets against MLflow's rules, the file store's stricter rule,
and the filter that finds a registered model's versions whatever quote its name holds."""
import pytest

from helpers import shipped
from lora_pipeline.config.params import validate
from lora_pipeline.registry import mlflow_names


def register(**changes):
    return validate(shipped(**{f"register.{key}": value for key, value in changes.items()})).register


def names(**changes) -> tuple[str, str]:
    """register.model_name and register.experiment, as mlflow_name_problems takes them."""
    section = register(**changes)
    return section.model_name, section.experiment


def test_the_aliases_register_sets_pass_mlflow_rules():
    assert mlflow_names.mlflow_name_problems(*names()) == []


@pytest.mark.parametrize("alias, rule", [("latest", "reserved"), ("v2", "reserved"), ("best model", "Invalid alias")])
def test_an_alias_mlflow_refuses_is_named(monkeypatch, alias, rule):
    monkeypatch.setattr(mlflow_names, "ALIASES", (mlflow_names.CANDIDATE, alias))
    problems = mlflow_names.mlflow_name_problems(*names())
    assert len(problems) == 1 and problems[0].startswith(f"the alias '{alias}' that register sets: ")
    assert rule in problems[0]


def test_a_file_store_refuses_a_percent_the_sqlite_store_takes(monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert mlflow_names.mlflow_name_problems(*names(model_name="top 5%")) == []
    monkeypatch.setenv("MLFLOW_TRACKING_URI", str(tmp_path / "mlruns"))
    [problem] = mlflow_names.mlflow_name_problems(*names(model_name="top 5%"))
    assert problem.startswith("register.model_name: ") and "cannot contain '%'" in problem


@pytest.mark.parametrize("name", ["it's mine", 'the "best" one', "plain"])
def test_versions_are_found_by_a_name_with_either_quote(tmp_path, name):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
                          registry_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    client.create_registered_model(name)
    client.create_model_version(name, str(tmp_path), tags={"model_md5": "abc"})
    client.create_registered_model(name + " 2")
    [version] = client.search_model_versions(mlflow_names.name_filter(name))
    assert version.name == name and version.tags["model_md5"] == "abc"


def test_the_verdict_is_kept_per_store_kind_and_names(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", str(tmp_path / "mlruns"))
    for _ in range(2):  # computed, then read back from the cache
        with pytest.raises(ValueError, match="register.model_name: .*cannot contain '%'"):
            mlflow_names.check_mlflow_names(register(model_name="top 5%"))
    assert len(list((tmp_path / "cache").rglob("mlflow-names-*.json"))) == 1
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    mlflow_names.check_mlflow_names(register(model_name="top 5%"))  # the sqlite store takes it: another key


def test_the_verdict_is_kept_where_only_mlflow_skinny_is_installed(monkeypatch, tmp_path):
    installed = {"mlflow-skinny": "3.17.2"}

    def version(distribution):
        if distribution not in installed:
            raise mlflow_names.PackageNotFoundError(distribution)
        return installed[distribution]

    monkeypatch.setattr(mlflow_names, "version", version)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", str(tmp_path / "mlruns"))  # a file store: it refuses '%'
    assert mlflow_names.mlflow_version() == "3.17.2"
    mlflow_names.check_mlflow_names(register(model_name="reasoner"))
    with pytest.raises(ValueError, match="register.model_name: .*cannot contain '%'"):
        mlflow_names.check_mlflow_names(register(model_name="top 5%"))
