"""Resumable training: a checkpoint folder named by what training depends on, and the last complete checkpoint in it.

A checkpoint is resumed only by a run with the same params, code and input data: its folder name is a hash of the
train stage's params and of the content of every dependency dvc.yaml lists for the stage. And only if it is whole:
a manifest of its files' sizes and hashes, written last, must still match them. A stage stopped by a signal says so
in one line (stop_line): the signal, the checkpoint kept and the way on.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
from pathlib import Path


CHECKPOINTS = Path("checkpoints")
MANIFEST = "checkpoint_manifest.json"  # each file's size and sha256, written after all of them
_PARTIAL = f".{MANIFEST}.partial"
DAMAGED = "damaged"  # where a checkpoint that is not whole is set aside, inside the run's folder
_STEP = re.compile(r"^checkpoint-(\d+)$")


def _compiled(path: Path) -> bool:
    """Python's bytecode cache, which .dvcignore keeps out of DVC's hash of a folder dep too."""
    return "__pycache__" in path.parts or path.suffix == ".pyc"


def _hash_path(digest, path: Path) -> None:
    files = sorted(p for p in path.rglob("*") if p.is_file() and not _compiled(p.relative_to(path))) \
        if path.is_dir() else [path]
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
    from lora_pipeline.config import dvcfiles
    from lora_pipeline.config.params import flat_keys

    values = dvcfiles.read_yaml(root / "params.yaml")
    declared = dvcfiles.declared_params(stage, root)
    used = {k: v for k, v in flat_keys(values).items() if dvcfiles.is_declared(k, declared)}
    digest = hashlib.sha256(json.dumps(used, sort_keys=True).encode())
    for dep in dvcfiles.stage(stage, root, values).get("deps", []):
        path = root / dep
        if path.exists():
            _hash_path(digest, path)
    return digest.hexdigest()[:16]


def run_dir(fingerprint: str, root: Path = Path(".")) -> Path:
    return root / CHECKPOINTS / f"train-{fingerprint}"


def file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(checkpoint: Path) -> None:
    """Record the size and sha256 of every file of a checkpoint, in MANIFEST, written last and atomically: once
    every process has written its files, a checkpoint with a manifest was saved whole."""
    files = {str(p.relative_to(checkpoint)): {"bytes": p.stat().st_size, "sha256": file_digest(p)}
             for p in sorted(checkpoint.rglob("*")) if p.is_file() and p.name not in (MANIFEST, _PARTIAL)}
    partial = checkpoint / _PARTIAL
    partial.write_text(json.dumps({"files": files}, indent=1) + "\n")
    partial.replace(checkpoint / MANIFEST)


def damage(checkpoint: Path) -> str | None:
    """Why a checkpoint is not as it was written (no manifest, a file missing, cut short or changed), or None.
    Sizes are compared first: a cut-off file is found without reading it."""
    try:
        files = json.loads((checkpoint / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"no {MANIFEST} (its saving did not finish)"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{MANIFEST} is unreadable ({exc})"
    for name, written in files.items():
        path = checkpoint / name
        if not path.is_file():
            return f"{name} is missing"
        if (size := path.stat().st_size) != written["bytes"]:
            return f"{name} is {size} bytes, {written['bytes']} were written"
    for name, written in files.items():
        if file_digest(checkpoint / name) != written["sha256"]:
            return f"{name} has other bytes than were written (its sha256 differs)"
    return None


def set_aside(checkpoint: Path) -> Path:
    """Move a damaged checkpoint into the run's DAMAGED folder (kept, never deleted), where neither the Trainer's
    rotation nor the next lookup sees it; a second one of the same step gets a numbered name."""
    folder = checkpoint.parent / DAMAGED
    folder.mkdir(exist_ok=True)
    target, number = folder / checkpoint.name, 1
    while target.exists():
        number += 1
        target = folder / f"{checkpoint.name}.{number}"
    checkpoint.rename(target)
    return target


def last_complete(folder: Path, report=print) -> Path | None:
    """The checkpoint with the highest step whose files are all as its manifest recorded them. Each newer one that
    is not (a kill while saving, a full disk, a lost node) is set aside into DAMAGED, with one line to `report`
    that names it and why; None when no whole one is left. Only the process that holds the run's lock calls it."""
    if not folder.is_dir():
        return None
    steps = sorted(((int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP.match(p.name)) and p.is_dir()),
                   reverse=True)
    for _, checkpoint in steps:
        problem = damage(checkpoint)
        if problem is None:
            return checkpoint
        moved = set_aside(checkpoint)
        report(f"{checkpoint.name} set aside in {moved.parent}: {problem}")
    return None


def clear_run(folder: Path) -> None:
    """A finished run's checkpoints removed: nothing is left to resume. Damaged ones set aside stay for a look."""
    if not (folder / DAMAGED).is_dir():
        shutil.rmtree(folder, ignore_errors=True)
        return
    for path in folder.iterdir():
        if path.name != DAMAGED:
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


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
    os.utime(handle.name)  # when this run took its lock: how a launcher finds its run (kept_checkpoint)
    return handle


def kept_checkpoint(since: float, root: Path = Path(".")) -> Path | None:
    """The newest checkpoint with its manifest (so saved whole) of the training that took its run's lock at or
    after `since` (a time.time()): what a training stopped since then keeps for the next run to resume. None if no
    training took a lock since, or it has no such checkpoint yet. Found without the run's hash, which a launcher
    cannot cheaply compute (it reads the whole base model)."""
    locks = [(lock.stat().st_mtime, lock.parent) for lock in (root / CHECKPOINTS).glob("train-*/.lock")]
    locks = [(taken, folder) for taken, folder in locks if taken >= since]
    if not locks:
        return None
    folder = max(locks)[1]
    steps = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP.match(p.name)) and (p / MANIFEST).is_file()]
    return max(steps)[1] if steps else None


def stop_line(stage: str, signum: int, checkpoint: Path | None, at_step: int | None = None) -> str:
    """One line for a stage that a signal stopped: which stage, which signal (at which step, when known), the
    checkpoint kept and the way on."""
    stopped = f"{stage} stopped by {signal_name(signum)}" + (f" at step {at_step}" if at_step is not None else "")
    return f"{stopped}; {kept_clause(checkpoint)}"


def signal_name(signum: int) -> str:
    """e.g. SIGTERM (signal 15)"""
    try:
        return f"{signal.Signals(signum).name} (signal {signum})"
    except ValueError:
        return f"signal {signum}"


def kept_clause(checkpoint: Path | None) -> str:
    """What a stopped stage keeps and the way on, for the end of its one line."""
    if checkpoint is None:
        return "kept: no checkpoint; `dvc repro` runs it again"
    step = _STEP.match(checkpoint.name).group(1)
    return f"kept: checkpoint {checkpoint} (step {step}); `dvc repro` resumes from it"
