"""A disk cache of what validate derives from the installed libraries (field names, module names)."""
from __future__ import annotations

import json
import os
from pathlib import Path


def cached(name: str, compute):
    """compute(), a JSON value, kept in ~/.cache/lora-pipeline/<name> ($XDG_CACHE_HOME): what validate derives
    from the installed libraries, never an input or output of a stage. Written whole or not at all; a cache that
    cannot be read or written only costs the work again."""
    path = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lora-pipeline" / name
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
