"""Tests of the built-in multilingual arithmetic reasoning data generator."""

import operator
import random
import re
from collections import Counter

import pytest

from helpers import LANGUAGE_CODES
from lora_pipeline.data import builtin as bd

ROW_KEYS = {"reasoning_language", "developer", "user", "analysis", "final", "answer", "user_language", "messages"}
EQUATION = re.compile(r"(\d+) ([+\-×÷]) (\d+) = (\d+)")
OPS = {"+": operator.add, "-": operator.sub, "×": operator.mul, "÷": operator.truediv}


@pytest.fixture(scope="module")
def rows():
    return bd.generate(1000, seed=0)


@pytest.fixture(scope="module")
def identifier():
    langid = pytest.importorskip("py3langid.langid")
    ident = langid.LanguageIdentifier.from_pickled_model(langid.MODEL_FILE, norm_probs=True)
    ident.set_languages(list(bd.LANGUAGES))
    return ident


def test_deterministic():
    assert bd.generate(200, seed=7) == bd.generate(200, seed=7)
    assert bd.generate(200, seed=7, languages=["de", "it"]) == bd.generate(200, seed=7, languages=["de", "it"])


def test_different_seed_gives_different_rows():
    a, b = bd.generate(50, seed=1), bd.generate(50, seed=2)
    assert a != b
    assert sum(x["user"] == y["user"] for x, y in zip(a, b)) < 5


def test_does_not_touch_global_rng():
    random.seed(123)
    expected = random.random()
    random.seed(123)
    bd.generate(100, seed=0)
    assert random.random() == expected


def test_row_count_and_prefix_stability():
    assert len(bd.generate(1, seed=0)) == 1
    assert bd.generate(10, seed=3) == bd.generate(30, seed=3)[:10]


def test_schema(rows):
    for row in rows:
        assert set(row) == ROW_KEYS
        assert row["reasoning_language"] in LANGUAGE_CODES
        assert row["user_language"] in bd.LANGUAGES
        assert row["developer"] in bd.DEVELOPER_PROMPTS
        assert isinstance(row["answer"], int) and row["answer"] >= 0
        msgs = row["messages"]
        assert [m["role"] for m in msgs] == ["system", "user", "assistant"]
        for m in msgs:
            assert set(m) == {"role", "content", "thinking"}
        system, user, assistant = msgs
        assert system["content"].startswith(f"reasoning language: {row['reasoning_language']}")
        assert system["content"] == f"reasoning language: {row['reasoning_language']}\n\n{row['developer']}"
        assert system["thinking"] is None and user["thinking"] is None
        assert user["content"] == row["user"]
        assert assistant["content"] == row["final"]
        assert assistant["thinking"] == row["analysis"]


def test_rows_form_one_arrow_schema(rows):
    pa = pytest.importorskip("pyarrow")
    table = pa.Table.from_pylist(rows)
    assert table.num_rows == len(rows)
    assert table.schema.field("answer").type == pa.int64()


def test_final_ends_with_answer(rows):
    for row in rows:
        numbers = re.findall(r"\d+", row["final"])
        assert numbers, row["final"]
        assert int(numbers[-1]) == row["answer"], row["final"]
        assert row["final"].rstrip().endswith(".")


def test_arithmetic_in_analysis_is_correct(rows):
    for row in rows:
        equations = EQUATION.findall(row["analysis"])
        assert equations, row["analysis"]
        for a, op, b, c in equations:
            assert OPS[op](int(a), int(b)) == int(c), (row["analysis"], a, op, b, c)
        assert int(equations[-1][3]) == row["answer"]


def test_numbers_are_small(rows):
    for row in rows:
        for a, _, b, c in EQUATION.findall(row["analysis"]):
            assert 2 <= int(a) <= 60 and 2 <= int(b) <= 60 and 0 <= int(c) <= 60


def test_analysis_is_in_reasoning_language(rows, identifier):
    hits = sum(identifier.classify(r["analysis"])[0] == LANGUAGE_CODES[r["reasoning_language"]] for r in rows)
    assert hits / len(rows) >= 0.97


def test_user_is_in_user_language(rows, identifier):
    hits = sum(identifier.classify(r["user"])[0] == r["user_language"] for r in rows)
    assert hits / len(rows) >= 0.97


def test_final_is_in_user_language(rows, identifier):
    # Finals are short single sentences, so a looser bound than for the question.
    hits = sum(identifier.classify(r["final"])[0] == r["user_language"] for r in rows)
    assert hits / len(rows) >= 0.8


def test_variety(rows):
    typed = bd._generate_typed(1000, seed=0)
    assert [row for _, row in typed] == rows
    assert len({kind for kind, _ in typed}) >= 6
    assert len({r["user"] for r in rows}) >= 500
    assert {LANGUAGE_CODES[r["reasoning_language"]] for r in rows} == set(bd.LANGUAGES)
    assert {r["user_language"] for r in rows} == set(bd.LANGUAGES)
    assert sum(LANGUAGE_CODES[r["reasoning_language"]] != r["user_language"] for r in rows) >= 600
    assert len({r["developer"] for r in rows}) >= 3


def test_vocabulary_sizes():
    assert len(bd.PROBLEM_TYPES) >= 6
    assert len({name for name, _ in bd.NAMES}) >= 10
    assert len(bd.ITEMS) >= 8
    for item in bd.ITEMS:
        assert set(item) == set(bd.LANGUAGES)
        assert item["de"][0][0].isupper() and item["de"][1][0].isupper()


def test_languages_are_drawn_uniformly(rows):
    for counts in (Counter(r["user_language"] for r in rows), Counter(r["reasoning_language"] for r in rows)):
        assert min(counts.values()) >= 140  # 200 expected per language


def test_language_subset():
    got = bd.generate(100, seed=5, languages=["de"])
    assert {r["user_language"] for r in got} == {"de"}
    assert {r["reasoning_language"] for r in got} == {"German"}
    got = bd.generate(200, seed=5, languages=["es", "fr"])
    assert {r["user_language"] for r in got} == {"es", "fr"}
    assert {r["reasoning_language"] for r in got} == {"Spanish", "French"}


def test_golden_sentences():
    names = (("Anna", "f"), ("Marco", "m"))
    apples, books = bd.ITEMS[0], bd.ITEMS[2]
    box, friends = bd.CONTAINERS[0], bd.RECIPIENTS[0]
    add = {"a": 12, "b": 7, "c": 0, "s": 0, "r": 19}
    assert bd._render("add", "en", add, names, apples, box, friends) == (
        "Anna has 12 apples. She gets another 7 apples. How many apples does Anna have now?",
        "At the beginning Anna has 12 apples, and then she gets another 7 apples. To find the new total, "
        "we add the two amounts: 12 + 7 = 19. So Anna now has 19 apples.",
        "Anna now has 19 apples.",
    )
    user, _, final = bd._render("add", "de", add, names, apples, box, friends)
    assert user == "Anna hat 12 Äpfel. Sie bekommt noch 7 Äpfel dazu. Wie viele Äpfel hat Anna jetzt?"
    assert final == "Anna hat jetzt 19 Äpfel."
    user, _, _ = bd._render("add", "es", add, names, books, box, friends)
    assert user == "Anna tiene 12 libros. Recibe 7 libros más. ¿Cuántos libros tiene Anna ahora?"
    user, _, _ = bd._render("add", "it", add, names, apples, box, friends)
    assert user == "Anna ha 12 mele. Poi riceve altre 7 mele in regalo. Quante mele ha Anna adesso?"
    compare = {"a": 12, "b": 7, "c": 0, "s": 0, "r": 19}
    user, _, _ = bd._render("compare", "fr", compare, names[::-1], bd.ITEMS[6], box, friends)
    assert user == ("Marco a 12 oranges. Anna possède 7 oranges de plus que Marco. "
                    "Combien d'oranges Anna possède-t-elle ?")


def test_singular_for_one():
    nums = {"a": 3, "b": 2, "c": 0, "s": 0, "r": 1}
    _, _, final = bd._render("sub", "en", nums, (("Paul", "m"), ("Lea", "f")), bd.ITEMS[0], bd.CONTAINERS[0],
                             bd.RECIPIENTS[0])
    assert final == "Paul has 1 apple left."


@pytest.mark.parametrize("rows_arg", [0, -3])
def test_bad_rows(rows_arg):
    with pytest.raises(ValueError, match=re.escape(repr(rows_arg))):
        bd.generate(rows_arg, seed=0)


@pytest.mark.parametrize(
    "languages, bad", [(["de", "pt"], "'pt'"), (["German"], "'German'"), ([], "[]"), ("de", "'de'")]
)
def test_bad_languages(languages, bad):
    with pytest.raises(ValueError) as err:
        bd.generate(10, seed=0, languages=languages)
    assert bad in str(err.value)
    assert "en" in str(err.value) and "it" in str(err.value)


def test_language_tables_agree():
    assert set(bd.TEMPLATES) == set(bd.LANGUAGES)
    for templates in bd.TEMPLATES.values():
        assert set(templates) == set(bd.PROBLEM_TYPES)
