"""The libraries' field and scheduler names read from their source equal those of the imported classes."""
import dataclasses
import importlib
import textwrap

import pytest

from lora_pipeline.validation import library_source
from lora_pipeline.validation.library_source import Unreadable, dataclass_fields, enum_values

# A package as the libraries lay theirs out: a class exported lazily (under TYPE_CHECKING), relative imports, a base
# that is no dataclass between two that are, and what dataclasses leaves out (ClassVar, InitVar, KW_ONLY).
SOURCES = {
    "__init__.py": """
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from .configs.child import Child
            from .base import Color
        """,
    "base.py": """
        import dataclasses
        import enum
        from dataclasses import InitVar, field
        from typing import ClassVar

        class Mixin:
            note: str = "not a field: Mixin is no dataclass"

        @dataclasses.dataclass
        class Base(Mixin):
            alpha: int = 1
            kind: ClassVar[str] = "base"
            seed: InitVar[int] = 0
            _hidden: list = field(default_factory=list)

            def method(self):
                local: int = 1
                return local

        class Color(str, enum.Enum):
            RED = "red"
            CRIMSON = "red"
            BLUE = "blue"

            def shout(self):
                return self.value.upper()

        def wrapped(cls):
            return dataclasses.dataclass(cls)

        @wrapped
        class Decorated:
            gamma: int = 0
        """,
    "configs/__init__.py": "",
    "configs/child.py": """
        from __future__ import annotations

        from dataclasses import KW_ONLY, dataclass

        from ..base import Base

        class Plain(Base):
            extra: int = 3

        @dataclass(frozen=False)
        class Child(Plain):
            beta: "float" = 2.0
            _: KW_ONLY
            gamma: str = "g"
            alpha: int = 5
        """,
}


@pytest.fixture
def package(tmp_path, monkeypatch):
    for name, text in SOURCES.items():
        (tmp_path / "sourcepkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "sourcepkg" / name).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    return "sourcepkg"


def test_a_dataclass_and_an_enum_read_from_source_are_as_imported(package):
    child = importlib.import_module(f"{package}.configs.child").Child
    color = importlib.import_module(f"{package}.base").Color
    assert dataclass_fields(package, "Child") == {f.name for f in dataclasses.fields(child)} == {
        "alpha", "_hidden", "beta", "gamma"}
    assert enum_values(package, "Color") == [c.value for c in color] == ["red", "blue"]
    with pytest.raises(Unreadable, match="Decorated has a decorator this reader does not follow"):
        dataclass_fields(f"{package}.base", "Decorated")


def test_the_libraries_fields_read_from_source_are_those_of_their_classes(monkeypatch):
    imported = library_source.imported_field_names()
    read = {"trl.SFTConfig": sorted(dataclass_fields("trl", "SFTConfig")),
            "peft.LoraConfig": sorted(dataclass_fields("peft", "LoraConfig")),
            "transformers.SchedulerType": enum_values("transformers", "SchedulerType")}
    assert read == imported and library_source.library_field_names() == imported

    def unreadable(*_):
        raise Unreadable("a version this reader does not follow")

    monkeypatch.setattr(library_source, "dataclass_fields", unreadable)
    assert library_source.library_field_names() == imported  # then imported
