"""Each module of the package has a file name of its own, and none is named like a stage script: a name found by
`find` or in a traceback says which file it is."""
from collections import Counter

from conftest import ROOT


def module_names(folder: str) -> list[str]:
    return [path.name for path in (ROOT / folder).rglob("*.py") if path.name not in ("__init__.py", "__main__.py")]


def test_no_two_package_modules_share_a_file_name():
    shared = sorted(name for name, count in Counter(module_names("lora_pipeline")).items() if count > 1)
    assert not shared, f"file names held by two or more modules of lora_pipeline/: {shared}"


def test_no_package_module_is_named_like_a_stage_script():
    stages = set(module_names("stages"))
    clashing = sorted(stages & set(module_names("lora_pipeline")))
    assert not clashing, f"lora_pipeline/ modules named like a script in stages/: {clashing}"
