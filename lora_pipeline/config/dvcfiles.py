"""The pipeline's DVC files read as DVC reads them: params.yaml, each stage of dvc.yaml with `${}` resolved by DVC's
own interpolation, the params keys a stage declares, and what dvc.lock recorded."""
from __future__ import annotations

from pathlib import Path

from dvc.parsing.context import Context
from dvc.utils.serialize import parse_yaml

ROOT = Path(__file__).resolve().parents[2]


def read_yaml(path: Path) -> dict:
    """A YAML file parsed as DVC parses it (YAML 1.2: 1e-3 is a float, yes a string); {} if it is missing."""
    return parse_yaml(path.read_text(), str(path)) if path.is_file() else {}


def stages(root: Path = ROOT) -> dict:
    """dvc.yaml's stages, as written."""
    return read_yaml(root / "dvc.yaml").get("stages", {})


def stage(name: str, root: Path = ROOT, params: dict | None = None) -> dict:
    """One stage of dvc.yaml with `${...}` resolved from params.yaml's values (or `params`), as DVC runs it."""
    defined = stages(root)
    if name not in defined:
        raise KeyError(f"dvc.yaml has no stage '{name}'")
    return Context(read_yaml(root / "params.yaml") if params is None else params).resolve(defined[name])


def declared_params(name: str, root: Path = ROOT) -> list[str]:
    """The params.yaml keys that dvc.yaml lists for a stage (a section name covers every key inside it)."""
    if name not in (defined := stages(root)):
        raise KeyError(f"dvc.yaml has no stage '{name}'")
    keys = []
    for entry in defined[name].get("params", []):
        if isinstance(entry, str):
            keys.append(entry)
        else:  # {file: [keys]}
            keys.extend(k for file, file_keys in entry.items() if Path(file).name == "params.yaml" for k in file_keys)
    return keys


def is_declared(key: str, declared: list[str]) -> bool:
    """Whether a dotted key is one that dvc.yaml lists, or lies inside a section it lists."""
    return any(key == d or key.startswith(d + ".") for d in declared)


def locked(root: Path = ROOT) -> dict:
    """dvc.lock's stages: what each last ran with (deps, params) and produced (outs)."""
    return read_yaml(root / "dvc.lock").get("stages", {}) or {}


def locked_params(name: str, root: Path = ROOT) -> dict:
    """The params.yaml values dvc.lock records for a stage, keyed as dvc.yaml declares them (`model.name`, or a
    section with its values inside); {} if the stage never ran."""
    return (locked(root).get(name) or {}).get("params", {}).get("params.yaml", {}) or {}
