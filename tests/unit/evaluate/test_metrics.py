"""Answer extraction, language identification and MGSM reading, on real multilingual text; the figures evaluate
writes and those the gate may name."""
import json
import math
import os
from types import SimpleNamespace
from unittest.mock import patch

import pytest
import yaml

from conftest import MGSM, ROOT
from lora_pipeline.config.params import Eval, flat_keys
from lora_pipeline.evaluate.figures import NOT_APPLICABLE, written
from lora_pipeline.evaluate.scoring import (answer_correct, detect_language, eval_figures, last_number, loss_figures,
                                            mgsm_files, read_mgsm)

needs_mgsm = pytest.mark.skipif(not MGSM.is_dir(), reason=f"MGSM not at {MGSM}")


@pytest.mark.parametrize("text, number", [
    ("Sie hat 19 Äpfel.", 19), ("So the answer is 1,250 dollars.", 1250), ("Er macht 70.000 US-Dollar Gewinn", 70000),
    ("total 12 500 €", 12500), ("3,5 kg", 3.5), ("costs 2.75 each", 2.75), ("-4 degrees", -4), ("no number", None),
    ("first 3 then 8", 8),
])
def test_last_number(text, number):
    assert last_number(text) == number


def test_answer_correct():
    assert answer_correct("Julia a 51 oranges.", 51)
    assert not answer_correct("Julia a 50 oranges.", 51)
    assert not answer_correct("", 51)


@needs_mgsm
def test_language_identification_on_mgsm_exemplars():
    """The exemplars' step-by-step answers are human-written reasoning in each language."""
    rows = [json.loads(line) for line in (MGSM / "exemplars.jsonl").read_text(encoding="utf-8").splitlines()]
    assert {r["lang"] for r in rows} >= {"de", "es", "fr", "ru", "zh"}
    hits = [detect_language(r["answer_text"]) == r["lang"] for r in rows]
    assert sum(hits) / len(hits) >= 0.9, [(r["lang"], detect_language(r["answer_text"])) for r in rows]
    assert detect_language("") is None


@needs_mgsm
@pytest.mark.parametrize("lang", ["en", "de", "ru", "zh"])
def test_read_mgsm_any_script(lang):
    rows = read_mgsm(str(MGSM), lang, limit=5)
    assert len(rows) == 5 and all(isinstance(r["answer"], float) for r in rows)
    assert rows[0]["answer"] == 18  # Janet's ducks, in every language
    assert detect_language(rows[0]["question"]) == lang


@needs_mgsm
def test_mgsm_missing_language_names_the_file():
    with pytest.raises(FileNotFoundError, match="mgsm_it.tsv"):
        mgsm_files(MGSM, ["de", "it"])
    with pytest.raises(FileNotFoundError, match="not a folder"):
        mgsm_files(MGSM / "nope", ["de"])


def test_compare_logits_over_the_masked_positions():
    import torch

    from lora_pipeline.merge.merged_checks import compare_logits

    reference = torch.tensor([[[1.0, -4.0], [2.0, 0.0]], [[100.0, 0.0], [0.5, 0.25]]])
    other = reference + torch.tensor([[[0.5, 0.0], [0.0, -1.0]], [[50.0, 0.0], [0.0, 0.5]]])
    mask = torch.tensor([[1, 1], [0, 1]])  # the padded position (|reference| 100, difference 50) does not count
    compared = compare_logits(reference, other, mask)
    assert compared["max_abs_logit_diff"] == 1.0
    assert compared["relative_logit_diff"] == 1.0 / 4.0
    assert compared["mean_abs_logit_diff"] == pytest.approx(2.0 / 6)
    assert compared["mean_relative_logit_diff"] == pytest.approx(2.0 / 7.75)  # mean |reference| 7.75 / 6
    assert compared["top1_agreement"] == pytest.approx(2 / 3)  # the last position's top token changes


def test_eval_figures_from_the_records():
    heldout = [{"reasoning_language": lang, "reasoning_detected": detected, "final_detected": "en",
                "user_language": "en", "correct": correct, "generated": generated}
               for lang, detected, correct, generated in [
                   ("en", "en", True, "<think>\nfive and two\n</think>\nIt is 7.<|im_end|>"),
                   ("de", "en", False, "<think>\nfive and two\n</think>\n8<|im_end|>"),
                   ("en", "en", True, "<think>\nfive and two\n</think>\nSeven: 7.<|im_end|>"),
                   ("de", "de", True, "<think>\nfünf und zwei\n</think>\n\u4e03\u4e2a<|im_end|>")]]
    figures = eval_figures(["en", "de"], loss_figures(6.0, 3), heldout, {"en": [True, False], "de": [True]}, "de")
    assert figures == {"test": {"loss": 2.0, "perplexity": math.exp(2.0), "tokens": 3},
                       "compliance": {"en": 1.0, "de": 0.5, "overall": 0.75}, "final_language_rate": 1.0,
                       "accuracy": {"builtin": 0.75, "mgsm": {"en": 0.5, "de": 1.0, "overall": 0.75}},
                       "answer_words": (3 + 1 + 2 + 2) / 4, "demo_reasoning_is_german": 1}
    assert list(figures["compliance"]) == ["en", "de", "overall"]  # the order of plots/compliance/*.csv


def test_the_catalogue_names_every_figure_evaluate_writes(monkeypatch):
    """evaluate's metrics, with MGSM and rows of every kind (a user language and an answer, a text reference, a tool
    call, tools answered without a call), are the catalogue's keys for these params: a figure evaluate writes that the
    catalogue lacks, or one it declares that evaluate never writes, fails here."""
    with patch.dict(os.environ):  # importing the stages pins the CPU numerics in os.environ
        from stages import evaluate
    ev = Eval.model_validate({**yaml.safe_load((ROOT / "params.yaml").read_text())["eval"],
                              "mgsm": {"path": "hub", "languages": ["de", "fr"], "limit": 2}})
    monkeypatch.setattr(evaluate, "heldout_loss", lambda *args, **kwargs: loss_figures(1.0, 4))
    monkeypatch.setattr(evaluate, "use_for_loss", lambda model: {"attention": "sdpa"})
    monkeypatch.setattr(evaluate, "use_for_generation",
                        lambda model, decode_step: {"attention": "sdpa", "decode_step": decode_step})
    monkeypatch.setattr(evaluate, "read_mgsm", lambda path, lang, limit: [{"question": "2+5?", "answer": 7.0}] * limit)
    monkeypatch.setattr(evaluate, "generate",
                        lambda model, tokenizer, conversations, *args, **kwargs: ["7"] * len(conversations))
    monkeypatch.setattr(evaluate, "detect_language", lambda text: "en")
    model = SimpleNamespace(config=SimpleNamespace(_attn_implementation="eager"))
    questions = [{"messages": [{"role": "user", "content": "2+5?"}], "user_language": "en", "answer": 7,
                  "reasoning_language": "English"}] * 3
    # rows asked as they ask: a text answer, a tool call, tools offered and answered without a call
    answer = {"messages": [{"role": "user", "content": "2+5?"}, {"role": "assistant", "content": "7"}]}
    call = {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    calls = {"messages": [{"role": "user", "content": "Weather?"},
                          {"role": "assistant", "content": None, "tool_calls": [call]}], "tools": [{"name": "x"}]}
    questions += [answer, calls, {**answer, "tools": [{"name": "x"}]}]
    metrics, _, _ = evaluate.evaluate(model, None, ev, [], questions)
    assert sorted(flat_keys(metrics)) == sorted(written(ev))


def test_compliance_is_not_applicable_where_no_row_asks_for_a_reasoning_language(monkeypatch):
    """Rows of other data are asked once each, as they ask; compliance is marked not applicable rather than 0."""
    with patch.dict(os.environ):
        from stages import evaluate
    ev = Eval.model_validate(yaml.safe_load((ROOT / "params.yaml").read_text())["eval"])
    asked = []
    monkeypatch.setattr(evaluate, "heldout_loss", lambda *args, **kwargs: loss_figures(1.0, 4))
    monkeypatch.setattr(evaluate, "use_for_loss", lambda model: {"attention": "sdpa"})
    monkeypatch.setattr(evaluate, "use_for_generation",
                        lambda model, decode_step: {"attention": "sdpa", "decode_step": decode_step})
    monkeypatch.setattr(evaluate, "generate", lambda model, tok, conversations, *args, **kwargs:
                        asked.extend(conversations) or ["4"] * len(conversations))
    monkeypatch.setattr(evaluate, "detect_language", lambda text: "en")
    rows = [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"{i}+2?"},
                          {"role": "assistant", "content": "4"}]} for i in range(3)]
    metrics, records, _ = evaluate.evaluate(SimpleNamespace(), None, ev, [], rows)
    assert metrics["compliance"] == NOT_APPLICABLE and "final_language_rate" not in metrics
    assert [r["question"] for r in records if r["set"] == "heldout"] == ["0+2?", "1+2?", "2+2?"]
    assert asked[0] == [{"role": "system", "content": "be brief", "thinking": None},
                        {"role": "user", "content": "0+2?", "thinking": None}]
