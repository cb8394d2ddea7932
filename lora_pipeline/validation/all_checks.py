"""Everything the validate stage checks (validate_all), the split's rule against the most rows fetch can yield, and
the check of train.sft and lora against trl.SFTConfig's and peft.LoraConfig's own fields; the checks of data, the
base model and the machine live with their concern."""
from __future__ import annotations

import difflib
from importlib.metadata import version
from pathlib import Path

from lora_pipeline.config import dvcfiles
from lora_pipeline.config.cache import cached
from lora_pipeline.config.params import Params, ParamsError, ROOT, for_stage, validate
from lora_pipeline.data.formats import Converter, FormatError, check_format
from lora_pipeline.data.local import check_data, check_text_only, local_objects, local_rows
from lora_pipeline.data.splitting import split_problem, too_few_rows
from lora_pipeline.evaluate.eval_checks import check_eval
from lora_pipeline.evaluate.figures import REASONING, ROW_NEEDS
from lora_pipeline.evaluate.scoring import asks_reasoning_language
from lora_pipeline.evaluate.task import row_yields
from lora_pipeline.launch.launcher import check_launch
from lora_pipeline.launch.machine import check_eval_launch, check_machine, distributed_type, training_processes
from lora_pipeline.model.base_checks import (check_base_model, check_model, check_packed_experts, check_quantization,
                                             check_save_format, check_tiny)
from lora_pipeline.registry.gate import HELD_OUT_GATE, check_gate_metric, check_register, eval_figure, gate_metric
from lora_pipeline.registry.mlflow_names import check_mlflow_names
from lora_pipeline.train.global_batch import split_global_batch
from lora_pipeline.train.sft_args import STAGE_OWNED_SFT_FIELDS
from lora_pipeline.validation.library_source import library_field_names


def validate_all(raw: dict, root: Path = ROOT) -> Params:
    """Everything the validate stage checks: the schema, each stage's declared keys, then every check below, with
    paths relative to the working directory (the repository root, where stages run); raises one ParamsError that
    lists each problem by its dotted key."""
    params = validate(raw)
    for stage in dvcfiles.stages(root):  # every key that dvc.yaml declares must exist in the schema
        for_stage(params, stage, dvcfiles.declared_params(stage, root))
    view = for_stage(params, "validate", dvcfiles.declared_params("validate", root))
    checks = [
        lambda: check_data(view.data),
        lambda: check_format(view.data),
        lambda: check_text_only(view.data),
        lambda: check_split(view.data, view.split),
        lambda: check_model(view.model),
        lambda: check_tiny(view.model),
        lambda: check_library_fields(view.train, view.lora),
        lambda: check_scheduler(view.train),
        lambda: check_machine(view.model, view.train, root, view.launch),
        lambda: check_launch(view, root),
        lambda: check_global_batch(view.train, view.launch, root),
        lambda: check_base_model(view.model, view.lora, root),
        lambda: check_quantization(view.model, view.quantization, view.train, distributed_type(view.train, root), root),
        lambda: check_packed_experts(view.model, view.lora, view.train, distributed_type(view.train, root), root),
        lambda: check_save_format(view.model, view.merge, root),
        lambda: check_eval(view.eval),
        lambda: check_eval_launch(view.eval, root, view.launch),
        lambda: check_register(view.register),
        lambda: check_mlflow_names(view.register),
        lambda: check_gate_metric(view.register, view.eval, view.data.source),
        lambda: check_gate_data(view.register, view.data),
    ]
    problems = []
    for check in checks:
        try:
            check()
        except (ValueError, OSError) as exc:
            problems.append(str(exc))
    if problems:
        lines = [line for problem in problems for line in problem.splitlines()]
        raise ParamsError("params.yaml is invalid:\n" + "\n".join(f"  {line}" for line in lines))
    return view


def check_gate_data(register, data) -> None:
    """An evaluation figure gates only data that yields it, by what the catalogue says it needs (evaluate.figures): a
    reasoning figure (compliance, the final answer's language, the built-in accuracy) data whose rows ask for a
    reasoning language; a task or tool-call figure data with a row asked as it asks that yields it
    (evaluate.task.row_yields), which the built-in rows never are. A local file is read to know it (a Hub data set is
    known only once fetched)."""
    metric = gate_metric(register, data.source)
    need = figure.needs if (figure := eval_figure(metric)) else None
    if need is REASONING and data.source == "local" and not local_rows_ask_reasoning(data):
        raise ValueError(f"register.gate_metric: '{metric}' needs rows that ask for a reasoning language, and no row "
                         f"of {data.name} does; gate on the held-out loss ({HELD_OUT_GATE}, or auto)")
    if need in ROW_NEEDS:
        if data.source == "builtin" or (data.source == "local" and not local_rows_any(
                data, lambda row: not asks_reasoning_language(row) and need.name in row_yields(row))):
            where = "the built-in set (each asks for a reasoning language)" if data.source == "builtin" else data.name
            raise ValueError(f"register.gate_metric: '{metric}' needs a row that asks no reasoning language with "
                             f"{need.words}, and no row of {where} has one; gate on a figure this data yields, e.g. "
                             f"the held-out loss ({HELD_OUT_GATE}, or auto)")


def local_rows_ask_reasoning(data) -> bool:
    """Whether a row of the local data file asks for a reasoning language (True where the file cannot be read:
    check_data or fetch names why)."""
    return local_rows_any(data, asks_reasoning_language)


def local_rows_any(data, test) -> bool:
    """Whether a row of the local data file, as fetch converts it, passes `test` (True where the file or a row cannot
    be read: check_data or fetch names why)."""
    rows = local_objects(Path(data.name)) if local_file_ok(data) else None
    if rows is None:
        return True
    converter = Converter(data.format, data.columns, "file", "chosen_only")
    for number, row in enumerate(rows, 1):
        try:
            converted, _ = converter.convert(number, row, text_cells=Path(data.name).suffix in (".csv", ".tsv"))
        except FormatError:
            return True  # fetch names the row
        if isinstance(converted, dict) and test(converted):
            return True
    return False


def most_rows(data) -> tuple[int, str] | None:
    """The most rows fetch can yield, known before it runs, and the key that sets that bound: data.builtin_rows,
    the rows of a local data file (data.name), data.max_rows of any source."""
    bounds = []
    if data.source == "builtin":
        bounds.append((data.builtin_rows, "data.builtin_rows"))
    if data.source == "local" and local_file_ok(data) and (rows := local_rows(Path(data.name))) is not None:
        bounds.append((rows, f"the rows of data.name {data.name}"))
    if data.max_rows:
        bounds.append((data.max_rows, "data.max_rows"))
    return min(bounds, key=lambda bound: bound[0]) if bounds else None


def local_file_ok(data) -> bool:
    """Whether check_data accepts the local file (a file outside the repository is never read, not even counted)."""
    try:
        check_data(data)
        return True
    except (ValueError, OSError):
        return False


def check_split(data, split) -> None:
    """The split's rule against the most rows fetch can yield; an empty file, or too few rows for any
    split.test_size, is named as such."""
    if data.source == "local" and local_file_ok(data) and local_rows(Path(data.name)) == 0:
        empty = "is empty" if not Path(data.name).read_bytes().strip() else "holds no rows"
        raise ValueError(f"data.name: {data.name} {empty}; put the data set's rows in it")
    bound = most_rows(data)
    if bound is None:  # a Hub data set of unknown size: only a row count below the least can be refused now
        if split.test_size >= 1 and (problem := split_problem(int(split.test_size) + 1, split.test_size)):
            raise ValueError(problem)
        return
    rows, what = bound
    if few := too_few_rows(rows, split.test_size):
        plural = "" if rows == 1 else "s"
        if what == "data.max_rows":
            raise ValueError(f"data.max_rows: {rows} keeps {rows} row{plural}; {few}")
        raise ValueError(f"data.name: {data.name} holds {rows} row{plural}; {few}: add rows")
    if problem := split_problem(rows, split.test_size, f"at most {rows} ({what})"):
        raise ValueError(problem)


# What LoRA papers and other tools call the fields that peft names otherwise.
FIELD_ALIASES = {"rank": "r", "alpha": "lora_alpha", "dropout": "lora_dropout", "target": "target_modules"}


def closest(name: str, known) -> str | None:
    """The known name that `name` most likely means: its alias, else the nearest spelling."""
    alias = FIELD_ALIASES.get(name)
    return alias if alias in known else next(iter(difflib.get_close_matches(name, sorted(known), n=1)), None)


def unknown_fields(given: dict, known: set[str], section: str, owner: str) -> list[str]:
    """One message per key of `given` that is not a field of `owner`, with the closest field name."""
    messages = []
    for key in given:
        if key not in known:
            close = closest(key, known)
            hint = f"; did you mean {section}.{close}?" if close else ""
            messages.append(f"{section}.{key}: not a {owner} field{hint}")
    return messages


def library_fields() -> dict[str, list[str]]:
    """The field names of trl.SFTConfig and peft.LoraConfig, and transformers' scheduler names, read from their source
    (library_source), cached per installed version of trl, peft and transformers."""
    key = "-".join(f"{package}{version(package)}" for package in ("trl", "peft", "transformers"))
    return cached(f"fields-{key}.json", library_field_names)


def check_library_fields(train, lora) -> None:
    """train.sft and lora pass straight to trl.SFTConfig and peft.LoraConfig: every key must be one of their fields."""
    fields = library_fields()
    sft = train.sft.dump()
    problems = [f"train.sft.{key}: the train stage sets it itself; remove it" for key in sft
                if key in STAGE_OWNED_SFT_FIELDS]
    problems += unknown_fields({k: v for k, v in sft.items() if k not in STAGE_OWNED_SFT_FIELDS},
                               set(fields["trl.SFTConfig"]), "train.sft", "trl.SFTConfig")
    problems += unknown_fields(lora.dump(), set(fields["peft.LoraConfig"]) - {"task_type"},
                               "lora", "peft.LoraConfig")
    if problems:
        raise ValueError("\n".join(problems))


def check_global_batch(train, launch, root: Path = ROOT) -> None:
    """train.global_batch_size split over the processes the launch starts, as the train stage will split it."""
    processes, processes_are = training_processes(train, launch, root)
    split_global_batch(train.global_batch_size, train.sft.per_device_train_batch_size,
                       train.sft.gradient_accumulation_steps, processes, processes_are)


def check_scheduler(train) -> None:
    name, known = train.sft.lr_scheduler_type, library_fields()["transformers.SchedulerType"]
    if name not in known:
        close = closest(name, known)
        hint = f"did you mean {close}? " if close else ""
        raise ValueError(f"train.sft.lr_scheduler_type: '{name}' is not a transformers scheduler; {hint}"
                         f"allowed: {known}")
