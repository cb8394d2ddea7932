"""The machine's cache folder: what validate derives from the installed libraries, and torch.compile's kernels."""
from __future__ import annotations

import json
import os
from pathlib import Path


def cache_root(environ=os.environ) -> Path:
    """~/.cache/lora-pipeline ($XDG_CACHE_HOME/lora-pipeline): what this machine derives once and every run reuses,
    outside any copy of the repository (queued experiments run in temporary ones), never a stage's input or output."""
    return Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lora-pipeline"


def cached(name: str, compute):
    """compute(), a JSON value, kept in cache_root()/<name>: what validate derives from the installed libraries.
    Written whole or not at all; a cache that cannot be read or written only costs the work again."""
    path = cache_root() / name
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    value = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(value))
        partial.replace(path)
    except OSError:
        pass
    return value
