"""Each stage's deps in dvc.yaml list its script and every lora_pipeline folder its code can import, lazy imports
included, and no folder it never imports: a folder dep is hashed whole, so an edit anywhere in it re-runs the stage."""
import ast
import re
from collections.abc import Iterable
from functools import cache
from pathlib import Path, PurePosixPath

import pytest
import yaml

from conftest import ROOT

PACKAGES = ("stages", "lora_pipeline")  # the project's code: every module under these folders
LIBRARY = "lora_pipeline"  # listed by folder (its subpackages); stages/ by file
DVC_STAGES = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


def stage_modules(cmd: str) -> list[str]:
    """The modules a stage's cmd runs: `python -m stages.X`, or `python -m lora_pipeline.launch <stage>` (its
    __main__) and the module that launch starts for the stage (lora_pipeline.launch.launcher.STAGES)."""
    from lora_pipeline.launch.launcher import STAGES

    found = re.search(r"-m\s+([\w.]+)(?:\s+(\w+))?", cmd)
    assert found, f"no `-m <module>` in cmd {cmd!r}"
    if found.group(1) == "lora_pipeline.launch":
        return [f"{found.group(1)}.__main__", STAGES[found.group(2)][0][0]]
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


def dep_of(path: Path) -> str:
    """The dvc.yaml dep that covers a project file: its lora_pipeline folder, or else the file itself (a stages/
    file, lora_pipeline/__init__.py: required only once it runs code, see has_code)."""
    parts = PurePosixPath(path).parts
    if parts[0] == LIBRARY and len(parts) > 2:
        return f"{LIBRARY}/{parts[1]}"
    return str(PurePosixPath(path))


def cmd_files(root: Path, cmd: str) -> set[Path]:
    """The project files a cmd imports, through every module it runs."""
    return set().union(*(reached_files(root, module) for module in stage_modules(cmd)))


def required_deps(root: Path, cmd: str) -> set[str]:
    """The deps a stage running `cmd` must list: each lora_pipeline folder it reaches, each stages/ file with code."""
    return {dep_of(path) for path in cmd_files(root, cmd) if has_code(root, path)}


def stage_required(stage: str) -> set[str]:
    return required_deps(ROOT, DVC_STAGES[stage]["cmd"])


def stage_reached(stage: str) -> set[str]:
    """The deps of every file a stage's code reaches, docstring-only package files included."""
    return {dep_of(path) for path in stage_files(stage)}


def covers(dep: str, path: str) -> bool:
    """A dep lists a file or folder when it is that path or a folder above it."""
    return PurePosixPath(path).is_relative_to(PurePosixPath(dep.rstrip("/")))


def missing_deps(deps: list[str], required: set[str]) -> list[str]:
    return sorted(path for path in required if not any(covers(dep, path) for dep in deps))


def stale_deps(deps: list[str], reached: set[str]) -> list[str]:
    """Listed code (a .py file, a lora_pipeline folder) the stage cannot import."""
    code = [dep for dep in deps if dep.endswith(".py") or dep.startswith(f"{LIBRARY}/")]
    return sorted(dep for dep in code if not any(covers(dep, path) for path in reached))


def stage_deps(stage: str) -> list[str]:
    return [dep for dep in DVC_STAGES[stage]["deps"] if isinstance(dep, str)]


def listed_by(path: str) -> set[str]:
    """The stages whose deps cover a file or folder: those an edit in it re-runs."""
    return {stage for stage in DVC_STAGES if any(covers(dep, path) for dep in stage_deps(stage))}


def importing(folder: str) -> set[str]:
    """The stages whose code imports a module of a folder."""
    return {stage for stage in DVC_STAGES if any(covers(folder, str(path)) for path in stage_files(stage))}


@pytest.mark.parametrize("stage", sorted(DVC_STAGES))
def test_deps_list_every_folder_the_stage_imports(stage):
    missing = missing_deps(stage_deps(stage), stage_required(stage))
    assert not missing, f"stage {stage}: dvc.yaml deps miss {', '.join(missing)}"


@pytest.mark.parametrize("stage", sorted(DVC_STAGES))
def test_deps_list_no_folder_the_stage_cannot_import(stage):
    stale = stale_deps(stage_deps(stage), stage_reached(stage))
    assert not stale, f"stage {stage}: dvc.yaml deps list {', '.join(stale)}, which it never imports"


@pytest.mark.parametrize("stage", sorted(DVC_STAGES))
def test_deps_list_folders_not_modules(stage):
    modules = [dep for dep in stage_deps(stage) if dep.startswith(f"{LIBRARY}/") and dep.endswith(".py")]
    assert not modules, f"stage {stage}: dvc.yaml deps list modules {modules}; list their folder"


@pytest.mark.parametrize("stage", sorted(DVC_STAGES))
def test_deps_list_each_path_once(stage):
    deps = [dep if isinstance(dep, str) else next(iter(dep)) for dep in DVC_STAGES[stage]["deps"]]
    repeated = sorted({dep for dep in deps if deps.count(dep) > 1})
    assert not repeated, f"stage {stage}: dvc.yaml deps list {', '.join(repeated)} more than once"


@pytest.mark.parametrize("stage", sorted(DVC_STAGES))
def test_a_dropped_folder_is_named(stage):
    required = stage_required(stage)
    dropped = sorted(dep for dep in required if dep.startswith(LIBRARY))[-1]
    deps = [dep for dep in stage_deps(stage) if dep != dropped]
    assert dropped in missing_deps(deps, required)
    assert missing_deps(deps + ["lora_pipeline", "stages/"], required) == []  # a folder above covers it


def test_a_folder_the_stage_never_imports_is_named():
    reached = stage_reached("split")
    assert "lora_pipeline/merge" not in reached
    assert stale_deps(stage_deps("split") + ["lora_pipeline/merge"], reached) == ["lora_pipeline/merge"]


# What an edit re-runs. Data: reading and converting data is fetch's work (validate checks data.format, data.columns
# and the split rule), the split split's; train, merge, evaluate and register read and write JSON Lines only.
# Evaluation: the evaluations, register (the served model generates with lora_pipeline.evaluate.generation) and
# validate (it checks the eval params with lora_pipeline.evaluate.eval_checks); never train. The registry, with the
# gate's rule (lora_pipeline.registry.gate): validate and register alone.
RERUN_BY = {
    "lora_pipeline/data": {"validate", "fetch", "split"},
    "lora_pipeline/evaluate": {"validate", "evaluate_base", "evaluate", "register"},
    "lora_pipeline/registry": {"validate", "register"},
}


@pytest.mark.parametrize("folder", sorted(RERUN_BY))
def test_an_edit_re_runs_only_the_stages_that_import_it(folder):
    assert listed_by(folder) == importing(folder) == RERUN_BY[folder], \
        f"{folder}: listed by {sorted(listed_by(folder))}, imported by {sorted(importing(folder))}"


def test_a_data_format_edit_never_re_runs_train_merge_or_evaluate():
    assert not importing("lora_pipeline/data") & {"train", "merge", "evaluate_base", "evaluate", "register"}
    assert listed_by("lora_pipeline/data/formats.py") == {"validate", "fetch", "split"}


def test_an_evaluation_edit_never_re_runs_train():
    assert "train" not in importing("lora_pipeline/evaluate")
    assert "train" not in listed_by("lora_pipeline/evaluate/scoring.py")
    assert {"evaluate_base", "evaluate"} <= listed_by("lora_pipeline/evaluate/scoring.py")


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


TREE = {
    "stages/__init__.py": "",
    "stages/run.py": "from .helper import step\n\ndef main():\n    from lora_pipeline.lazy import mod\n",
    "stages/helper.py": "import lora_pipeline.pkg.inner\n",
    "stages/other.py": "",
    "lora_pipeline/__init__.py": '"""Docstring only."""\n',
    "lora_pipeline/lazy/__init__.py": '"""Docstring only."""\n',
    "lora_pipeline/lazy/mod.py": "class Model:\n    def load(self):\n        from lora_pipeline.deep import thing\n",
    "lora_pipeline/deep/__init__.py": "import json\nthing = json\n",
    "lora_pipeline/pkg/__init__.py": "from lora_pipeline.deep import thing\n",
    "lora_pipeline/pkg/inner.py": "",
    "lora_pipeline/unused/__init__.py": "",
    "lora_pipeline/unused/mod.py": "",
}


def test_closure_follows_lazy_relative_and_package_imports(tmp_path):
    root = write_tree(tmp_path, TREE)
    reached = {str(path) for path in reached_files(root, "stages.run")}
    assert reached == {"stages/__init__.py", "stages/run.py", "stages/helper.py", "lora_pipeline/__init__.py",
                       "lora_pipeline/lazy/__init__.py", "lora_pipeline/lazy/mod.py", "lora_pipeline/deep/__init__.py",
                       "lora_pipeline/pkg/__init__.py", "lora_pipeline/pkg/inner.py"}
    # empty or docstring-only stages/__init__.py and lora_pipeline/__init__.py run nothing: not required
    assert required_deps(root, "python -m stages.run") == {"stages/run.py", "stages/helper.py", "lora_pipeline/lazy",
                                                           "lora_pipeline/deep", "lora_pipeline/pkg"}
    reached_deps = {dep_of(Path(path)) for path in reached}
    assert stale_deps(["stages/run.py", "lora_pipeline/unused", "lora_pipeline/pkg", "data/raw"], reached_deps) == \
        ["lora_pipeline/unused"]


def test_a_package_init_with_code_is_required(tmp_path):
    root = write_tree(tmp_path, {**TREE, "stages/__init__.py": "import os\n", "lora_pipeline/__init__.py": "X = 1\n"})
    assert {"stages/__init__.py", "lora_pipeline/__init__.py"} <= required_deps(root, "python -m stages.run")
