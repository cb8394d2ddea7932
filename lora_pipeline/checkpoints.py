"""Resumable training: a checkpoint folder named by what training depends on, and the last complete checkpoint in it.

A checkpoint is resumed only by a run with the same params, code and input data: its folder name is a hash of the
train stage's params and of the content of every dependency dvc.yaml lists for the stage.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import yaml

CHECKPOINTS = Path("checkpoints")
_STEP = re.compile(r"^checkpoint-(\d+)$")


def _hash_path(digest, path: Path) -> None:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        digest.update(str(file.relative_to(path) if path.is_dir() else file).encode() + b"\0")
        with open(file, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())


def content_hash(path: Path) -> str:
    """sha256 of a file's or a folder's content (relative names and bytes): the same bytes anywhere, the same hash."""
    digest = hashlib.sha256()
    _hash_path(digest, path)
    return digest.hexdigest()


def run_fingerprint(stage: str, root: Path = Path(".")) -> str:
    """sha256 (first 16 hex digits) of the params.yaml values the stage declares in dvc.yaml and of the content
    of its dvc.yaml dependencies: what DVC itself decides a re-run by."""
    from lora_pipeline.params import declared_keys, flat_keys, is_declared

    stage_def = yaml.safe_load((root / "dvc.yaml").read_text())["stages"][stage]
    values = flat_keys(yaml.safe_load((root / "params.yaml").read_text()))
    declared = declared_keys(stage, root)
    used = {k: v for k, v in values.items() if is_declared(k, declared)}
    digest = hashlib.sha256(json.dumps(used, sort_keys=True).encode())
    for dep in stage_def.get("deps", []):
        path = root / re.sub(r"\$\{([\w.]+)\}", lambda m: str(values[m.group(1)]), dep)
        if path.exists():
            _hash_path(digest, path)
    return digest.hexdigest()[:16]


def run_dir(fingerprint: str, root: Path = Path(".")) -> Path:
    return root / CHECKPOINTS / f"train-{fingerprint}"


def last_complete(folder: Path) -> Path | None:
    """The checkpoint with the highest step that was written to the end (the Trainer writes trainer_state.json
    last); a half-written one, left by a kill during saving, is ignored."""
    if not folder.is_dir():
        return None
    done = [(int(m.group(1)), p) for p in folder.iterdir()
            if (m := _STEP.match(p.name)) and (p / "trainer_state.json").is_file()]
    return max(done)[1] if done else None


def hold_run_lock(folder: Path):
    """An exclusive lock on the run's checkpoint folder, held until the process exits; fails at once with a clear
    error if another training of the same params, code and data holds it (two trainers must never share it)."""
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    handle = open(folder / ".lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SystemExit(f"another training of the same params, code and data is running ({folder} is locked); "
                         "wait for it to finish or stop it first") from None
    return handle
