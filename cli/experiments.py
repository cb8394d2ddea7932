"""The experiment table people decide on: each experiment's metrics and the params it changed, sorted by the gate.

    python -m cli.experiments          (make exps)
Reads `dvc exp show --json` (the workspace, HEAD and its experiments) and prints at most 120 columns; every other
param and metric stays in plain `dvc exp show`.
"""
from __future__ import annotations

import io
import json
import subprocess
import sys

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from lora_pipeline.config.outputs import METRICS
from lora_pipeline.config.params import flat_keys
from lora_pipeline.evaluate.figures import FIGURES, figure_of

# The metrics files as `dvc exp show` names them, by the prefix of register.gate_metric.
FILES = {prefix: path.as_posix() for prefix, path in METRICS.items()}
# merge's column, after the evaluation's (lora_pipeline.evaluate.figures.FIGURES: their order, headers and legends).
MERGE_COLUMN = ("merge", FILES["merge"], "relative_logit_diff", "relative logit diff merged vs adapted")
WIDTH = 120
ABSENT = object()  # a key that one side's params.yaml does not have


def experiment_rows(shown: list[dict]) -> list[dict]:
    """One row per workspace, commit and experiment with metrics: {name, params (flat), metrics {file: flat},
    changed {key: value}}. changed: the params that differ from the row's baseline, which for an experiment is the
    commit it ran from, and for the workspace and every commit is HEAD (the first commit shown)."""
    def params(rev):
        return flat_keys(((rev.get("data") or {}).get("params") or {}).get("params.yaml", {}).get("data") or {})

    commits = [c for c in shown if c["rev"] != "workspace"]
    head = params(commits[0]) if commits else {}
    rows = []

    def add(name, rev, baseline):
        data = rev.get("data") or {}
        metrics = {path: flat_keys(entry.get("data") or {}) for path, entry in (data.get("metrics") or {}).items()}
        if metrics:
            own = params(rev)
            rows.append({"name": name, "params": own, "metrics": metrics, "changed": changed_params(own, baseline)})

    for commit in shown:
        add(commit.get("name") or (commit["rev"] if commit["rev"] == "workspace" else commit["rev"][:7]), commit, head)
        for exp in commit.get("experiments") or []:
            for rev in exp.get("revs", []):
                add(exp.get("name") or rev.get("name") or rev["rev"][:7], rev, params(commit))
    return rows


def changed_params(params: dict, baseline: dict) -> dict:
    """{dotted key: value} where params differ from baseline (ABSENT: a key baseline has and params lacks); nothing
    when there is no baseline to compare to (a commit DVC could not read)."""
    if not baseline:
        return {}
    as_text = lambda tree, k: json.dumps(tree[k], sort_keys=True) if k in tree else None  # noqa: E731
    return {k: params.get(k, ABSENT) for k in sorted(params.keys() | baseline.keys())
            if as_text(params, k) != as_text(baseline, k)}


def compact(value) -> str:
    """A param value whole and short: [en,de,es], {every_n_layers:2}, nf4, true, 0.001, ""."""
    if value is ABSENT:
        return "(absent)"
    if isinstance(value, list):
        return "[" + ",".join(compact(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{compact(v)}" for k, v in value.items()) + "}"
    return value if isinstance(value, str) and value else json.dumps(value)


def eval_columns(rows: list[dict]) -> list[tuple[str, str, str, str]]:
    """(header, metrics file, dotted key, legend) of each evaluation figure with a column, in the catalogue's order:
    one a table always shows, one that shows only where a row has it, and a pattern's once per value the rows hold
    (compliance per language, sorted)."""
    keys = {k for r in rows for k, v in r["metrics"].get(FILES["eval"], {}).items() if v is not None}
    columns = []
    for figure in FIGURES:
        column = figure.column
        if column is None:
            continue
        if figure.placeholder:
            values = sorted({figure.value_in(k) for k in keys if figure_of(k) is figure})
            columns += [(column.header.format(**{figure.placeholder: value}), FILES["eval"],
                         figure.key.format(**{figure.placeholder: value}), column.legend) for value in values]
        elif column.always or figure.key in keys:
            columns.append((column.header, FILES["eval"], figure.key, column.legend))
    return columns


def table(rows: list[dict], gate: str, greater_is_better: bool) -> str:
    """Rows sorted by the gate metric (best first), in at most WIDTH columns; a row's changed params, one per line,
    fill the last column, wrapped but never cut."""
    stage, _, key = gate.partition(".")
    value = lambda r: r["metrics"].get(FILES.get(stage, ""), {}).get(key)  # noqa: E731
    missing = float("-inf") if greater_is_better else float("inf")
    rows = sorted(rows, key=lambda r: value(r) if isinstance(value(r), (int, float)) else missing,
                  reverse=greater_is_better)
    columns = eval_columns(rows) + [MERGE_COLUMN]

    def cell(r, file, key):
        v = r["metrics"].get(file, {}).get(key)
        if isinstance(v, float):
            return f"{v:.3g}" if v == 0 or abs(v) >= 1e-3 else f"{v:.1e}"
        return "-" if v is None else str(v)

    grid = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    grid.add_column("experiment", no_wrap=True)
    for header, *_ in columns:
        grid.add_column(header, justify="right", no_wrap=True)
    grid.add_column("changed", overflow="fold")
    for r in rows:  # Text, not markup: a value like [en,de] is not a rich style tag
        changed = "\n".join(f"{k}={compact(v)}" for k, v in r["changed"].items())
        grid.add_row(Text(r["name"]), *(Text(cell(r, f, k)) for _, f, k, _ in columns), Text(changed))
    legend = (f"sorted by {gate} ({'higher' if greater_is_better else 'lower'} is better); "
              + "".join(f"{header}: {words}; " for header, _, _, words in columns if words)
              + "changed: every param that differs from the row's baseline, which is the commit an experiment ran "
              "from, and HEAD for the workspace (HEAD's own row shows none)")
    out = io.StringIO()
    console = Console(file=out, width=WIDTH, color_system=None, highlight=False, markup=False, emoji=False)
    console.print(grid)
    console.print(Text(legend))
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines())


def main() -> None:
    from lora_pipeline.config.params import load_params
    from lora_pipeline.registry.gate import gate

    params = load_params("register")
    shown = subprocess.run([sys.executable, "-m", "dvc", "exp", "show", "--json"], capture_output=True, text=True)
    if shown.returncode != 0:
        sys.exit(f"`dvc exp show --json` failed:\n{shown.stderr.strip()}")
    rows = experiment_rows(json.loads(shown.stdout))
    if not rows:
        sys.exit("no experiments with metrics yet: run `dvc repro` or `dvc exp run` first")
    print(table(rows, *gate(params.register, params.data.source)))


if __name__ == "__main__":
    main()
