"""Writing stage outputs atomically: a temporary path first, then one rename, so a crash never leaves half a file."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path


def write_text(path: str | Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_json(path: str | Path, data) -> None:
    """Indented JSON with sorted keys, so the same content gives the same bytes."""
    write_text(path, json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def replace_dir(staged: str | Path, dest: str | Path) -> None:
    """Move a fully written folder into place of `dest` (the old one is removed only once the new one is there)."""
    staged, dest = Path(staged), Path(dest)
    old = dest.with_name(f".{dest.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        os.replace(dest, old)
    os.replace(staged, dest)
    shutil.rmtree(old, ignore_errors=True)


def staging_dir(dest: str | Path) -> Path:
    """An empty sibling of `dest` to write into, then hand to replace_dir."""
    dest = Path(dest)
    staged = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    return staged
