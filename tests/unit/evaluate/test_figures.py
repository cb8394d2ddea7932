"""The catalogue of evaluation figures: each key declared once, patterns told from exact keys, and what may gate has a
direction and a need validate can check, and reports/task.md shows figures of the answers scored against a reference."""
import yaml

from conftest import ROOT
from lora_pipeline.config.params import Eval
from lora_pipeline.evaluate.figures import ANY, FIGURES, MGSM, REASONING, ROW_NEEDS, figure_of, report_figures, written

SHIPPED_EVAL = yaml.safe_load((ROOT / "params.yaml").read_text())["eval"]


def test_each_key_and_column_is_declared_once():
    keys = [figure.key for figure in FIGURES]
    headers = [figure.column.header for figure in FIGURES if figure.column]
    assert len(set(keys)) == len(keys) and len(set(headers)) == len(headers)


def test_a_key_is_its_exact_figure_before_a_pattern():
    assert figure_of("compliance.overall").key == "compliance.overall"
    assert figure_of("compliance.de").key == "compliance.{language}"
    assert figure_of("accuracy.mgsm.overall").key == "accuracy.mgsm.overall"
    assert figure_of("accuracy.mgsm.fr").key == "accuracy.mgsm.{mgsm_language}"
    assert figure_of("compliance.de.extra") is None and figure_of("test") is None


def test_a_pattern_takes_the_languages_of_the_eval_params():
    ev = Eval.model_validate({**SHIPPED_EVAL, "languages": ["en", "ja"],
                              "mgsm": {"path": "hub", "languages": ["de"], "limit": 2}})
    keys = written(ev)
    assert {"compliance.en", "compliance.ja", "compliance.overall", "accuracy.mgsm.de"} <= set(keys)
    assert keys["compliance.ja"] is figure_of("compliance.ja")
    no_mgsm = Eval.model_validate({**SHIPPED_EVAL, "mgsm": {**SHIPPED_EVAL["mgsm"], "path": ""}})
    assert not [key for key in written(no_mgsm) if key.startswith("accuracy.mgsm")]


def test_a_figure_that_may_gate_has_a_direction_and_a_need_validate_checks():
    for figure in FIGURES:
        if figure.may_gate:
            assert figure.higher_is_better is not None, figure.key
            assert figure.needs in (ANY, REASONING, MGSM, *ROW_NEEDS), figure.key
        if figure.higher_is_better is None:  # a count
            assert not figure.may_gate, figure.key


def test_the_task_report_shows_figures_of_the_answers_scored_against_a_reference():
    """reports/task.md's table: each figure a row with a reference yields (a text or a call), under its label, and
    none of the reasoning figures or counts, which the report's rows do not speak of."""
    shown = dict(report_figures())
    assert shown and len(set(shown.values())) == len(shown)
    for key in shown:
        figure = figure_of(key)
        assert figure.key == key and figure.needs in ROW_NEEDS and figure.higher_is_better is not None, key
