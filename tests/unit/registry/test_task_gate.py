"""A task or tool-call figure as register.gate_metric: allowed by name, refused where the data cannot yield it."""
import json

import pytest
import yaml

from conftest import ROOT
from lora_pipeline.config.params import Data, Eval, Register
from lora_pipeline.registry.gate import check_gate_metric, eval_metric_keys, gate
from lora_pipeline.validation.all_checks import check_gate_data

SHIPPED = yaml.safe_load((ROOT / "params.yaml").read_text())


def shipped(cls, section: str, **changes):
    return cls.model_validate({**SHIPPED[section], **changes})


def call(city: str) -> dict:
    return {"type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def test_the_task_and_tool_call_figures_can_gate_with_higher_is_better():
    keys = eval_metric_keys(shipped(Eval, "eval"))
    assert {"task.exact_match", "task.rouge_l", "task.chrf", "tool_call.right_call", "tool_call.right_name",
            "tool_call.no_call_when_none"} <= set(keys)
    assert not {"task.questions", "tool_call.questions", "tool_call.calls_expected"} & set(keys)  # counts
    for metric in ("eval.task.chrf", "eval.tool_call.right_call"):
        check_gate_metric(shipped(Register, "register", gate_metric=metric), shipped(Eval, "eval"), "local")
        assert gate(shipped(Register, "register", gate_metric=metric), "local") == (metric, True)


@pytest.mark.parametrize("metric, words", [
    ("eval.task.rouge_l", "a reference answered in text"), ("eval.tool_call.right_call", "a tool call"),
    ("eval.tool_call.no_call_when_none", "tools offered and an answer without a call")])
def test_the_built_in_data_cannot_gate_on_a_task_figure(metric, words):
    with pytest.raises(ValueError) as refused:
        check_gate_data(shipped(Register, "register", gate_metric=metric), shipped(Data, "data"))
    assert str(refused.value) == (f"register.gate_metric: '{metric}' needs a row that asks no reasoning language with "
                                  f"{words}, and no row of the built-in set (each asks for a reasoning language) has "
                                  f"one; gate on a figure this data yields, e.g. the held-out loss (eval.test.loss, "
                                  f"or auto)")


def test_a_local_file_gates_on_the_figures_its_rows_yield(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data/local").mkdir(parents=True)
    files = {"alpaca.json": [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(3)],
             "calls.jsonl": [{"messages": [{"role": "user", "content": "Weather?"},
                                           {"role": "assistant", "content": None, "tool_calls": [call("Oslo")]},
                                           {"role": "tool", "content": "{}"},
                                           {"role": "assistant", "content": "Cold."}], "tools": [TOOL]}] * 3,
             "reasoning.json": [{"instruction": "q", "output": "a", "system": "reasoning language: German"}] * 3}
    for name, rows in files.items():
        path = tmp_path / "data/local" / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows) if name.endswith(".jsonl") else json.dumps(rows))
    yields = {"alpaca.json": {"eval.task.rouge_l"}, "calls.jsonl": {"eval.tool_call.right_call"},
              "reasoning.json": set()}
    for name, allowed in yields.items():
        data = shipped(Data, "data", source="local", name=f"data/local/{name}")
        for metric in ("eval.task.rouge_l", "eval.tool_call.right_call", "eval.tool_call.no_call_when_none"):
            register = shipped(Register, "register", gate_metric=metric)
            if metric in allowed:
                check_gate_data(register, data)
            else:
                with pytest.raises(ValueError, match=f"'{metric}' needs a row .* no row of data/local/{name} has"):
                    check_gate_data(register, data)
    # a Hub data set is known only once fetched
    check_gate_data(shipped(Register, "register", gate_metric="eval.task.chrf"),
                    shipped(Data, "data", source="hub", name="org/set"))
