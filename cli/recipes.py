"""Recipes: short files of params overrides (dotted keys) that run as a DVC experiment on top of params.yaml.

    python -m cli.recipes qwen2-0.5b [--dry-run] [-- dvc exp run options, e.g. --queue or --temp]
recipes/<name>.yaml holds only what differs from params.yaml; `extends: <name>` applies another recipe first (the
seeds' exact settings in recipes/seed/ extend the fast recipes). Running one is `dvc exp run -n <name> -S key=value`
for each key, so params.yaml keeps every key and `dvc exp show` lines all experiments up on the same columns.
"""
from __future__ import annotations

import argparse
import copy
import json
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

from lora_pipeline.config.params import ParamsError, ROOT, flat_keys

def recipe_path(name: str, root: Path = ROOT) -> Path:
    path = root / "recipes" / f"{name}.yaml"
    if not path.is_file():
        known = sorted(str(p.relative_to(root / "recipes"))[:-5] for p in (root / "recipes").rglob("*.yaml"))
        raise ParamsError(f"no recipe '{name}' ({path.relative_to(root)} does not exist); recipes: {', '.join(known)}")
    return path


def overrides(name: str, root: Path = ROOT, _seen: tuple = ()) -> dict:
    """The recipe's dotted keys and values, those of the recipe it extends first."""
    if name in _seen:
        raise ParamsError(f"recipes/{name}.yaml: `extends` loops back to itself ({' -> '.join([*_seen, name])})")
    path = recipe_path(name, root)
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ParamsError(f"{path.relative_to(root)}: expected `dotted.key: value` lines, got {type(raw).__name__}")
    parent = raw.pop("extends", None)
    nested = [key for key, value in raw.items() if isinstance(value, dict) and key.count(".") == 0]
    if nested:
        raise ParamsError(f"{path.relative_to(root)}: {', '.join(nested)}: write dotted keys (e.g. lora.r: 16), "
                          "not nested sections")
    return {**(overrides(parent, root, (*_seen, name)) if parent else {}), **raw}


def compose(name: str, root: Path = ROOT) -> dict:
    """params.yaml with the recipe applied, as `dvc exp run -S` would leave it. A key params.yaml lacks is allowed
    only inside train.sft and lora (any trl.SFTConfig / peft.LoraConfig field; validate checks its name)."""
    params = yaml.safe_load((root / "params.yaml").read_text())
    known = flat_keys(params)
    composed = copy.deepcopy(params)
    for key, value in overrides(name, root).items():
        *parents, leaf = key.split(".")
        if key not in known and not any(key.startswith(p) for p in ("train.sft.", "lora.")):
            raise ParamsError(f"recipes/{name}.yaml: {key} is not a params.yaml key")
        node = composed
        for part in parents:
            if not isinstance(node.get(part), dict):
                raise ParamsError(f"recipes/{name}.yaml: {key}: {'.'.join(parents)} is not a params.yaml section")
            node = node[part]
        node[leaf] = value
    return composed


def apply_sets(params: dict, sets: list[str]) -> dict:
    """`KEY=VALUE` strings (a dotted params key, a YAML value) applied to a params tree, as a benchmark's --set."""
    for item in sets:
        key, sep, value = item.partition("=")
        *parents, leaf = key.split(".")
        node = params
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not sep or not isinstance(node, dict):
            raise ParamsError(f"--set {item}: expected KEY=VALUE with KEY a dotted params key")
        node[leaf] = yaml.safe_load(value)
    return params


def override_value(value) -> str:
    """A value in the override grammar that `dvc exp run -S` parses (Hydra's): JSON, but with bare dict keys."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{key}:{override_value(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(override_value(item) for item in value) + "]"
    return json.dumps(value)


def set_args(key: str, value, params: dict) -> list[str]:
    """The `-S` arguments that leave `key` equal to `value`: a new key is added (`++`), a dict replaces the old one
    whole (deleted first: `~`), anything else is a plain override."""
    node = params
    for part in key.split("."):
        node = node.get(part, KeyError) if isinstance(node, dict) else KeyError
    if node is KeyError:
        return ["-S", f"++{key}={override_value(value)}"]
    if isinstance(value, dict):
        return ["-S", f"~{key}", "-S", f"++{key}={override_value(value)}"]
    return ["-S", f"{key}={override_value(value)}"]


def exp_run_command(name: str, extra: list[str] = (), root: Path = ROOT) -> list[str]:
    """`dvc exp run -n <name>` with the `-S` sets of the recipe's overrides."""
    params = yaml.safe_load((root / "params.yaml").read_text())
    sets = [arg for key, value in overrides(name, root).items() for arg in set_args(key, value, params)]
    return ["dvc", "exp", "run", "-n", name.replace("/", "-"), *sets, *extra]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", help="a recipe: recipes/<name>.yaml, e.g. qwen2-0.5b or seed/qwen2-0.5b")
    parser.add_argument("--dry-run", action="store_true", help="print the dvc exp run command, run nothing")
    parser.add_argument("extra", nargs="*", help="after --: options for dvc exp run (--queue, --temp, ...)")
    args = parser.parse_args(argv)
    from lora_pipeline.validation.all_checks import check_library_fields, check_scheduler
    from lora_pipeline.config.params import for_stage, validate

    try:  # the recipe's own mistakes, before DVC touches params.yaml; the rest is the validate stage's job
        params = for_stage(validate(compose(args.name), source=f"recipes/{args.name}.yaml"), "recipe",
                             ["train", "lora"])
        check_library_fields(params.train, params.lora)
        check_scheduler(params.train)
    except (ParamsError, ValueError) as exc:
        print(f"recipe {args.name}: {exc}", file=sys.stderr)
        return 2
    command = exp_run_command(args.name, args.extra)
    print(shlex.join(command), flush=True)
    return 0 if args.dry_run else subprocess.call(command)


if __name__ == "__main__":
    sys.exit(main())
