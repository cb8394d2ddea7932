"""The experiment table people decide on: name, the params that differ, the evaluation metrics, sorted by the gate.

    python -m lora_pipeline.experiments          (make exps)
Reads `dvc exp show --json` (the workspace, HEAD and its experiments) and prints at most 120 columns; every other
param and metric stays in plain `dvc exp show`.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from lora_pipeline.params import flat_keys

# (header, metrics file, dotted key): what a user decides an experiment by.
COLUMNS = [("loss", "metrics/eval.json", "test.loss"), ("comp", "metrics/eval.json", "compliance.overall"),
           ("final", "metrics/eval.json", "final_language_rate"),
           ("mgsm", "metrics/eval.json", "accuracy.mgsm.overall"),
           ("merge", "metrics/merge.json", "relative_logit_diff")]
LANGUAGE_PREFIX = "compliance."
WIDTH = 120


def experiment_rows(shown: list[dict]) -> list[dict]:
    """One row per workspace, commit and experiment: {name, params (flat), metrics {file: flat}}."""
    rows = []

    def add(name, rev):
        data = rev.get("data") or {}
        params = flat_keys((data.get("params") or {}).get("params.yaml", {}).get("data") or {})
        metrics = {path: flat_keys(entry.get("data") or {}) for path, entry in (data.get("metrics") or {}).items()}
        if metrics:
            rows.append({"name": name, "params": params, "metrics": metrics})

    for commit in shown:
        add(commit.get("name") or (commit["rev"] if commit["rev"] == "workspace" else commit["rev"][:7]), commit)
        for exp in commit.get("experiments") or []:
            for rev in exp.get("revs", []):
                add(exp.get("name") or rev.get("name") or rev["rev"][:7], rev)
    return rows


def differing_params(rows: list[dict]) -> list[str]:
    keys = sorted({k for r in rows for k in r["params"]})
    return [k for k in keys if len({json.dumps(r["params"].get(k), sort_keys=True) for r in rows}) > 1]


def table(rows: list[dict], gate: str, greater_is_better: bool) -> str:
    """Rows sorted by the gate metric (best first), in at most WIDTH columns."""
    gate_file = {"train": "metrics/train.json", "merge": "metrics/merge.json", "eval": "metrics/eval.json"}
    stage, _, key = gate.partition(".")
    value = lambda r: r["metrics"].get(gate_file.get(stage, ""), {}).get(key)  # noqa: E731
    missing = float("-inf") if greater_is_better else float("inf")
    rows = sorted(rows, key=lambda r: value(r) if isinstance(value(r), (int, float)) else missing,
                  reverse=greater_is_better)
    languages = sorted({k[len(LANGUAGE_PREFIX):] for r in rows for k in r["metrics"].get("metrics/eval.json", {})
                        if k.startswith(LANGUAGE_PREFIX) and k != "compliance.overall"})
    columns = COLUMNS[:2] + [(lang, "metrics/eval.json", LANGUAGE_PREFIX + lang) for lang in languages] + COLUMNS[2:]
    changed = differing_params(rows)
    name_width = max([len("experiment"), *(len(r["name"]) for r in rows)])
    metric_width = sum(max(len(h), 7) + 1 for h, _, _ in columns)
    params_width = max(12, WIDTH - name_width - metric_width - 2)

    def params_text(r):
        text = " ".join(f"{k.split('.')[-1]}={json.dumps(r['params'].get(k))}" for k in changed)
        return text if len(text) <= params_width else text[: params_width - 1] + "…"

    def cell(r, file, key, width):
        v = r["metrics"].get(file, {}).get(key)
        if isinstance(v, float):
            return (f"{v:.3g}" if v == 0 or abs(v) >= 1e-3 else f"{v:.1e}").rjust(width)
        return ("-" if v is None else str(v)).rjust(width)

    header = "experiment".ljust(name_width) + "  " + "params that differ".ljust(params_width)
    header += "".join(" " + h.rjust(max(len(h), 7)) for h, _, _ in columns)
    lines = [header, "-" * len(header)]
    for r in rows:
        line = r["name"].ljust(name_width) + "  " + params_text(r).ljust(params_width)
        line += "".join(" " + cell(r, f, k, max(len(h), 7)) for h, f, k in columns)
        lines.append(line)
    legend = (f"sorted by {gate} ({'higher' if greater_is_better else 'lower'} is better); loss: held-out loss; "
              "comp: reasoning in the asked language (overall, then per language); final: final answer in the "
              "question's language; mgsm: MGSM accuracy; merge: relative logit diff merged vs adapted")
    return "\n".join(lines + textwrap.wrap(legend, WIDTH))


def main() -> None:
    from lora_pipeline.params import load_params

    register = load_params("register").register
    shown = json.loads(subprocess.run(["dvc", "exp", "show", "--json"], capture_output=True, text=True,
                                      check=True).stdout)
    rows = experiment_rows(shown)
    if not rows:
        sys.exit("no experiments with metrics yet: run `dvc repro` or `dvc exp run` first")
    print(table(rows, register.gate_metric, register.gate_greater_is_better))


if __name__ == "__main__":
    main()
