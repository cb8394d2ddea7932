"""The field names of trl.SFTConfig and peft.LoraConfig and the values of transformers.SchedulerType, read from the
installed source files with ast instead of importing the libraries (which takes seconds: torch, bitsandbytes)."""
from __future__ import annotations

import ast
import builtins
import dataclasses
import functools
import importlib.util
from pathlib import Path

# Annotations that make no dataclass field (dataclasses.fields leaves them out).
NOT_FIELDS = ("ClassVar", "typing.ClassVar", "InitVar", "dataclasses.InitVar", "KW_ONLY", "dataclasses.KW_ONLY")


class Unreadable(Exception):
    """The source does not show the answer plainly (a decorator, base or member this reader does not follow)."""


def module_file(module: str) -> Path:
    """The source file of `module`, found without running it: only its top-level package is looked up (find_spec
    of a top-level name executes nothing), the rest follows the folders."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or spec.origin is None:
        raise Unreadable(f"{top} is not installed")
    if not rest:
        return Path(spec.origin)
    folder = Path(spec.origin).parent.joinpath(*rest)
    for path in (folder.with_suffix(".py"), folder / "__init__.py"):
        if path.is_file():
            return path
    raise Unreadable(f"no source file for {module}")


@functools.cache
def parsed(module: str) -> tuple[ast.Module, bool]:
    """The syntax tree of `module`, and whether it is a package (its __init__.py)."""
    path = module_file(module)
    return ast.parse(path.read_text(encoding="utf-8"), str(path)), path.name == "__init__.py"


def imported_from(module: str, node: ast.ImportFrom) -> str:
    """The absolute name of the module that `from ... import` in `module` reads."""
    if not node.level:
        return node.module
    package = module if parsed(module)[1] else module.rpartition(".")[0]
    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
    return f"{base}.{node.module}" if node.module else base


def class_def(module: str, name: str) -> tuple[str, ast.ClassDef] | None:
    """The module and class statement that `name` means in `module`: a class it defines, or one it imports (also
    under `if TYPE_CHECKING:`, where lazily loading packages declare their names); None for a builtin."""
    tree, _ = parsed(module)
    defined = [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name == name]
    sources = {(imported_from(module, node), alias.name) for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) for alias in node.names if (alias.asname or alias.name) == name}
    if len(defined) + len(sources) != 1:
        if not defined and not sources and hasattr(builtins, name):
            return None
        raise Unreadable(f"{module} binds {name} {len(defined) + len(sources)} times")
    return (module, defined[0]) if defined else class_def(*sources.pop())


def is_dataclass(node: ast.ClassDef) -> bool:
    """Whether the class statement is decorated with @dataclass (or @dataclasses.dataclass(...)) alone."""
    names = [ast.unparse(d.func if isinstance(d, ast.Call) else d) for d in node.decorator_list]
    if any(name not in ("dataclass", "dataclasses.dataclass") for name in names):
        raise Unreadable(f"{node.name} has a decorator this reader does not follow: {names}")
    return bool(names)


def dataclass_fields(module: str, name: str) -> set[str]:
    """The field names dataclasses.fields gives for the class `name` of `module`: the annotated names of the class
    and of each dataclass among its bases, as a dataclass collects them."""
    found = class_def(module, name)
    if found is None:
        return set()
    module, node = found
    fields = set()
    if is_dataclass(node):
        for statement in node.body:
            if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                annotation = statement.annotation
                text = annotation.value if isinstance(annotation, ast.Constant) else ast.unparse(annotation)
                if not str(text).startswith(NOT_FIELDS):
                    fields.add(statement.target.id)
            elif any(isinstance(inner, ast.AnnAssign) for inner in ast.walk(statement)) and not isinstance(
                    statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                raise Unreadable(f"{name} annotates a name under {type(statement).__name__}")
    for base in node.bases:
        if not isinstance(base, ast.Name):
            raise Unreadable(f"{name} has a base this reader does not follow: {ast.unparse(base)}")
        fields |= dataclass_fields(module, base.id)
    return fields


def enum_values(module: str, name: str) -> list[str]:
    """The values of the string enum `name` of `module`, in order, as iterating it gives them (an alias, a second
    name for a value, is not listed)."""
    found = class_def(module, name)
    if found is None:
        raise Unreadable(f"{name} is a builtin")
    values = []
    for statement in found[1].body:
        if isinstance(statement, ast.Assign):
            targets = statement.targets
            if len(targets) != 1 or not isinstance(targets[0], ast.Name):
                raise Unreadable(f"{name} assigns {ast.unparse(statement)}")
            if targets[0].id.startswith("_"):
                continue
            if not (isinstance(statement.value, ast.Constant) and isinstance(statement.value.value, str)):
                raise Unreadable(f"{name}.{targets[0].id} is not a string")
            if statement.value.value not in values:
                values.append(statement.value.value)
        elif isinstance(statement, (ast.AnnAssign, ast.AugAssign, ast.If, ast.For, ast.With, ast.Try)):
            raise Unreadable(f"{name} has a statement this reader does not follow: {type(statement).__name__}")
    return values


def library_field_names() -> dict[str, list[str]]:
    """The field names of trl.SFTConfig and peft.LoraConfig and transformers' scheduler names, read from their source
    (imported instead where a version's source is beyond this reader)."""
    try:
        return {"trl.SFTConfig": sorted(dataclass_fields("trl", "SFTConfig")),
                "peft.LoraConfig": sorted(dataclass_fields("peft", "LoraConfig")),
                "transformers.SchedulerType": enum_values("transformers", "SchedulerType")}
    except (Unreadable, OSError, SyntaxError, ValueError):
        return imported_field_names()


def imported_field_names() -> dict[str, list[str]]:
    """library_field_names from the imported classes themselves."""
    from peft import LoraConfig
    from transformers import SchedulerType
    from trl import SFTConfig

    return {"trl.SFTConfig": sorted(f.name for f in dataclasses.fields(SFTConfig)),
            "peft.LoraConfig": sorted(f.name for f in dataclasses.fields(LoraConfig)),
            "transformers.SchedulerType": [s.value for s in SchedulerType]}
