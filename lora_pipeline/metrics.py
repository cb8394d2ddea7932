"""Evaluation measures: held-out loss, language identification, answer extraction, MGSM loading, and the figures
evaluate writes from them (the checks of the eval and register params: lora_pipeline.eval_checks)."""
from __future__ import annotations

import csv
import math
import re
from pathlib import Path

import torch

from lora_pipeline.distributed import gather, process_group

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


def assistant_mask(tokenizer, messages: list[dict], max_length: int) -> tuple[list[int], list[int]]:
    """Token ids of a conversation and a 0/1 mask of its assistant tokens (all ones if the template has no
    {% generation %} markers, as the real models' templates often do not)."""
    encoded = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
    ids = list(encoded["input_ids"])[:max_length]
    mask = list(encoded.get("assistant_masks") or [])[:max_length]
    if not any(mask):
        mask = [1] * len(ids)
    return ids, mask


# Logits held at once while computing the held-out loss (rows x positions x vocabulary): a 201k vocabulary makes a
# whole batch of 2,048-token rows tens of GiB in float32.
LOGITS_AT_ONCE = 2**28


@torch.no_grad()
def heldout_loss(model, tokenizer, conversations: list[list[dict]], max_length: int, batch_size: int) -> dict:
    """Mean next-token loss over the assistant tokens of held-out conversations, and its perplexity. The LM head runs
    on as many rows at a time as LOGITS_AT_ONCE allows; in a launch of several processes each takes every n-th batch
    and the sums are added in batch order, as one process adds them."""
    rank, world = process_group()
    encoded = [assistant_mask(tokenizer, c, max_length) for c in conversations]
    sums = []
    for start in list(range(0, len(encoded), batch_size))[rank::world]:
        chunk = encoded[start:start + batch_size]
        width = max(len(ids) for ids, _ in chunk)
        pad = tokenizer.pad_token_id
        ids = torch.tensor([i + [pad] * (width - len(i)) for i, _ in chunk], device=model.device)
        attention = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in chunk], device=model.device)
        labels_mask = torch.tensor([m + [0] * (width - len(m)) for _, m in chunk], device=model.device)
        hidden = model.get_decoder()(input_ids=ids, attention_mask=attention).last_hidden_state
        keep = labels_mask[:, 1:].bool() & attention[:, 1:].bool()
        rows_at_once = max(1, LOGITS_AT_ONCE // (width * model.config.vocab_size))
        total, count = 0.0, 0
        for row in range(0, len(chunk), rows_at_once):
            rows = slice(row, row + rows_at_once)
            logits = model.get_output_embeddings()(hidden[rows]).float()
            losses = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[rows, 1:],
                                                       reduction="none")
            total += losses[keep[rows]].sum().item()
            count += keep[rows].sum().item()
        sums.append((start, total, count))
    total, count = 0.0, 0
    for _, batch_total, batch_count in sorted(gather(sums)):
        total += batch_total
        count += batch_count
    return loss_figures(total, count)


def loss_figures(total: float, count: int) -> dict:
    """The held-out loss figures from the summed loss over `count` tokens."""
    loss = total / max(count, 1)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50)), "tokens": count}


def eval_figures(languages: list[str], loss: dict, heldout: list[dict], mgsm: dict[str, list[bool]],
                 demo_reasoning: str | None) -> dict:
    """One model's figures in metrics/eval.json, as evaluate writes them: from the held-out loss (loss_figures), the
    generation records of the held-out questions (each asked once per language of `languages`), whether each MGSM
    answer was right, per language, and the detected language of the demo's reasoning."""
    questions = len(heldout) // len(languages)
    compliance = {lang: sum(r["reasoning_detected"] == lang for r in heldout if r["reasoning_language"] == lang)
                  / questions for lang in languages}
    compliance["overall"] = sum(r["reasoning_detected"] == r["reasoning_language"] for r in heldout) / len(heldout)
    figures = {"test": loss, "compliance": compliance}
    with_user_lang = [r for r in heldout if "user_language" in r]
    if with_user_lang:
        figures["final_language_rate"] = (sum(r["final_detected"] == r["user_language"] for r in with_user_lang)
                                          / len(with_user_lang))
    with_answer = [r for r in heldout if "correct" in r]
    if with_answer:
        figures["accuracy"] = {"builtin": sum(r["correct"] for r in with_answer) / len(with_answer)}
    if mgsm:
        per_lang = {lang: sum(correct) / len(correct) for lang, correct in mgsm.items()}
        per_lang["overall"] = sum(per_lang.values()) / len(per_lang)
        figures.setdefault("accuracy", {})["mgsm"] = per_lang
    figures["demo_reasoning_is_german"] = int(demo_reasoning == "de")
    return figures
