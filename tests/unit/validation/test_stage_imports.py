"""validate and split import none of the machine-learning libraries, on a machine whose cache is still empty too:
they start in about a second, and on a GPU machine no CUDA context is made."""
import json
import shutil
import subprocess
import sys

from conftest import ROOT, run_env
from helpers import load_rows, shipped
from lora_pipeline.config.outputs import write_jsonl
from lora_pipeline.config.params import validate

# What takes seconds to import (torch and the libraries built on it, MLflow); the stages that need none of them
# derive what they need from them in a child process, once per cache entry.
HEAVY = {"torch", "transformers", "peft", "trl", "datasets", "accelerate", "mlflow", "bitsandbytes"}

# Runs a stage as `python -m` does and writes the top-level modules it imported, also when it exits with an error.
PROBE = """import json, runpy, sys
stage, out = sys.argv[1:]
sys.argv = [stage]
try:
    runpy.run_module(stage, run_name="__main__", alter_sys=True)
finally:
    with open(out, "w") as file:
        json.dump(sorted({name.split(".")[0] for name in sys.modules}), file)
"""


def test_validate_and_split_import_no_machine_learning_library_with_an_empty_cache(tmp_path):
    repo = tmp_path / "repo"
    for folder in ("lora_pipeline", "stages", "configs"):
        shutil.copytree(ROOT / folder, repo / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for file in ("params.yaml", "dvc.yaml"):
        shutil.copy(ROOT / file, repo / file)
    write_jsonl(load_rows(validate(shipped()).data)[0], repo / "data/raw/data.jsonl")  # what fetch writes
    env = run_env(XDG_CACHE_HOME=str(tmp_path / "cache"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    for stage in ("stages.validate", "stages.split"):
        modules = tmp_path / f"{stage}.json"
        done = subprocess.run([sys.executable, "-c", PROBE, stage, str(modules)], cwd=repo, env=env,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
        assert HEAVY.isdisjoint(json.loads(modules.read_text())), (stage, HEAVY & set(json.loads(modules.read_text())))
    cache = tmp_path / "cache/lora-pipeline"  # empty before: each entry was derived in this run
    assert all(len(list(cache.glob(f"{entry}-*.json"))) == 1 for entry in ("fields", "layout", "mlflow-names"))
    assert json.loads((repo / "metrics/split.json").read_text())["test_rows"] > 0
