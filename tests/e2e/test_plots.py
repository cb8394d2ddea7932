"""The plots of a reproduced pipeline: `dvc plots show` lists loss per step and compliance per language with base
and fine-tuned apart, and the same plots are PNGs in reports/ for viewing offline."""
import json

import pytest

from conftest import run

pytestmark = pytest.mark.e2e  # every test here runs the pipeline, DVC or an MLflow server

LANGUAGES = {"en", "de", "es", "fr", "it", "overall"}


def test_dvc_plots_list_loss_and_compliance_per_model(repo):
    repo, _ = repo
    shown = json.loads(run(["dvc", "plots", "show", "--json"], repo))
    assert not shown.get("errors"), shown.get("errors")
    plots = shown["data"]

    loss = plots["plots/train_loss.csv"][0]["content"]
    steps = [(int(v["step"]), float(v["loss"])) for v in loss["data"]["values"]]
    logged = (repo / "plots/train_loss.csv").read_text().splitlines()[1:]
    assert steps == [(int(line.split(",")[0]), float(line.split(",")[1])) for line in logged]

    compliance = plots["compliance"][0]["content"]
    # one column per model file: base and fine-tuned are never drawn as one bar
    assert compliance["encoding"]["column"]["field"] == "filename"
    drawn = {}
    for value in compliance["data"]["values"]:
        drawn.setdefault(value["filename"], {})[value["language"]] = float(value["compliance"])
    metrics = json.loads((repo / "metrics/eval.json").read_text())
    assert drawn == {"finetuned.csv": metrics["compliance"], "base.csv": metrics["base"]["compliance"]}
    assert set(metrics["compliance"]) == LANGUAGES

    for name in ("train_loss", "compliance", "report"):
        path = f"reports/{name}.png"
        assert plots[path][0]["type"] == "image", path
        assert (repo / path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
