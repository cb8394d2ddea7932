"""Sharing and parallel experiments on the reproduced pipeline: a DVC remote and a fresh clone that registers the
model in its own MLflow store, an experiment pushed and pulled through a git and a DVC remote, and queued and --temp
experiments that run without mixing params or touching the workspace's."""
import json

import pytest
import yaml

from conftest import run

pytestmark = pytest.mark.e2e  # every test here runs the pipeline, DVC or an MLflow server

UP_TO_DATE = "Data and pipelines are up to date."
# The cheapest experiments that still produce cached outputs of their own: evaluate (fine-tuned model only, no
# MGSM) and register re-run; everything before them is reused.
QUEUED = {"queued-p1": 1, "queued-p2": 2}
CHEAP = ["-S", "eval.include_base=false", "-S", "eval.mgsm.path=''"]


def ran_stages(output: str) -> list[str]:
    return [line.split("'")[1] for line in output.splitlines() if line.startswith("Running stage '")]


def experiments(repo) -> dict[str, dict]:
    """{experiment name: its `dvc exp show --json` record (rev, params, metrics)} for the experiments of HEAD."""
    found = {}
    for commit in json.loads(run(["dvc", "exp", "show", "--json"], repo)):
        for exp in commit.get("experiments") or []:
            for rev in exp.get("revs", []):
                found[rev.get("name") or exp.get("name")] = rev
    return found


def heldout_generations(path) -> int:
    """How many held-out questions (times languages) reports/generations.jsonl holds answers to."""
    return sum(json.loads(line)["set"] == "heldout" for line in path.read_text().splitlines())


@pytest.fixture(scope="module")
def remotes(repo, tmp_path_factory):
    """A DVC remote (a local folder) as the repository's default, and a bare git repository cloned from it."""
    repo, _ = repo
    where = tmp_path_factory.mktemp("remotes")
    store, origin = where / "dvc-store", where / "origin.git"
    run(["dvc", "remote", "add", "--local", "--force", "--default", "store", str(store)], repo)
    run(["git", "clone", "-q", "--bare", str(repo), str(origin)], where)
    yield store, origin
    run(["dvc", "remote", "remove", "--local", "store"], repo)


def fresh_clone(origin, store, dest):
    """A git clone with the DVC remote set, as a colleague would have it: no data, no models."""
    run(["git", "clone", "-q", str(origin), str(dest)], dest.parent)
    run(["dvc", "remote", "add", "--default", "store", str(store)], dest)
    assert not (dest / "models/merged").exists()
    return dest


@pytest.fixture(scope="module")
def queued(repo):
    """Two experiments queued with different eval.prompts, then run by the queue, each in its own copy of the
    workspace; the workspace's params.yaml before and after. (One worker: with two, `--run-all --jobs 2` once
    waited forever on a worker that had exited.)"""
    repo, _ = repo
    before = (repo / "params.yaml").read_bytes()
    for name, prompts in QUEUED.items():
        run(["dvc", "exp", "run", "--queue", "-n", name, "-S", f"eval.prompts={prompts}", *CHEAP], repo)
    output = run(["dvc", "exp", "run", "--run-all"], repo)
    yield repo, before, (repo / "params.yaml").read_bytes(), output
    run(["dvc", "queue", "stop"], repo)  # the idle worker, which would otherwise linger a minute


def test_a_fresh_clone_pulls_the_pipeline_and_registers_the_model_in_its_own_store(repo, remotes, tmp_path):
    """models/registered.json describes the MLflow store it was written for, and register's DVC output
    (models/registration.json) is in neither git nor the DVC remote: a clone has neither, and its `dvc repro` runs
    register alone, which registers in the clone's own store (another run id) and leaves every tracked file, dvc.lock
    too, as git has it."""
    import mlflow

    repo, _ = repo
    store, origin = remotes
    run(["dvc", "push", "--all-branches"], repo)  # the workspace may hold an experiment: push the branch's outputs too
    clone = fresh_clone(origin, store, tmp_path / "clone")
    run(["dvc", "pull"], clone)
    assert not (clone / "models/registered.json").exists()
    assert sorted(json.loads(run(["dvc", "status", "--json"], clone))) == ["register"]
    output = run(["dvc", "repro"], clone)
    assert ran_stages(output) == ["register"]
    assert UP_TO_DATE in run(["dvc", "status"], clone)
    # no tracked file changed but the remote fresh_clone added to .dvc/config
    assert run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!.dvc/config"], clone) == ""
    head = run(["git", "rev-parse", "HEAD"], repo).strip()
    assert run(["git", "rev-parse", "HEAD"], clone).strip() == head
    for path in ("models/merged/model.safetensors", "models/adapter/adapter_model.safetensors", "data/split/test.jsonl",
                 "reports/generations.jsonl"):
        assert (clone / path).is_file(), path
    # the clone's own store holds the version, its aliases and its run, as the clone's record says
    registered = json.loads((clone / "models/registered.json").read_text())
    assert registered["tracking_uri"] == "sqlite:///mlflow.db" and registered["version"] == 1
    client = mlflow.MlflowClient(f"sqlite:///{clone / 'mlflow.db'}")
    assert str(client.get_model_version_by_alias("lora-pipeline", "champion").version) == "1"
    assert sorted(client.get_model_version("lora-pipeline", "1").aliases) == registered["aliases"] == ["candidate",
                                                                                                      "champion"]
    logged = client.get_run(registered["run_id"])
    assert logged.info.status == "FINISHED" and logged.data.tags["registered_version"] == "1"
    assert client.get_model_version("lora-pipeline", "1").run_id == registered["run_id"]


def test_queued_experiments_keep_their_own_params_and_results(queued):
    import mlflow

    repo, before, after, output = queued
    assert after == before  # the workspace's params.yaml is untouched by the queue
    # each ran the evaluations and register only, after validate (which checks every params change)
    assert sorted(s for s in ran_stages(output) if s != "validate") == (["evaluate"] * 2 + ["evaluate_base"] * 2
                                                                         + ["register"] * 2), output
    shown = experiments(repo)
    client = mlflow.MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("lora-pipeline")
    for name, prompts in QUEUED.items():
        data = shown[name]["data"]
        ev = data["params"]["params.yaml"]["data"]["eval"]
        assert (ev["prompts"], ev["include_base"], ev["mgsm"]["path"]) == (prompts, False, ""), (name, ev)
        metrics = data["metrics"]["metrics/eval.json"]["data"]
        assert "base" not in metrics and "mgsm" not in metrics.get("accuracy", {}), (name, metrics)
        # its own results: as many held-out answers as its own eval.prompts asked for, in its cached outputs
        rev = shown[name]["rev"]
        lock = yaml.safe_load(run(["git", "show", f"{rev}:dvc.lock"], repo))
        out = next(o for o in lock["stages"]["evaluate"]["outs"] if o["path"] == "reports/generations.jsonl")
        cached = repo / ".dvc/cache/files/md5" / out["md5"][:2] / out["md5"][2:]
        assert heldout_generations(cached) == prompts * 5, name
        # and its own MLflow run, logged with its own params
        [logged] = [run_.data for run_ in client.search_runs([experiment.experiment_id],
                                                             f"tags.dvc_exp_name = '{name}'")]
        assert logged.tags["registered_version"]
        assert (logged.params["eval.prompts"], logged.params["eval.include_base"]) == (str(prompts), "False")


def test_experiment_pushed_to_git_and_dvc_remotes_pulls_into_a_fresh_clone(queued, remotes, tmp_path):
    repo, *_ = queued
    store, origin = remotes
    run(["dvc", "exp", "push", str(origin), "queued-p2"], repo)  # the experiment's commit, and its outputs to `store`
    clone = fresh_clone(origin, store, tmp_path / "clone")
    run(["dvc", "exp", "pull", "origin", "queued-p2"], clone)
    assert "queued-p2" in experiments(clone)
    # `dvc exp apply` here would find no outputs: `exp pull` brings the commit, not its outputs (DVC 3.67)
    run(["dvc", "exp", "branch", "queued-p2", "p2"], clone)
    run(["git", "checkout", "-q", "p2"], clone)
    run(["dvc", "pull"], clone)
    # every output the experiment recorded is there; only register has to run, for the clone's own store
    assert sorted(json.loads(run(["dvc", "status", "--json"], clone))) == ["register"]
    assert yaml.safe_load((clone / "params.yaml").read_text())["eval"]["prompts"] == 2
    assert heldout_generations(clone / "reports/generations.jsonl") == 2 * 5
    assert (clone / "models/merged/model.safetensors").is_file()


def test_temp_experiment_runs_in_a_copy_and_leaves_the_workspace_as_it_was(repo):
    """`dvc exp run --temp` runs in a copy under .dvc/tmp/exps: the workspace's params.yaml (and dvc.lock, and its
    outputs) stay byte for byte, and the experiment shows in `dvc exp show` with its own params and results. The
    cheapest change that still runs a stage: register.model_name re-runs register only, after validate."""
    repo, _ = repo
    kept = {path: (repo / path).read_bytes() for path in ("params.yaml", "dvc.lock", "models/registered.json")}
    output = run(["dvc", "exp", "run", "--temp", "-n", "temp-run", "-S", "register.model_name=lora-temp"], repo)
    assert sorted(ran_stages(output)) == ["register", "validate"], output
    assert {path: (repo / path).read_bytes() for path in kept} == kept
    shown = experiments(repo)
    assert "temp-run" in shown, list(shown)
    data = shown["temp-run"]["data"]
    assert data["params"]["params.yaml"]["data"]["register"]["model_name"] == "lora-temp"
    assert "compliance" in data["metrics"]["metrics/eval.json"]["data"]
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")  # the temp copy's register used this store
    version = client.get_model_version_by_alias("lora-temp", "candidate")
    assert str(version.version) == "1" and client.get_run(version.run_id).data.tags["dvc_exp_name"] == "temp-run"
