"""Answer extraction, language identification and MGSM reading, on real multilingual text."""
import json

import pytest

from conftest import MGSM
from lora_pipeline.metrics import answer_correct, detect_language, last_number, mgsm_files, read_mgsm

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

    from lora_pipeline.metrics import compare_logits

    reference = torch.tensor([[[1.0, -4.0], [2.0, 0.0]], [[100.0, 0.0], [0.5, 0.25]]])
    other = reference + torch.tensor([[[0.5, 0.0], [0.0, -1.0]], [[50.0, 0.0], [0.0, 0.5]]])
    mask = torch.tensor([[1, 1], [0, 1]])  # the padded position (|reference| 100, difference 50) does not count
    compared = compare_logits(reference, other, mask)
    assert compared["max_abs_logit_diff"] == 1.0
    assert compared["relative_logit_diff"] == 1.0 / 4.0
    assert compared["mean_abs_logit_diff"] == pytest.approx(2.0 / 6)
    assert compared["top1_agreement"] == pytest.approx(2 / 3)  # the last position's top token changes
