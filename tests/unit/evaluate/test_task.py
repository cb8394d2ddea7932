"""The held-out answers of rows asked as they ask against their references: normalisation, ROUGE-L and chrF against the
libraries, tool calls parsed from both chat templates and compared, the figures and reports/task.md."""
import json
import os
from types import SimpleNamespace
from unittest.mock import patch

import pytest
import yaml
from rouge_score.rouge_scorer import RougeScorer
from sacrebleu import corpus_chrf, sentence_chrf

from conftest import ROOT
from lora_pipeline.config.params import Eval
from lora_pipeline.evaluate.figures import report_figures
from lora_pipeline.evaluate.scoring import eval_figures, loss_figures
from lora_pipeline.evaluate.task import (NOTHING_SCORED, UnicodeWords, answer_text, asked_turn, chrf, normalized,
                                         parse_tool_calls, reference, rouge_l, row_yields, score_answer, task_report)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def tool_row(city="Paris", answer="10 degrees."):
    """A row that calls a tool, reads its answer and answers (the OpenAI form fetch writes)."""
    return {"messages": [{"role": "user", "content": f"Weather in {city}?"},
                         {"role": "assistant", "content": None, "tool_calls": [call("get_weather", {"city": city})]},
                         {"role": "tool", "content": '{"temperature": 10}'},
                         {"role": "assistant", "content": answer}], "tools": [WEATHER]}


def qwen_call(name, arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def harmony_call(name, arguments) -> str:
    return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{json.dumps(arguments)}<|call|>"


@pytest.mark.parametrize("text, expected", [
    ("  The  Answer:\tParis! ", "the answer paris"), ("ПАРИЖ.", "париж"), ("«Straße»", "strasse"),
    ("¿Qué?", "qué"), ("北京。", "北京"), ("ｆｕｌｌ－ｗｉｄｔｈ", "fullwidth"),
])
def test_exact_match_normalises_case_punctuation_and_whitespace(text, expected):
    assert normalized(text) == expected


@pytest.mark.parametrize("text, words", [
    ("Hello, World!", ["hello", "world"]), ("Der Bär ist groß.", ["der", "bär", "ist", "gross"]),
    ("हिन्दी भाषा", ["हिन्दी", "भाषा"]), ("北京是首都", ["北", "京", "是", "首", "都"]),
    ("東京Tower 2024", ["東", "京", "tower", "2024"]), ("Привет, мир", ["привет", "мир"]),
])
def test_rouge_words_keep_every_script(text, words):
    assert UnicodeWords().tokenize(text) == words


def test_rouge_l_is_rouge_scores_on_ascii_and_scores_other_scripts():
    pairs = [("the cat sat on the mat", "the cat is on the mat"), ("a b c d", "d c b a"), ("", "anything")]
    library = RougeScorer(["rougeL"])  # its own tokenizer: the same words for lowercase ASCII text
    for answer, ref in pairs:
        assert rouge_l(answer, ref) == pytest.approx(library.score(ref, answer)["rougeL"].fmeasure)
    assert rouge_l("the cat sat on the mat", "the cat is on the mat") == pytest.approx(5 / 6)
    assert library.score("北京是首都", "北京是首都")["rougeL"].fmeasure == 0  # why its tokenizer is not used
    # 北京是首都 against 北京是中国的首都: the common subsequence 北京是首都, 5 of 5 and of 8 characters
    assert rouge_l("北京是首都", "北京是中国的首都") == pytest.approx(2 * 1 * 5 / 8 / (1 + 5 / 8))


def test_chrf_is_sacrebleus_corpus_chrf():
    answers, refs = ["Der Bär ist braun.", "北京是首都", "nothing alike"], ["Der Bär ist groß.", "北京是中国的首都",
                                                                           "zzz"]
    assert chrf(answers, refs) == pytest.approx(corpus_chrf(answers, [refs]).score)
    assert chrf(answers[:1], refs[:1]) == pytest.approx(sentence_chrf(answers[0], refs[:1]).score)
    assert chrf(["same"], ["same"]) == 100.0


def test_tool_calls_are_parsed_from_both_templates():
    qwen = "Let me look.\n" + qwen_call("get_weather", {"city": "Paris"}) + qwen_call("get_time", {}) + "<|im_end|>"
    assert parse_tool_calls(qwen) == [{"name": "get_weather", "arguments": {"city": "Paris"}},
                                      {"name": "get_time", "arguments": {}}]
    harmony = ("<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant"
               + harmony_call("get_weather", {"city": "Paris"}))
    assert parse_tool_calls(harmony) == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    # gpt-oss's own template may name the recipient before the channel
    assert parse_tool_calls('<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{"q": 1}'
                            '<|call|>') == [{"name": "lookup", "arguments": {"q": 1}}]
    # arguments as JSON text inside the call, cut-off arguments, a call that is not JSON, and none at all
    assert parse_tool_calls(qwen_call("f", json.dumps({"a": 1}))) == [{"name": "f", "arguments": {"a": 1}}]
    assert parse_tool_calls(harmony_call("f", {"a": 1})[:-12]) == [{"name": "f", "arguments": None}]
    assert parse_tool_calls("<tool_call>\nget_weather(Paris)\n</tool_call>") == [{"name": None, "arguments": None}]
    assert parse_tool_calls("It is sunny.<|im_end|>") == []


def test_a_tool_row_is_asked_up_to_its_first_call_and_any_other_up_to_its_last_answer():
    row = tool_row()
    assert asked_turn(row["messages"]) == 1
    assert reference(row) == {"text": "", "calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
    plain = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                          {"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris"}]}
    assert asked_turn(plain["messages"]) == 3 and reference(plain) == {"text": "Paris"}
    offered = {**plain, "tools": [WEATHER]}  # tools offered, none called: the answer, and no call is due
    assert reference(offered) == {"text": "Paris", "calls": []}
    assert row_yields(row) == {"call"} and row_yields(plain) == {"text"} and row_yields(offered) == {"text", "no_call"}
    assert row_yields({"text": "a document"}) == set()


@pytest.mark.parametrize("generated, right_call, right_name", [
    (qwen_call("get_weather", {"city": "Paris"}), True, True),
    (harmony_call("get_weather", {"city": "Paris"}), True, True),
    (qwen_call("get_weather", {"city": "Rome"}), False, True),
    (qwen_call("get_time", {"city": "Paris"}), False, False),
    ("It is 10 degrees in Paris.<|im_end|>", False, False),
    (qwen_call("get_weather", {"city": "Paris"}) * 2, False, False),  # one call too many
])
def test_a_call_is_right_with_the_same_name_and_equal_parsed_arguments(generated, right_call, right_name):
    scores = score_answer(reference(tool_row()), generated)
    assert (scores["right_call"], scores["right_name"]) == (right_call, right_name)
    assert "exact_match" not in scores and "no_call" not in scores


def test_parallel_calls_match_in_any_order_and_arguments_as_values():
    expected = {"text": "", "calls": [{"name": "a", "arguments": {"x": 1, "y": [1, 2]}},
                                      {"name": "b", "arguments": {}}]}
    assert score_answer(expected, qwen_call("b", {}) + qwen_call("a", {"y": [1, 2], "x": 1}))["right_call"]
    assert not score_answer(expected, qwen_call("b", {}) + qwen_call("a", {"y": [2, 1], "x": 1}))["right_call"]


def test_no_call_where_the_reference_answers_and_the_answer_is_scored_as_text():
    expected = {"text": "Paris is the capital.", "calls": []}
    answered = score_answer(expected, "<think>\nhm\n</think>\nparis is the capital<|im_end|>")
    assert answered["no_call"] and answered["exact_match"] and answered["answer"] == "paris is the capital"
    called = score_answer(expected, "Paris is the capital." + qwen_call("get_weather", {}))
    assert not called["no_call"] and called["answer"] == "Paris is the capital." and called["exact_match"]
    assert score_answer({"text": ""}, "anything") == {}  # nothing to compare with


def test_text_answers_are_scored_on_the_final_answer():
    scores = score_answer({"text": "Paris"}, "<|channel|>analysis<|message|>France...<|end|><|start|>assistant"
                          "<|channel|>final<|message|>Paris.<|return|>")
    assert scores == {"reference": "Paris", "answer": "Paris.", "exact_match": True, "rouge_l": 1.0,
                      "chrf": pytest.approx(sentence_chrf("Paris.", ["Paris"]).score)}
    assert answer_text("Sure." + qwen_call("f", {}) + "<|im_end|>") == "Sure."


def scored_records():
    plain = [({"text": ref}, answer) for answer, ref in
             [("Paris", "Paris."), ("the cat sat", "the cat is here"), ("", "nothing")]]
    tools = [(reference(tool_row()), qwen_call("get_weather", {"city": "Paris"})),
             (reference(tool_row()), qwen_call("get_weather", {"city": "Rome"})),
             ({"text": "Hello", "calls": []}, "Hello")]
    return [{"set": "heldout", "question": f"q{i}", "generated": generated, **score_answer(expected, generated)}
            for i, (expected, generated) in enumerate(plain + tools)]


def test_eval_figures_score_the_rows_asked_as_they_ask():
    records = scored_records()
    figures = eval_figures(["en"], loss_figures(2.0, 2), records, {}, None)
    text = [r for r in records if "exact_match" in r]
    assert figures["task"] == {
        "exact_match": 2 / 4, "questions": 4, "rouge_l": pytest.approx(sum(r["rouge_l"] for r in text) / 4),
        "chrf": pytest.approx(corpus_chrf([r["answer"] for r in text], [[r["reference"] for r in text]]).score)}
    assert figures["tool_call"] == {"questions": 3, "calls_expected": 2, "answers_expected": 1, "right_call": 0.5,
                                    "right_name": 1.0, "no_call_when_none": 1.0}
    assert figures["compliance"] == "not applicable: no held-out row asks for a reasoning language"
    assert figures["answer_words"] == (1 + 3 + 0 + 0 + 0 + 1) / 6  # a call is no answer text


def test_the_figures_of_rows_that_ask_a_reasoning_language_are_unchanged():
    """The built-in data: every held-out row asks for a reasoning language, so metrics/eval.json gains no key."""
    heldout = [{"set": "heldout", "reasoning_language": "en", "question": "1+1?", "generated": "2",
                "reasoning_detected": "en", "final_detected": "en", "user_language": "en", "correct": True}]
    figures = eval_figures(["en"], loss_figures(1.0, 1), heldout, {}, "de")
    assert figures == {"test": loss_figures(1.0, 1), "compliance": {"en": 1.0, "overall": 1.0},
                       "final_language_rate": 1.0, "accuracy": {"builtin": 1.0}, "answer_words": 1.0,
                       "demo_reasoning_is_german": 1}
    assert task_report(heldout, heldout, figures, figures, report_figures()) == \
        f"# Held-out answers against their references\n\n{NOTHING_SCORED}"


def test_the_report_shows_the_reference_beside_both_answers():
    finetuned = [{**r, "prompt": [{"role": "user", "content": r["question"]}]} for r in scored_records()]
    base = [{**r, "answer": "base says ```no```", "exact_match": False} if "answer" in r else r for r in finetuned]
    figures = eval_figures(["en"], loss_figures(2.0, 2), finetuned, {}, None)
    report = task_report(finetuned, base, figures, {"task": {"exact_match": 0.0}}, report_figures())
    assert "| figure | base | fine-tuned |" in report and "| exact match (share) | 0 | 0.5 |" in report
    assert "| right call (share) | - | 0.5 |" in report
    assert report.count("## ") == 6 and "base says ```no```" in report and "````text" in report
    assert 'get_weather({"city": "Rome"})' in report and "right function, other arguments" in report
    # eval.include_base false: the fine-tuned answers alone
    alone = task_report(finetuned, [], figures, {}, report_figures())
    assert "| figure | fine-tuned |" in alone and "\nbase (" not in alone


def evaluate_stage(monkeypatch, generate):
    """stages.evaluate and the shipped eval params, with no model: the held-out loss and the implementations stubbed,
    `generate` in place of the decoding."""
    with patch.dict(os.environ):  # importing the stages pins the CPU numerics in os.environ
        from stages import evaluate
    monkeypatch.setattr(evaluate, "heldout_loss", lambda *args, **kwargs: loss_figures(1.0, 4))
    monkeypatch.setattr(evaluate, "use_for_loss", lambda model: {"attention": "sdpa"})
    monkeypatch.setattr(evaluate, "use_for_generation",
                        lambda model, decode_step: {"attention": "sdpa", "decode_step": decode_step})
    monkeypatch.setattr(evaluate, "generate", generate)
    return evaluate, Eval.model_validate(yaml.safe_load((ROOT / "params.yaml").read_text())["eval"])


def test_the_stage_asks_tool_rows_with_their_tools_up_to_the_first_call(monkeypatch):
    asked = {}

    def generate(model, tokenizer, conversations, *args, tools=None):
        asked.update(conversations=conversations, tools=tools)
        return [qwen_call("get_weather", {"city": "Paris"}), "Paris"] + ["x"] * (len(conversations) - 2)

    evaluate, ev = evaluate_stage(monkeypatch, generate)
    plain = {"messages": [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris"}]}
    metrics, records, _ = evaluate.evaluate(SimpleNamespace(), None, ev, [], [tool_row(), plain])
    assert [m["role"] for m in asked["conversations"][0]] == ["user"]  # stopped before the call
    assert asked["tools"][:2] == [[WEATHER], None] and not any(asked["tools"][2:])
    assert metrics["tool_call"]["right_call"] == 1.0 and metrics["task"]["exact_match"] == 1.0
    first = records[0]
    assert first["prompt"] == [{"role": "user", "content": "Weather in Paris?"}] and first["right_call"]


def test_the_built_in_rows_are_asked_and_recorded_as_before(monkeypatch):
    """The shipped default: every built-in row asks for a reasoning language, so no prompt gets tools, no record a
    reference, and metrics/eval.json no task or tool-call figure (its bytes stay those committed)."""
    from lora_pipeline.data.builtin import generate as builtin_rows

    asked = {}
    evaluate, ev = evaluate_stage(monkeypatch, lambda model, tokenizer, conversations, *args, tools=None:
                                  asked.update(tools=tools) or ["<think>\nx\n</think>\n7"] * len(conversations))
    metrics, records, _ = evaluate.evaluate(SimpleNamespace(), None, ev, [], builtin_rows(4, seed=0))
    assert asked["tools"] is None and not {"task", "tool_call"} & set(metrics)
    assert {key for r in records for key in r} == {"set", "reasoning_language", "question", "generated",
                                                   "reasoning_detected", "final_detected", "user_language", "correct"}
