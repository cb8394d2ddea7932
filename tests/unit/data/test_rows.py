"""Row checks: the reason and field of what makes a row unusable."""
import pytest

from lora_pipeline.data import builtin as builtin_data
from lora_pipeline.data.rows import row_problem

ROWS = builtin_data.generate(200, seed=3)


@pytest.mark.parametrize("row, reason, detail", [
    ({}, "not_a_conversation", "messages: missing"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "unknown_role", "messages[0].role: 'bot' is not one of"),
    ({"messages": [{"role": "user", "content": 3}]}, "non_string_content",
     "messages[0].content: must be a string, got int"),
    ({"messages": [{"role": "assistant", "content": "x", "thinking": 1}]}, "non_string_content",
     "messages[0].thinking: must be a string or null, got int"),
    ({"messages": [{"role": "user", "content": "x"}]}, "no_assistant_turn", "messages: no assistant turn"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "\n"}]}, "empty_content",
     "messages[1].content: empty"),
])
def test_row_problem_names_the_reason_and_field(row, reason, detail):
    problem = row_problem(row)
    assert problem.reason == reason and problem.detail.startswith(detail)


def test_builtin_rows_have_no_problem():
    assert [row_problem(row) for row in ROWS] == [None] * len(ROWS)
