"""Chat templates, the assistant-only loss mask and reasoning extraction."""
import pytest
from transformers import AutoTokenizer

from lora_pipeline.data import builtin as builtin_data
from lora_pipeline.evaluate.heldout import assistant_mask
from lora_pipeline.model.chat import (CHATML_THINK_TEMPLATE, HARMONY_TEMPLATE, as_text, conversation, prompt_messages,
                                      split_reasoning)
from lora_pipeline.model.tiny import tokenizer_corpus, train_tokenizer

ROWS = builtin_data.generate(200, seed=3)


@pytest.fixture(scope="module", params=["tiny-qwen2", "tiny-gpt-oss"])
def tokenizer(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    train_tokenizer(tokenizer_corpus(ROWS), 600, request.param, out)
    return AutoTokenizer.from_pretrained(out)


def test_template_renders_reasoning_and_answer(tokenizer):
    row = ROWS[0]
    text = tokenizer.apply_chat_template(conversation(row), tokenize=False)
    assert row["analysis"] in text and row["final"] in text and row["user"] in text
    assert "reasoning language: " + row["reasoning_language"] in text
    assert text.index(row["analysis"]) < text.index(row["final"])  # reasoning comes first
    if "<|channel|>" in text:
        assert f"<|channel|>analysis<|message|>{row['analysis']}<|end|>" in text
        assert f"<|channel|>final<|message|>{row['final']}<|return|>" in text
    else:
        assert f"<think>\n{row['analysis']}\n</think>\n{row['final']}<|im_end|>" in text


def test_assistant_mask_covers_exactly_the_assistant_turn(tokenizer):
    for row in ROWS[:20]:
        messages = conversation(row)
        ids, mask = assistant_mask(tokenizer, messages, max_length=4096)
        assert len(ids) == len(mask) and 0 < sum(mask) < len(mask)
        # the masked tokens are one contiguous run, followed by nothing but the template's newline ...
        first, last = mask.index(1), len(mask) - mask[::-1].index(1)
        assert all(mask[first:last]) and not any(mask[:first])
        assert tokenizer.decode(ids[last:]).strip() == ""
        # ... that decodes to exactly the assistant turn the template renders after the generation prompt
        prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(messages, tokenize=False)
        assistant_part = full[len(prompt):].rstrip("\n")
        assert tokenizer.decode([t for t, m in zip(ids, mask) if m]).rstrip("\n") == assistant_part
        assert row["analysis"] in assistant_part and row["user"] not in assistant_part


def test_generation_prompt_then_reasoning_round_trip(tokenizer):
    row = ROWS[1]
    prompt = tokenizer.apply_chat_template(conversation(row)[:-1], tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(conversation(row), tokenize=False)
    assert split_reasoning(full[len(prompt):]) == (row["analysis"], row["final"])


def test_split_reasoning_formats():
    assert split_reasoning("<think>\nDenken.\n</think>\nAntwort.<|im_end|>") == ("Denken.", "Antwort.")
    assert split_reasoning("<think>\nnever closed") == ("never closed", "")
    harmony = "<|channel|>analysis<|message|>Razonamiento.<|end|><|start|>assistant<|channel|>final<|message|>42<|return|>"
    assert split_reasoning(harmony) == ("Razonamiento.", "42")
    assert split_reasoning("plain answer<|im_end|>") == ("", "plain answer")


def test_prompt_messages():
    assert prompt_messages("Q?", "German") == [{"role": "system", "content": "reasoning language: German"},
                                               {"role": "user", "content": "Q?"}]
    assert prompt_messages("Q?", None) == [{"role": "user", "content": "Q?"}]
    assert prompt_messages("Q?", "French", "Be brief.")[0]["content"] == "reasoning language: French\n\nBe brief."


TOOL_ROWS = [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Weather in Paris?"},
                           {"role": "assistant", "content": None, "tool_calls": [
                               {"type": "function", "function": {"name": "get_weather",
                                                                 "arguments": '{"city": "Paris"}'}}]},
                           {"role": "tool", "content": '{"temp": 21}'},
                           {"role": "assistant", "content": "21 degrees."}],
              "tools": [{"type": "function", "function": {
                  "name": "get_weather", "description": "The weather in a city",
                  "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]}]


@pytest.mark.parametrize("family", ["tiny-qwen2", "tiny-gpt-oss"])
def test_the_tiny_templates_render_tools_and_train_on_the_calls(family, tmp_path):
    """Data with tools gets the family's template that renders them: the schemas, the call, the tool's answer; the
    assistant mask covers the call and the answer, not the tool's turn."""
    row = TOOL_ROWS[0]
    train_tokenizer(tokenizer_corpus(TOOL_ROWS), 300, family, tmp_path, tools=True)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    text = as_text(tok, row)
    for part in ("The weather in a city", '"city"', "get_weather", '{"city": "Paris"}', '{"temp": 21}',
                 "21 degrees.", "be brief", "Weather in Paris?"):
        assert part in text
    ids, mask = assistant_mask(tok, conversation(row), 10_000)
    assert ids == tok.apply_chat_template(conversation(row), tokenize=True, return_dict=True)["input_ids"]
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    assert '{"city": "Paris"}' in trained and "21 degrees." in trained and '{"temp": 21}' not in trained
    plain = train_tokenizer(tokenizer_corpus(ROWS), 300, family, tmp_path / "plain")
    assert plain.chat_template == (CHATML_THINK_TEMPLATE if family == "tiny-qwen2" else HARMONY_TEMPLATE)


def test_training_rows_keep_the_weight_key_only_for_data_that_has_it():
    """OpenAI's per-turn weight reaches TRL on every message (one Arrow schema; None where a message has none) only
    where some message of the data has one: other data's rows are as before."""
    from lora_pipeline.model.chat import training_rows

    plain = {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}
    weighted = {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "weight": 0},
                             {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "B"}]}
    assert training_rows([plain]) == [{"messages": [{"role": "user", "content": "Q", "thinking": None},
                                                    {"role": "assistant", "content": "A", "thinking": None}]}]
    rows = training_rows([plain, weighted])
    assert [[m["weight"] for m in row["messages"]] for row in rows] == [[None, None], [None, 0, None, None]]
    with_tools = training_rows([{**weighted, **TOOL_ROWS[0]}, weighted])
    assert all(set(m) == {"role", "content", "thinking", "weight", "tool_calls", "name", "tool_call_id"}
               for row in with_tools for m in row["messages"])
