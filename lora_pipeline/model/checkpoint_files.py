"""Which safetensors file of a checkpoint folder holds each tensor (one file, or shards with an index)."""
from __future__ import annotations

import json
from pathlib import Path


def tensor_files(path) -> dict[str, Path]:
    """Tensor name -> the safetensors file of a checkpoint folder (one file, or sharded with an index) that holds it."""
    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {name: folder / fname for name, fname in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "pt") as f:
        return dict.fromkeys(f.keys(), folder / "model.safetensors")
