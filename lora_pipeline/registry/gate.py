"""The register gate's rule: the figure a new model version is judged by and its direction (register.gate_metric,
register.gate_greater_is_better; auto: BUILTIN_GATE or HELD_OUT_GATE), validate's checks of both, and whether a
version beats the champion. Only validate and register import it, so an edit here re-runs those two stages alone."""
from __future__ import annotations

from lora_pipeline.config.outputs import METRICS
from lora_pipeline.evaluate.figures import Figure, figure_of, written
from lora_pipeline.registry.mlflow_names import CHAMPION

# The default gate: the built-in task's measure (reasoning in the asked language) on its data, the held-out loss on
# any other, which every data set has.
BUILTIN_GATE, HELD_OUT_GATE = "eval.compliance.overall", "eval.test.loss"


def gate_metric(register, data_source: str) -> str:
    """register.gate_metric as it applies to this data: auto is the built-in data's compliance, other data's
    held-out loss."""
    if register.gate_metric == "auto":
        return BUILTIN_GATE if data_source == "builtin" else HELD_OUT_GATE
    return register.gate_metric


def eval_figure(metric: str) -> Figure | None:
    """The catalogue's figure (lora_pipeline.evaluate.figures) that a gate metric names, None for one of another
    metrics file or none of the catalogue."""
    stage, _, key = metric.partition(".")
    return figure_of(key) if stage == "eval" else None


def gate(register, data_source: str) -> tuple[str, bool]:
    """(gate metric, whether higher is better) as they apply to this data (gate_metric); auto direction: an
    evaluation figure's own, and for a train. or merge. figure lower for a loss or perplexity, else higher."""
    metric = gate_metric(register, data_source)
    greater = register.gate_greater_is_better
    if greater == "auto":
        figure = eval_figure(metric)
        if figure is None:
            greater = not metric.endswith(("loss", "perplexity"))
        elif figure.higher_is_better is None:
            raise ValueError(may_not_gate(metric, figure))
        else:
            greater = figure.higher_is_better
    return metric, greater


def eval_metric_keys(ev) -> list[str]:
    """The figures of metrics/eval.json that register.gate_metric may name with these eval params: those of the
    catalogue that may gate (MGSM's only where eval.mgsm.path is set), a pattern's once per language."""
    return [key for key, figure in written(ev).items() if figure.may_gate]


def may_not_gate(metric: str, figure: Figure) -> str:
    neither = ": neither more nor fewer is better" if figure.higher_is_better is None else ""
    return f"register.gate_metric: '{metric}' may not gate ({figure.computed}{neither})"


def check_register(register) -> None:
    if register.gate_metric == "auto":
        return
    stage = register.gate_metric.split(".")[0]
    if stage not in METRICS:
        *first, last = [f"{prefix}." for prefix in METRICS]
        raise ValueError(f"register.gate_metric '{register.gate_metric}' must start with {', '.join(first)} or {last} "
                         "(the metrics file it comes from)")


def check_gate_metric(register, ev, data_source: str) -> None:
    """An eval. gate metric must be a figure that may gate and that evaluate writes with these params (train. and
    merge. figures are checked by register against the metrics files; the data a figure needs, by
    validation.all_checks.check_gate_data)."""
    metric = gate_metric(register, data_source)
    stage, _, key = metric.partition(".")
    if stage != "eval" or key in (known := eval_metric_keys(ev)):
        return
    allowed = f"allowed: {['eval.' + k for k in known]}"
    figure = figure_of(key)
    if figure is not None and not figure.may_gate:
        raise ValueError(f"{may_not_gate(metric, figure)}; {allowed}")
    raise ValueError(f"register.gate_metric: '{metric}' is not a figure that evaluate writes with these eval params; "
                     f"{allowed}")


def champion_decision(client, model_name: str, metric: str, value: float, greater_is_better: bool) -> dict:
    """Whether a new version with gate `metric` = `value` beats the current @champion (which may not exist) of
    `model_name` in the MLflow registry of `client`: a champion whose run lacks the figure is beaten."""
    from mlflow.exceptions import MlflowException  # validate imports this module, and never MLflow

    try:
        champion = client.get_model_version_by_alias(model_name, CHAMPION)
    except MlflowException:
        return {"promote": True, "reason": "no champion yet", "metric": metric, "champion_version": None,
                "champion_value": None}
    current = client.get_run(champion.run_id).data.metrics.get(metric)
    if current is None:
        better = True
    else:
        better = value > current if greater_is_better else value < current
    verdict = "beats" if better else "does not beat"
    return {"promote": better, "metric": metric, "champion_version": champion.version, "champion_value": current,
            "reason": f"{metric} {value:.4g} {verdict} champion v{champion.version}'s {current}"}
