"""Scoring the evaluation: language identification, answer extraction, MGSM loading, the held-out loss's figures,
and the figures evaluate writes, assembled from the catalogue (lora_pipeline.evaluate.figures; the loss itself:
lora_pipeline.evaluate.heldout)."""
from __future__ import annotations

import csv
import math
import re
from pathlib import Path

from lora_pipeline.evaluate.figures import Evaluated, computations

_identifier = None


def detect_language(text: str) -> str | None:
    """ISO code of the text's language among the ~97 that py3langid knows (its model ships in the package)."""
    global _identifier
    if not text or not text.strip():
        return None
    if _identifier is None:
        from py3langid.langid import MODEL_FILE, LanguageIdentifier

        _identifier = LanguageIdentifier.from_pickled_model(MODEL_FILE, norm_probs=True)
    return _identifier.classify(text)[0]


_NUMBER = re.compile(r"-?\d+(?:[.,\u00a0\u202f ]\d{3})*(?:[.,]\d+)?")


def last_number(text: str) -> float | None:
    """The last number in a text, reading thousands separators of any locale (70.000, 70,000, 70 000)."""
    matches = _NUMBER.findall(text or "")
    if not matches:
        return None
    token = matches[-1]
    # A separator followed by exactly three digits groups thousands; any other is the decimal mark.
    token = re.sub(r"[.,\u00a0\u202f ](?=\d{3}(?:\D|$))", "", token).replace(",", ".")
    try:
        return float(token)
    except ValueError:
        return None


def answer_correct(final: str, answer) -> bool:
    number = last_number(final)
    return number is not None and math.isclose(number, float(answer), rel_tol=0, abs_tol=1e-6)


def mgsm_files(path: str | Path, languages: list[str]) -> dict[str, Path]:
    """mgsm_<lang>.tsv per language; raises naming the first missing file."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"eval.mgsm.path: {folder} is not a folder")
    files = {lang: folder / f"mgsm_{lang}.tsv" for lang in languages}
    for lang, file in files.items():
        if not file.is_file():
            raise FileNotFoundError(f"eval.mgsm.languages has '{lang}' but {file} does not exist")
    return files


def read_mgsm(path: str, lang: str, limit: int) -> list[dict]:
    """MGSM rows {question, answer}: from a folder of TSV files, or from the Hub (juletxara/mgsm) if path is 'hub'."""
    if path == "hub":
        import datasets

        rows = datasets.load_dataset("juletxara/mgsm", lang, split="test").to_list()[:limit]
        return [{"question": r["question"], "answer": float(r["answer_number"])} for r in rows]
    file = mgsm_files(path, [lang])[lang]
    with open(file, encoding="utf-8", newline="") as f:
        rows = [r for r in csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE) if r]
    for i, row in enumerate(rows[:limit]):
        if len(row) != 2:
            raise ValueError(f"{file} line {i + 1}: expected 'question<TAB>number', got {len(row)} fields")
    return [{"question": q, "answer": float(a.replace(",", ""))} for q, a in rows[:limit]]


def asks_reasoning_language(row: dict) -> bool:
    """Whether a row asks for a reasoning language (as the built-in rows and Multilingual-Thinking's do)."""
    return bool(row.get("reasoning_language")) or any(
        m["role"] in ("system", "developer") and (m.get("content") or "").lower().startswith("reasoning language:")
        for m in row.get("messages", []))


def loss_figures(total: float, count: int) -> dict:
    """The held-out loss figures from the summed loss over `count` tokens."""
    loss = total / max(count, 1)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50)), "tokens": count}


def eval_figures(languages: list[str], loss: dict, heldout: list[dict], mgsm: dict[str, list[bool]],
                 demo_reasoning: str | None) -> dict:
    """One model's figures in metrics/eval.json, as evaluate writes them: each computation of the catalogue
    (figures.FIGURES) run once on what the evaluation yields (figures.Evaluated: the held-out loss, the generation
    records of the held-out questions, whether each MGSM answer was right, the demo's reasoning language), their
    figures merged into one tree."""
    evaluated = Evaluated(languages, loss, heldout, mgsm, demo_reasoning)
    figures = {}
    for compute in computations():
        merge_into(figures, compute(evaluated))
    return figures


def merge_into(tree: dict, part: dict) -> None:
    """`part`'s figures into `tree`, a section two computations write (accuracy: built-in, MGSM) merged."""
    for key, value in part.items():
        if isinstance(value, dict):
            if not isinstance(tree.get(key), dict):
                tree[key] = {}
            merge_into(tree[key], value)
        else:
            tree[key] = value
