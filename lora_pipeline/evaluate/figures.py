"""The catalogue of the evaluation's figures (FIGURES): each one's key in metrics/eval.json, how it is computed, its
direction, what it needs, whether register.gate_metric may name it, and its column in `make exps`."""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from lora_pipeline.evaluate.task import UnicodeWords, answer_text, task_figures, tool_call_figures


@dataclass(frozen=True)
class Evaluated:
    """What one model's evaluation hands its figures: the eval languages, the held-out loss's figures
    (scoring.loss_figures), the generation records of the held-out questions (each that asks for a reasoning language
    asked once per language, any other once, scored against its reference by task.score_answer), whether each MGSM
    answer was right, per language, and the detected language of the demo's reasoning."""
    languages: list[str]
    loss: dict
    heldout: list[dict]
    mgsm: dict[str, list[bool]]
    demo_reasoning: str | None


@dataclass(frozen=True)
class Need:
    """What a figure needs to be written, in the words of the check that refuses a gate the data cannot yield."""
    name: str
    words: str


ANY = Need("any", "any held-out question")
REASONING = Need("reasoning", "rows that ask for a reasoning language")
# What a held-out row asked as it asks (no reasoning language) yields, by the names of evaluate.task.row_yields.
TEXT = Need("text", "a reference answered in text")
CALL = Need("call", "a tool call")
NO_CALL = Need("no_call", "tools offered and an answer without a call")
ROW_NEEDS = (TEXT, CALL, NO_CALL)
TOOLS = Need("tools", "a row that offers tools")  # the tool rows' counts, which never gate
MGSM = Need("mgsm", "MGSM files (eval.mgsm.path)")


@dataclass(frozen=True)
class Column:
    """A figure's column in `make exps` (cli/experiments.py): its header, its words in the legend, and whether every
    table shows it (a "-" where an experiment lacks it) or only one where an experiment has it."""
    header: str
    legend: str = ""
    always: bool = False


# The eval params a key's {placeholder} takes its values from.
PLACEHOLDERS = {"language": lambda ev: ev.languages, "mgsm_language": lambda ev: ev.mgsm.languages}


@dataclass(frozen=True)
class Figure:
    """One figure of metrics/eval.json. key: dotted, a {placeholder} of PLACEHOLDERS standing for each of its
    languages; computed: how, in words; computed_by: the computation that writes it (several figures may share one),
    which returns what it computes shaped as metrics/eval.json, {} where its rows are missing; higher_is_better: its
    direction as a gate, None where neither more nor less is better (a count, a length); needs: what it is written
    from; may_gate: whether register.gate_metric may name it; column: its column in `make exps`, if any; report: its
    label in reports/task.md's table of the answers scored against their references, if it is there."""
    key: str
    computed: str
    computed_by: Callable[[Evaluated], dict]
    higher_is_better: bool | None
    needs: Need
    may_gate: bool
    column: Column | None = None
    report: str | None = None

    @property
    def placeholder(self) -> str | None:
        found = re.search(r"\{(\w+)\}", self.key)
        return found.group(1) if found else None

    def keys(self, ev) -> list[str]:
        """Its keys with these eval params: a pattern's, one per language its placeholder takes."""
        if self.placeholder is None:
            return [self.key]
        return [self.key.replace(f"{{{self.placeholder}}}", value) for value in PLACEHOLDERS[self.placeholder](ev)]

    def value_in(self, key: str) -> str | None:
        """The placeholder's value in `key` if `key` is one of this pattern's keys, else None."""
        if self.placeholder is None:
            return None
        before, after = self.key.split(f"{{{self.placeholder}}}")
        found = re.fullmatch(re.escape(before) + r"([^.]+)" + re.escape(after), key)
        return found.group(1) if found else None


# The compliance figures of data whose rows ask for no reasoning language: not measured, rather than 0.
NOT_APPLICABLE = "not applicable: no held-out row asks for a reasoning language"


def held_out_loss(evaluated: Evaluated) -> dict:
    return {"test": evaluated.loss}


def compliance(evaluated: Evaluated) -> dict:
    """Per language and overall, the share of the questions asked with that reasoning language whose reasoning is
    identified as it; NOT_APPLICABLE where no held-out row asks for one."""
    asked = [r for r in evaluated.heldout if "reasoning_language" in r]
    if not asked:
        return {"compliance": NOT_APPLICABLE}
    questions = len(asked) // len(evaluated.languages)
    shares = {lang: sum(r["reasoning_detected"] == lang for r in asked if r["reasoning_language"] == lang) / questions
              for lang in evaluated.languages}
    shares["overall"] = sum(r["reasoning_detected"] == r["reasoning_language"] for r in asked) / len(asked)
    return {"compliance": shares}


def final_language_rate(evaluated: Evaluated) -> dict:
    rows = [r for r in evaluated.heldout if "user_language" in r]
    return {"final_language_rate": sum(r["final_detected"] == r["user_language"] for r in rows) / len(rows)} \
        if rows else {}


def builtin_accuracy(evaluated: Evaluated) -> dict:
    rows = [r for r in evaluated.heldout if "correct" in r]
    return {"accuracy": {"builtin": sum(r["correct"] for r in rows) / len(rows)}} if rows else {}


def mgsm_accuracy(evaluated: Evaluated) -> dict:
    if not evaluated.mgsm:
        return {}
    per_lang = {lang: sum(correct) / len(correct) for lang, correct in evaluated.mgsm.items()}
    per_lang["overall"] = sum(per_lang.values()) / len(per_lang)
    return {"accuracy": {"mgsm": per_lang}}


def text_answers(evaluated: Evaluated) -> dict:
    return {"task": task_figures(evaluated.heldout)} if any("exact_match" in r for r in evaluated.heldout) else {}


def tool_calls(evaluated: Evaluated) -> dict:
    rows = [r for r in evaluated.heldout if "reference_calls" in r]
    return {"tool_call": tool_call_figures(rows)} if rows else {}


def answer_words(evaluated: Evaluated) -> dict:
    """The mean length of the final answers to the held-out questions (reasoning and calls left out), in words as
    ROUGE-L counts them (task.UnicodeWords: each character of a script written without spaces a word)."""
    if not evaluated.heldout:
        return {}
    tokenizer = UnicodeWords()
    words = [len(tokenizer.tokenize(answer_text(r["generated"]))) for r in evaluated.heldout]
    return {"answer_words": sum(words) / len(words)}


def demo(evaluated: Evaluated) -> dict:
    return {"demo_reasoning_is_german": int(evaluated.demo_reasoning == "de")}


# Every figure evaluate writes, for the fine-tuned model and the base alike. The columns of `make exps` come in this
# order (after them, merge's); a figure without one is anywhere. Each: key, how it is computed, its computation,
# higher is better, what it needs, may gate, column, label in reports/task.md.
FIGURES = (
    Figure("test.loss", "mean cross-entropy over the held-out rows' assistant tokens (evaluate.heldout)",
           held_out_loss, False, ANY, True, Column("loss", "held-out loss", always=True)),
    Figure("compliance.overall", "share of all questions asked with a reasoning language whose reasoning py3langid "
           "identifies as it", compliance, True, REASONING, True,
           Column("comp", "reasoning in the asked language (overall, then per language)", always=True)),
    Figure("compliance.{language}", "the same share of the questions asked with that language", compliance, True,
           REASONING, True, Column("{language}")),
    Figure("final_language_rate", "share of final answers in the question's language, of rows that name it",
           final_language_rate, True, REASONING, True,
           Column("final", "final answer in the question's language", always=True)),
    Figure("accuracy.mgsm.overall", "mean over the MGSM languages of their accuracy", mgsm_accuracy, True, MGSM,
           True, Column("mgsm", "MGSM accuracy", always=True)),
    Figure("task.exact_match", "share of text answers equal to their reference once normalised (task.normalized)",
           text_answers, True, TEXT, True, Column("match", "exact match of the held-out answers (normalised)"),
           "exact match (share)"),
    Figure("task.rouge_l", "mean ROUGE-L F1 of the text answers against their references (task.rouge_l)",
           text_answers, True, TEXT, True, Column("rougeL", "their mean ROUGE-L F1"), "ROUGE-L F1 (mean)"),
    Figure("task.chrf", "sacrebleu's corpus chrF (0-100) of the text answers against their references", text_answers,
           True, TEXT, True, Column("chrF", "their corpus chrF (0-100)"), "chrF (corpus, 0-100)"),
    Figure("tool_call.right_call", "share of rows whose reference calls answered with its calls (names and parsed "
           "arguments)", tool_calls, True, CALL, True, Column("call", "tool calls right (name and arguments)"),
           "right call (share)"),
    Figure("tool_call.no_call_when_none", "share of rows that offer tools and whose reference answers without a "
           "call answered without one", tool_calls, True, NO_CALL, True,
           Column("nocall", "answered without a call where the reference does"), "no call where none is due (share)"),
    Figure("answer_words", "mean words of the final answers to the held-out questions (task.UnicodeWords)",
           answer_words, None, ANY, False, Column("words", "mean words of the held-out answers")),
    Figure("test.perplexity", "exp of the held-out loss", held_out_loss, False, ANY, True),
    Figure("test.tokens", "how many held-out tokens the loss averages over", held_out_loss, None, ANY, False),
    Figure("accuracy.builtin", "share of the built-in rows' final answers whose last number is the answer",
           builtin_accuracy, True, REASONING, True),
    Figure("accuracy.mgsm.{mgsm_language}", "share of a language's MGSM answers whose last number is the answer",
           mgsm_accuracy, True, MGSM, True),
    Figure("task.questions", "how many text answers were scored", text_answers, None, TEXT, False),
    Figure("tool_call.right_name", "share of rows whose reference calls answered with calls of its function names",
           tool_calls, True, CALL, True, report="right function name (share)"),
    Figure("tool_call.questions", "how many rows use tools", tool_calls, None, TOOLS, False),
    Figure("tool_call.calls_expected", "how many of them have a reference that calls", tool_calls, None, TOOLS,
           False),
    Figure("tool_call.answers_expected", "how many of them have a reference that answers without a call", tool_calls,
           None, TOOLS, False),
    Figure("demo_reasoning_is_german", "1 if the demo's reasoning, asked for in German, is identified as German",
           demo, True, ANY, False),
)


def figure_of(key: str) -> Figure | None:
    """The figure a key of metrics/eval.json (without eval.) is: one named exactly, else a pattern's."""
    return next((f for f in FIGURES if f.key == key), None) or next(
        (f for f in FIGURES if f.value_in(key) is not None), None)


def written(ev) -> dict[str, Figure]:
    """{key: its figure} of every figure evaluate may write with these eval params (MGSM's only where eval.mgsm.path
    is set), whatever rows the data holds."""
    return {key: figure for figure in FIGURES if figure.needs is not MGSM or ev.mgsm.path for key in figure.keys(ev)}


def computations() -> list[Callable[[Evaluated], dict]]:
    """The figures' computations, each once, in the catalogue's order."""
    return list(dict.fromkeys(figure.computed_by for figure in FIGURES))


def report_figures() -> list[tuple[str, str]]:
    """(key, label) of the figures reports/task.md's table shows, in the catalogue's order."""
    return [(figure.key, figure.report) for figure in FIGURES if figure.report]
