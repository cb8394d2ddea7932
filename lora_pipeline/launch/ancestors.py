"""The processes between a stage's command and the DVC process that runs it, and whether they are all still there:
DVC exits on SIGTERM without stopping its stage's command, which runs under a shell (DVC's $SHELL -c, or /bin/sh)
that may outlive it."""
from __future__ import annotations

from pathlib import Path

import psutil


def dvc_ancestors() -> list[psutil.Process]:
    """The processes from this one's parent up to the DVC process that runs the stage, or [] when DVC did not
    start it (a launch by hand, under nohup say, must not stop when its shell goes)."""
    chain = []
    for process in psutil.Process().parents():
        chain.append(process)
        try:
            if is_dvc(process.cmdline()):
                return chain
        except psutil.Error:
            return []
    return []


def is_dvc(cmdline: list[str]) -> bool:
    """DVC's own process, however started: `dvc ...` (its script, or a binary), `python -m dvc ...`, or
    `python .../dvc/__main__.py ...` (how DVC starts its queue workers)."""
    head = cmdline[:3]
    return (any(Path(arg).name == "dvc" for arg in head[:2]) or head[1:3] == ["-m", "dvc"]
            or (len(head) > 1 and Path(head[1]).parts[-2:] == ("dvc", "__main__.py")))


def alive(process: psutil.Process) -> bool:
    """Running, and not a zombie (an exited process its parent has not reaped yet)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def any_gone(processes: list[psutil.Process]) -> bool:
    return not all(map(alive, processes))
