"""The gate's rule from the catalogue of evaluation figures: its direction and the figures that may not gate (that
only validate and register import it: tests/unit/test_stage_deps.py)."""
import pytest
import yaml

from conftest import ROOT
from lora_pipeline.config.params import Eval, Register
from lora_pipeline.registry.gate import check_gate_metric, eval_metric_keys, gate

SHIPPED = yaml.safe_load((ROOT / "params.yaml").read_text())
EVAL = Eval.model_validate(SHIPPED["eval"])


def register(**changes) -> Register:
    return Register.model_validate({**SHIPPED["register"], **changes})


@pytest.mark.parametrize("metric, greater", [
    ("eval.test.loss", False), ("eval.test.perplexity", False), ("eval.compliance.it", True),
    ("eval.tool_call.right_name", True),
    ("train.train_loss", False), ("merge.top1_agreement", True)])  # outside the catalogue: by the key's ending
def test_the_direction_of_a_gate_is_its_figure_s(metric, greater):
    assert gate(register(gate_metric=metric), "local") == (metric, greater)


@pytest.mark.parametrize("metric", ["eval.test.tokens", "eval.task.questions", "eval.demo_reasoning_is_german",
                                    "eval.answer_words"])
def test_a_figure_that_may_not_gate_is_refused_by_name(metric):
    assert metric.removeprefix("eval.") not in eval_metric_keys(EVAL)
    with pytest.raises(ValueError) as refused:
        check_gate_metric(register(gate_metric=metric), EVAL, "local")
    assert str(refused.value).startswith(f"register.gate_metric: '{metric}' may not gate (")
    assert "'eval.test.loss'" in str(refused.value)  # the allowed ones are named


@pytest.mark.parametrize("metric", ["eval.test.tokens", "eval.answer_words"])
def test_a_count_or_a_length_has_no_direction_to_gate_by(metric):
    with pytest.raises(ValueError, match=rf"'{metric}' may not gate \(.*neither more nor fewer is better"):
        gate(register(gate_metric=metric), "local")


def test_a_figure_evaluate_never_writes_is_refused():
    with pytest.raises(ValueError, match=r"'eval.accuracy.mgsm.de' is not a figure that evaluate writes with these "
                                         r"eval params"):
        check_gate_metric(register(gate_metric="eval.accuracy.mgsm.de"),
                          Eval.model_validate({**SHIPPED["eval"], "mgsm": {**SHIPPED["eval"]["mgsm"], "path": ""}}),
                          "builtin")

