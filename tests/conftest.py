"""Shared fixtures: offline environment, the repository root, MGSM's location, a tiny model on disk."""
import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
MGSM = ROOT.parent / "shared" / "data" / "mgsm"
# What a copy of the repository leaves out: local environments, stores and everything DVC produces.
# Outputs, run state (checkpoints of an interrupted training, logs) and local tool folders stay behind.
COPY_IGNORE = shutil.ignore_patterns(".venv", ".git", "__pycache__", ".pytest_cache", "mlflow.db", "mlartifacts",
                                     "mlruns", "cache", "tmp", "data", "models", "metrics", "plots", "reports",
                                     "checkpoints", "logs", ".whl*", ".bench", "docs")


def copy_repo(dest: Path) -> Path:
    """The project's files (no outputs) in a fresh git repository at dest."""
    shutil.copytree(ROOT, dest, ignore=COPY_IGNORE)
    shutil.copytree(ROOT / "data" / "local", dest / "data" / "local")  # local data files: a dependency of fetch
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "copy"]):
        subprocess.run(cmd, cwd=dest, check=True, env=git_env())
    return dest


def git_env() -> dict:
    return {**os.environ, "GIT_AUTHOR_NAME": "test", "GIT_AUTHOR_EMAIL": "test@localhost",
            "GIT_COMMITTER_NAME": "test", "GIT_COMMITTER_EMAIL": "test@localhost"}


def run_env(**extra) -> dict:
    """The environment for a command under test: this Python's tools first on PATH, no outside MLflow/DVC state."""
    env = {k: v for k, v in git_env().items() if k not in ("MLFLOW_TRACKING_URI", "DVC_ROOT", "DVC_EXP_NAME")}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")
    return {**env, **extra}


def run(cmd: list[str], cwd: Path, env: dict | None = None, timeout: float | None = None) -> str:
    """Run a command in run_env(); fail the test with its output if it fails. No time limit by default: a slow,
    loaded machine must not fail a test that would pass."""
    proc = subprocess.run(cmd, cwd=cwd, env=run_env(**(env or {})), capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}:\n{output[-6000:]}")
    return output


@contextlib.contextmanager
def edited_params(repo: Path, **dotted):
    """params.yaml of a copy edited for the duration of a block, then restored byte for byte."""
    original = (repo / "params.yaml").read_text()
    set_params(repo, **dotted)
    try:
        yield
    finally:
        (repo / "params.yaml").write_text(original)


def set_params(repo: Path, **dotted):
    """Edit params.yaml in a copy, e.g. set_params(repo, **{"eval.prompts": 4})."""
    import yaml

    path = repo / "params.yaml"
    params = yaml.safe_load(path.read_text())
    for key, value in dotted.items():
        node = params
        *parents, leaf = key.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    path.write_text(yaml.safe_dump(params, sort_keys=False))


@pytest.fixture(scope="session")
def repo(tmp_path_factory):
    """A copy of the repository after `dvc repro` on the default (with MGSM from the shared folder)."""
    repo = copy_repo(tmp_path_factory.mktemp("pipeline") / "repo")
    if MGSM.is_dir():
        set_params(repo, **{"eval.mgsm.path": str(MGSM)})
    output = run(["dvc", "repro"], repo)
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "baseline"], repo)
    return repo, output
