"""Every `dvc exp run`, `dvc repro` and `make` command in README.md and docs/*.md runs as written: DVC's own parser
takes its options, each `-S` override applies to params.yaml as DVC applies it (a key params.yaml lacks needs
`+key=`), each stage it names is dvc.yaml's, and each make target is the Makefile's."""
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A command from where it starts (a line, a code span, after a shell separator or a parenthesis) up to where it ends.
COMMAND = re.compile(r"(?:^|(?<=[\s;&|(`]))(?:dvc\s+(?:exp\s+run|repro)|make)\b[^`;&|#)\n]*")
# How the docs write "any value": `-S key=value`, `-S ...`, `<stage>`, `RECIPE=<qwen2-0.5b|gpt-oss-20b>`.
PLACEHOLDER = re.compile(r"^(?:key=value|\.\.\.|.*<[^>]*>.*)$")


def code_texts(path: Path) -> list[str]:
    """Each code span, and each line of each code block (continued lines joined, comments dropped)."""
    from markdown_it import MarkdownIt

    texts = []
    for token in MarkdownIt().parse(path.read_text()):
        if token.type in ("fence", "code_block"):
            texts += [re.sub(r"(^|\s)#.*", "", line) for line in token.content.replace("\\\n", " ").splitlines()]
        elif token.type == "inline":
            texts += [child.content for child in token.children if child.type == "code_inline"]
    return texts


def documented_commands() -> list[tuple[str, str]]:
    """(file, command) for each command the docs show; a code span of `-S` overrides alone is a `dvc exp run`'s
    (`-S` with nothing after it names the option)."""
    found = []
    for path in DOCS:
        for text in code_texts(path):
            text = re.sub(r"<[^<>\s]*>", "<placeholder>", text)  # <a|b> is a placeholder, not a pipe
            if re.match(r"(-S|--set-param)\s+\S", text):
                text = f"dvc exp run {text}"
            found += [(path.relative_to(ROOT).as_posix(), match.group(0).strip()) for match in COMMAND.finditer(text)]
    return found


def make_targets() -> set[str]:
    """The Makefile's targets, from make's own database of it."""
    database = subprocess.run(["make", "-pRrq", "-f", "Makefile", ":"], cwd=ROOT, capture_output=True,
                              text=True).stdout.splitlines()
    return {found.group(1) for before, line in zip(["", *database], database)
            if (found := re.match(r"([\w.-]+):", line)) and before != "# Not a target:"}


def problem(command: str, tmp_path: Path) -> str | None:
    """Why the command would not run as written, or None."""
    from dvc.cli import DvcParserError, parse_args
    from dvc.exceptions import InvalidArgumentError
    from dvc.utils.cli_parse import to_path_overrides
    from dvc.utils.hydra import apply_overrides

    argv = shlex.split(command)
    if argv[0] == "make":
        unknown = [arg for arg in argv[1:] if "=" not in arg and not arg.startswith("-") and arg not in MAKE_TARGETS
                   and not PLACEHOLDER.match(arg)]
        return f"no make target {', '.join(unknown)} in the Makefile" if unknown else None
    try:
        args = parse_args(argv[1:])
    except DvcParserError:  # argparse has printed why
        return "DVC refuses its options"
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    if unknown := [target for target in args.targets if target not in stages and not PLACEHOLDER.match(target)]:
        return f"no stage {', '.join(unknown)} in dvc.yaml"
    sets = [value for value in getattr(args, "set_param", None) or [] if not PLACEHOLDER.match(value)]
    for params_file, overrides in to_path_overrides(sets).items():
        params = tmp_path / params_file
        shutil.copy(ROOT / params_file, params)
        try:
            apply_overrides(params, overrides)  # what `dvc exp run -S` does to params.yaml
        except InvalidArgumentError as error:
            return f"{error}: {error.__cause__}".replace("\n", " ")
    return None


MAKE_TARGETS = make_targets()


def test_the_docs_show_commands_of_each_kind():
    commands = [command for _, command in documented_commands()]
    assert any(command.startswith("dvc exp run -S") for command in commands)
    assert any(command.startswith("dvc repro") for command in commands)
    assert any(command.startswith("make repro") for command in commands)
    assert {"repro", "test", "recipe"} <= MAKE_TARGETS


def test_every_documented_command_runs_as_written(tmp_path):
    failures = [f"{where}: `{command}`: {why}" for where, command in documented_commands()
                if (why := problem(command, tmp_path))]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("command, why", [
    ("dvc exp run -S lora.use_rslora=true", "Could not override 'lora.use_rslora'"),
    ("dvc exp run -S +lora.r=4", "Could not append to config. An item is already at 'lora.r'"),
    ("dvc exp run -S ~lora.rank", "Could not delete from config. 'lora.rank' does not exist"),
    ("dvc repro -s registry", "no stage registry in dvc.yaml"),
    ("dvc exp run --tmp", "DVC refuses its options"),
    ("make reproduce", "no make target reproduce in the Makefile"),
])
def test_a_command_that_would_not_run_is_named_with_why(command, why, tmp_path):
    assert why in problem(command, tmp_path)


@pytest.mark.parametrize("command", [
    "dvc exp run -S +lora.use_rslora=true", "dvc exp run -S ++train.sft.max_grad_norm=0.5 -S ++lora.r=4",
    "dvc exp run -S ~eval.mgsm -n no-mgsm", "dvc exp run -S key=value", "dvc repro -s <placeholder>",
    "make recipe RECIPE=<placeholder> EXP_ARGS=--queue"])
def test_commands_that_run(command, tmp_path):
    assert problem(command, tmp_path) is None
