"""Each stage's deps in dvc.yaml list every project module its code can import, lazy imports included."""
import ast
import re
from collections.abc import Iterable
from functools import cache
from pathlib import Path, PurePosixPath

import pytest
import yaml

from conftest import ROOT

PACKAGES = ("stages", "lora_pipeline")  # the project's code: every module under these folders
DVC_STAGES = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


def stage_modules(cmd: str) -> list[str]:
    """The modules a stage's cmd runs: `python -m stages.X`, or `python -m lora_pipeline.launch <stage>` and the
    module that launch starts for the stage (lora_pipeline.launch.STAGES)."""
    from lora_pipeline.launch import STAGES

    found = re.search(r"-m\s+([\w.]+)(?:\s+(\w+))?", cmd)
    assert found, f"no `-m <module>` in cmd {cmd!r}"
    if found.group(1) == "lora_pipeline.launch":
        return [found.group(1), STAGES[found.group(2)][0][0]]
    return [found.group(1)]


def stage_files(stage: str, root: Path = ROOT) -> set[Path]:
    """The project files that a stage's cmd can import."""
    return {path for module in stage_modules(DVC_STAGES[stage]["cmd"]) for path in reached_files(root, module)}


def module_file(root: Path, name: str) -> Path | None:
    """The project file (relative to root) that defines module `name`, or None when it is not a project module."""
    parts = name.split(".")
    if parts[0] not in PACKAGES:
        return None
    base = root.joinpath(*parts)
    for candidate in (base.parent / f"{parts[-1]}.py", base / "__init__.py"):
        if candidate.is_file():
            return candidate.relative_to(root)
    return None


def with_parents(name: str) -> list[str]:
    """Importing a.b.c runs a/__init__.py and a/b/__init__.py first: a, a.b, a.b.c."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


@cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def imported_names(root: Path, path: Path) -> Iterable[str]:
    """Every module name an import anywhere in the file may load (top-level, in functions, in methods)."""
    package = list(path.parent.parts)  # the package of a module and of a package's __init__.py alike
    for node in ast.walk(parsed(root / path)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            prefix = package[:len(package) - node.level + 1] if node.level else []
            base = ".".join(prefix + (node.module.split(".") if node.module else []))
            yield base
            # `from pkg import x` loads the module pkg.x when x is one (module_file drops names that are not)
            yield from (f"{base}.{alias.name}" for alias in node.names if alias.name != "*")


def reached_files(root: Path, module: str) -> set[Path]:
    """The project files that running `python -m module` can import, transitively."""
    reached, pending = set(), with_parents(module)
    while pending:
        path = module_file(root, pending.pop())
        if path is None or path in reached:
            continue
        reached.add(path)
        pending.extend(parent for name in imported_names(root, path) for parent in with_parents(name))
    return reached


def has_code(root: Path, path: Path) -> bool:
    """Whether a file runs anything: a package __init__.py holding at most a docstring runs nothing."""
    body = parsed(root / path).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return bool(body) or path.name != "__init__.py"


def cmd_files(root: Path, cmd: str) -> set[Path]:
    """The project files a cmd imports, through every module it runs."""
    return set().union(*(reached_files(root, module) for module in stage_modules(cmd)))


def required_files(root: Path, cmd: str) -> set[Path]:
    """The files a stage running `cmd` must list in its deps."""
    return {path for path in cmd_files(root, cmd) if has_code(root, path)}


def stage_required(stage: str) -> set[Path]:
    return {path for path in stage_files(stage) if has_code(ROOT, path)}


def covers(dep: str, path: Path) -> bool:
    """A dep lists a file when it is that file or a folder above it."""
    return PurePosixPath(path).is_relative_to(PurePosixPath(dep.rstrip("/")))


def missing_deps(deps: list[str], required: set[Path]) -> list[str]:
    return sorted(str(path) for path in required if not any(covers(dep, path) for dep in deps))


def stale_deps(deps: list[str], reached: set[Path]) -> list[str]:
    """Listed .py files the stage cannot import."""
    return sorted(dep for dep in deps if dep.endswith(".py") and Path(dep) not in reached)


def stage_deps(stage: str) -> list[str]:
    return [dep for dep in DVC_STAGES[stage]["deps"] if isinstance(dep, str)]


@pytest.mark.parametrize("stage", sorted(DVC_STAGES))
def test_deps_list_every_module_the_stage_imports(stage):
    required = stage_required(stage)
    missing = missing_deps(stage_deps(stage), required)
    assert not missing, f"stage {stage}: dvc.yaml deps miss {', '.join(missing)}"


@pytest.mark.parametrize("stage", sorted(DVC_STAGES))
def test_deps_list_no_module_the_stage_cannot_import(stage):
    reached = stage_files(stage)
    stale = stale_deps(stage_deps(stage), reached)
    assert not stale, f"stage {stage}: dvc.yaml deps list {', '.join(stale)}, which it never imports"


@pytest.mark.parametrize("stage", sorted(DVC_STAGES))
def test_a_dropped_module_is_named(stage):
    required = stage_required(stage)
    dropped = sorted(str(path) for path in required)[-1]
    deps = [dep for dep in stage_deps(stage) if dep != dropped]
    assert dropped in missing_deps(deps, required)
    assert missing_deps(deps + ["lora_pipeline", "stages/"], required) == []  # a folder covers its files


# The stages that run each data-side module, and so re-run when it changes: reading and converting data is fetch's
# work (validate checks data.format and data.columns), the split split's (validate checks its rule); train, merge,
# evaluate and register read and write JSON Lines only.
RUN_BY = {
    "lora_pipeline/formats.py": {"validate", "fetch"},
    "lora_pipeline/builtin_data.py": {"fetch"},
    "lora_pipeline/hub.py": {"fetch"},
    "lora_pipeline/data.py": {"fetch"},
    "lora_pipeline/splitting.py": {"validate", "split"},
}


@pytest.mark.parametrize("module", sorted(RUN_BY))
def test_only_the_stages_that_run_a_data_module_depend_on_it(module):
    listing = {stage for stage in DVC_STAGES if any(covers(dep, Path(module)) for dep in stage_deps(stage))}
    running = {stage for stage in DVC_STAGES
               if Path(module) in stage_files(stage)}
    assert listing == running == RUN_BY[module], f"{module}: listed by {sorted(listing)}, run by {sorted(running)}"


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


TREE = {
    "stages/__init__.py": "",
    "stages/run.py": "from .helper import step\n\ndef main():\n    from lora_pipeline import lazy\n",
    "stages/helper.py": "import lora_pipeline.pkg.inner\n",
    "stages/other.py": "",
    "lora_pipeline/__init__.py": '"""Docstring only."""\n',
    "lora_pipeline/lazy.py": "class Model:\n    def load(self):\n        from lora_pipeline.deep import thing\n",
    "lora_pipeline/deep.py": "import json\nthing = json\n",
    "lora_pipeline/pkg/__init__.py": "from lora_pipeline import deep\n",
    "lora_pipeline/pkg/inner.py": "",
    "lora_pipeline/unused.py": "",
}


def test_closure_follows_lazy_relative_and_package_imports(tmp_path):
    root = write_tree(tmp_path, TREE)
    reached = {str(path) for path in reached_files(root, "stages.run")}
    assert reached == {"stages/__init__.py", "stages/run.py", "stages/helper.py", "lora_pipeline/__init__.py",
                       "lora_pipeline/lazy.py", "lora_pipeline/deep.py", "lora_pipeline/pkg/__init__.py",
                       "lora_pipeline/pkg/inner.py"}
    # empty or docstring-only package __init__.py files run nothing: not required
    assert {str(path) for path in required_files(root, "python -m stages.run")} == \
        reached - {"stages/__init__.py", "lora_pipeline/__init__.py"}
    assert stale_deps(["stages/run.py", "lora_pipeline/unused.py", "data/raw"], set(map(Path, reached))) == \
        ["lora_pipeline/unused.py"]


def test_a_package_init_with_code_is_required(tmp_path):
    root = write_tree(tmp_path, {**TREE, "stages/__init__.py": "import os\n"})
    assert Path("stages/__init__.py") in required_files(root, "python -m stages.run")
