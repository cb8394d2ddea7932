"""register's champion rule against a real MLflow registry on sqlite: promote when there is no champion, when the
champion's run lacks the gate figure, or when the new figure is strictly better in the gate's direction."""
import pytest
from mlflow import MlflowClient

from lora_pipeline.registry.gate import champion_decision
from lora_pipeline.registry.mlflow_names import CHAMPION

pytestmark = pytest.mark.unit
MODEL, METRIC = "reasoner", "eval.compliance.overall"


@pytest.fixture
def client(tmp_path):
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    return MlflowClient(tracking_uri=store, registry_uri=store)


def crown(client, metrics: dict) -> str:
    """A registered version of MODEL from a run that logged `metrics`, made @champion; its version."""
    experiment = client.get_experiment_by_name("gate") or client.get_experiment(client.create_experiment("gate"))
    run = client.create_run(experiment.experiment_id)
    for key, value in metrics.items():
        client.log_metric(run.info.run_id, key, value)
    client.set_terminated(run.info.run_id)
    if not client.search_registered_models(f"name = '{MODEL}'"):
        client.create_registered_model(MODEL)
    version = client.create_model_version(MODEL, f"runs:/{run.info.run_id}/model", run_id=run.info.run_id).version
    client.set_registered_model_alias(MODEL, CHAMPION, version)
    return version


def test_the_first_version_is_promoted(client):
    decision = champion_decision(client, MODEL, METRIC, 0.5, greater_is_better=True)
    assert decision["promote"] and decision["reason"] == "no champion yet" and decision["champion_version"] is None


@pytest.mark.parametrize("value, greater_is_better, promote", [
    (0.8, True, True), (0.6, True, False), (0.7, True, False),  # a tie keeps the champion
    (0.6, False, True), (0.8, False, False), (0.7, False, False),
])
def test_a_version_is_promoted_only_when_strictly_better_in_the_gates_direction(client, value, greater_is_better,
                                                                                 promote):
    version = crown(client, {METRIC: 0.7})
    decision = champion_decision(client, MODEL, METRIC, value, greater_is_better)
    assert decision["promote"] is promote
    assert decision["champion_version"] == version and decision["champion_value"] == pytest.approx(0.7)
    assert decision["reason"].startswith(f"{METRIC} {value:.4g} {'beats' if promote else 'does not beat'} champion v")


def test_a_champion_whose_run_lacks_the_gate_figure_is_replaced(client):
    crown(client, {"eval.loss": 1.0})
    decision = champion_decision(client, MODEL, METRIC, 0.1, greater_is_better=True)
    assert decision["promote"] and decision["champion_value"] is None


def test_the_current_champion_is_the_one_compared(client):
    crown(client, {METRIC: 0.2})
    latest = crown(client, {METRIC: 0.9})  # the alias moved to the newer version
    decision = champion_decision(client, MODEL, METRIC, 0.5, greater_is_better=True)
    assert not decision["promote"] and decision["champion_version"] == latest
