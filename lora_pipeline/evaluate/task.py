"""Each held-out answer of a row that asks no reasoning language against its row's reference: text and tool calls."""
from __future__ import annotations

import json
import re
import unicodedata
from collections import Counter

from lora_pipeline.model.chat import split_reasoning, uses_tools

# What the tiny ChatML tools template (and Qwen2.5's) writes for a call.
_QWEN_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
# What harmony (gpt-oss) writes for a call: the recipient, before or after the channel, then the arguments.
_HARMONY_CALL = re.compile(r"to=functions\.([^\s<]+)((?:(?!<\|message\|>).)*)<\|message\|>(.*?)"
                           r"(?=<\|call\|>|<\|end\|>|<\|return\|>|<\|start\|>|$)", re.S)


def asked_turn(messages: list[dict]) -> int:
    """Where a held-out row is asked: its first assistant turn that calls a tool (the decision to call is what a tool
    row teaches, and later turns answer from tool results the model never produced), else its last assistant turn."""
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return next((i for i in assistant if messages[i].get("tool_calls")), assistant[-1])


def reference(row: dict) -> dict:
    """The assistant turn a held-out row is asked up to: {"text": its content}, and {"calls": [{name, arguments}]}
    for a row that uses tools."""
    messages = row["messages"]
    turn = messages[asked_turn(messages)]
    answer = {"text": turn.get("content") or ""}
    if uses_tools([row]):
        answer["calls"] = [call_of(c) for c in turn.get("tool_calls") or []]
    return answer


def call_of(call: dict) -> dict:
    """{name, arguments} of a row's call (OpenAI's {function: {name, arguments}}), its arguments parsed."""
    function = call.get("function", call)
    return {"name": function.get("name"), "arguments": parsed_arguments(function.get("arguments", {}))}


def parsed_arguments(arguments):
    """JSON text parsed, a mapping as it is; None where the text is not JSON."""
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return None


def parse_tool_calls(generated: str) -> list[dict]:
    """The calls in a generated turn as {name, arguments} (arguments None where they are not JSON): Qwen2.5's
    `<tool_call>{"name": ..., "arguments": ...}</tool_call>` and harmony's `to=functions.NAME ... <|message|>ARGS`."""
    calls = []
    for body in _QWEN_CALL.findall(generated):
        call = parsed_arguments(body.strip())
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            calls.append({"name": call["name"], "arguments": parsed_arguments(call.get("arguments", {}))})
        else:
            calls.append({"name": None, "arguments": None})
    for name, _, arguments in _HARMONY_CALL.findall(generated):
        calls.append({"name": name, "arguments": parsed_arguments(arguments.strip())})
    return calls


def answer_text(generated: str) -> str:
    """The final answer of a generated turn, without its reasoning or its calls."""
    return _QWEN_CALL.sub("", split_reasoning(generated)[1]).strip()


def normalized(text: str) -> str:
    """What exact match compares: NFKC, case folded, every Unicode punctuation character (categories P*) removed,
    whitespace runs as one space, none at either end."""
    text = unicodedata.normalize("NFKC", text).casefold()
    return " ".join("".join(ch for ch in text if not unicodedata.category(ch).startswith("P")).split())


def _unspaced(ch: str) -> bool:
    """A character of a script written without spaces between words: Thai, Lao, Myanmar, Khmer, kana, Han."""
    code = ord(ch)
    return (0x0E00 <= code <= 0x0EFF or 0x1000 <= code <= 0x109F or 0x1780 <= code <= 0x17FF
            or 0x3040 <= code <= 0x30FF or 0x31F0 <= code <= 0x31FF or 0x3400 <= code <= 0x4DBF
            or 0x4E00 <= code <= 0x9FFF or 0xF900 <= code <= 0xFAFF or 0x20000 <= code <= 0x3134F)


class UnicodeWords:
    """ROUGE's tokenizer for any script (rouge-score's own keeps [a-z0-9] only, so other scripts score nothing): NFKC
    and case folded; a word is a run of letters, marks and digits; each character of a script written without spaces
    is a word of its own, with the marks that follow it. No stemming."""

    def tokenize(self, text: str) -> list[str]:
        words, in_word, after_letter = [], False, False
        for ch in unicodedata.normalize("NFKC", text).casefold():
            kind = unicodedata.category(ch)[0]
            if kind == "M" and after_letter:  # a vowel sign or accent belongs to the letter before it
                words[-1] += ch
            elif kind in "LN" and _unspaced(ch):
                words.append(ch)
                in_word, after_letter = False, True
            elif kind in "LN":
                if in_word:
                    words[-1] += ch
                else:
                    words.append(ch)
                in_word = after_letter = True
            else:
                in_word = after_letter = False
        return words


_rouge = None


def rouge_l(answer: str, reference_text: str) -> float:
    """ROUGE-L F1 of an answer against its reference (rouge-score, UnicodeWords tokens)."""
    global _rouge
    if _rouge is None:
        from rouge_score.rouge_scorer import RougeScorer

        _rouge = RougeScorer(["rougeL"], tokenizer=UnicodeWords())
    return _rouge.score(reference_text, answer)["rougeL"].fmeasure


def chrf(answers: list[str], references: list[str]) -> float:
    """sacrebleu's chrF (character 6-grams, beta 2, on its 0-100 scale) of the answers against their references, their
    character n-gram statistics summed over all of them; one answer: its sentence chrF."""
    from sacrebleu.metrics import CHRF

    return CHRF().corpus_score(answers, [references]).score


def score_answer(expected: dict, generated: str) -> dict:
    """A generated turn against its reference (reference()): for a text answer, the reference, the answer and its
    exact match, ROUGE-L F1 and chrF; for a row that uses tools, the reference's calls, the parsed calls and whether
    they are the reference's (right_call: the same names with equal parsed arguments; right_name: the same names),
    or, where the reference calls nothing, whether it called nothing (no_call). Nothing for a turn with neither."""
    scores, calls = {}, expected.get("calls")
    if not calls and expected["text"]:
        answer = answer_text(generated)
        scores |= {"reference": expected["text"], "answer": answer,
                   "exact_match": normalized(answer) == normalized(expected["text"]),
                   "rouge_l": rouge_l(answer, expected["text"]), "chrf": chrf([answer], [expected["text"]])}
    if calls is not None and (calls or expected["text"]):
        made = parse_tool_calls(generated)
        scores |= {"reference_calls": calls, "calls": made}
        if calls:
            scores |= {"right_call": _multiset(made, canonical_call) == _multiset(calls, canonical_call),
                       "right_name": _multiset(made, lambda c: c["name"]) == _multiset(calls, lambda c: c["name"])}
        else:
            scores["no_call"] = not made
    return scores


def canonical_call(call: dict) -> str:
    return json.dumps([call["name"], call["arguments"]], sort_keys=True)


def _multiset(calls: list[dict], key) -> Counter:
    return Counter(key(c) for c in calls)


def task_figures(records: list[dict]) -> dict:
    """The figures of the text answers scored by score_answer: the share that match exactly, the mean ROUGE-L F1,
    the corpus chrF, and how many were scored."""
    scored = [r for r in records if "exact_match" in r]
    return {"exact_match": sum(r["exact_match"] for r in scored) / len(scored),
            "rouge_l": sum(r["rouge_l"] for r in scored) / len(scored),
            "chrf": chrf([r["answer"] for r in scored], [r["reference"] for r in scored]),
            "questions": len(scored)}


def tool_call_figures(records: list[dict]) -> dict:
    """The figures of the rows that use tools, scored by score_answer: of those whose reference calls, the share
    called right (right_call) and by the right names (right_name); of the others, the share answered without a call
    (no_call_when_none); and how many of each there were. A share with no rows to count is left out."""
    calling = [r for r in records if r["reference_calls"]]
    answering = [r for r in records if not r["reference_calls"]]
    figures = {"questions": len(records), "calls_expected": len(calling), "answers_expected": len(answering)}
    if calling:
        figures["right_call"] = sum(r["right_call"] for r in calling) / len(calling)
        figures["right_name"] = sum(r["right_name"] for r in calling) / len(calling)
    if answering:
        figures["no_call_when_none"] = sum(r["no_call"] for r in answering) / len(answering)
    return figures


def row_yields(row: dict) -> set[str]:
    """Which figures (by the names of evaluate.figures.ROW_NEEDS) a held-out row that asks no reasoning language yields:
    "text" (its reference answers in text, without a call), "call" (it calls a tool), "no_call" (it offers tools and
    answers without one)."""
    messages = row.get("messages") or []
    if not any(m["role"] == "user" for m in messages) or not any(m["role"] == "assistant" for m in messages):
        return set()
    expected = reference(row)
    if expected.get("calls"):
        return {"call"}
    if not expected["text"]:
        return set()
    return {"text", "no_call"} if "calls" in expected else {"text"}


NOTHING_SCORED = ("No held-out question is scored against its reference here: the held-out rows ask for a reasoning "
                  "language (compliance and accuracy in metrics/eval.json score them) or hold no question.\n")


def scored(records: list[dict]) -> list[dict]:
    """The generation records scored against a reference (score_answer), in the order asked."""
    return [r for r in records if r.get("set") == "heldout" and ("reference" in r or "reference_calls" in r)]


def task_report(finetuned: list[dict], base: list[dict], figures: dict, base_figures: dict,
                table_figures: list[tuple[str, str]]) -> str:
    """reports/task.md: each scored held-out question's prompt, its reference and each model's answer with its
    scores, after a table of both models' figures (`table_figures`: (dotted key in metrics/eval.json, label), from
    figures.report_figures); the base's column only where its questions are the same."""
    finetuned, base = scored(finetuned), scored(base)
    if not finetuned:
        return f"# Held-out answers against their references\n\n{NOTHING_SCORED}"
    models = [("fine-tuned", finetuned, figures)]
    if [r["question"] for r in base] == [r["question"] for r in finetuned]:
        models.insert(0, ("base", base, base_figures))
    lines = ["# Held-out answers against their references", "",
             "Each held-out question that asks no reasoning language, asked once up to the assistant turn its row "
             "answers (a row with tool calls: up to its first call), that turn as the reference, and each model's "
             "answer; how each figure is computed: docs/evaluation.md.", "",
             "| figure | " + " | ".join(name for name, _, _ in models) + " |",
             "|---|" + "---|" * len(models)]
    for key, label in table_figures:
        section, name = key.split(".")
        values = [f.get(section, {}).get(name) for _, _, f in models]
        if any(v is not None for v in values):
            lines.append(f"| {label} | " + " | ".join("-" if v is None else f"{v:.3g}" for v in values) + " |")
    for number, records in enumerate(zip(*(r for _, r, _ in models)), 1):
        first = records[0]
        lines += ["", f"## {number}", "", "asked:", "", fenced("\n".join(f"{m['role']}: {m['content']}"
                                                                       for m in first.get("prompt", []))),
                  "", "reference:", "", fenced(shown(first.get("reference", ""), first.get("reference_calls")))]
        for (name, _, _), record in zip(models, records):
            lines += ["", f"{name} ({verdict(record)}):", "", fenced(shown(record.get("answer", ""),
                                                                          record.get("calls")))]
    return "\n".join(lines) + "\n"


def prompt_shown(messages: list[dict]) -> list[dict]:
    """The messages a question was asked with, as its generation record keeps them: role and content, a call turn's
    content its calls as shown()."""
    return [{"role": m["role"],
             "content": shown(m.get("content") or "", [call_of(c) for c in m.get("tool_calls") or []])}
            for m in messages]


def shown(text: str, calls: list[dict] | None) -> str:
    """An answer as task.md shows it: its text, then each call as name(arguments as JSON)."""
    parts = [text] if text else []
    parts += [f"{c['name']}({json.dumps(c['arguments'], ensure_ascii=False)})" for c in calls or []]
    return "\n".join(parts)


def verdict(record: dict) -> str:
    """An answer's scores in words."""
    parts = []
    if "exact_match" in record:
        parts.append(f"exact match {'yes' if record['exact_match'] else 'no'}, ROUGE-L F1 {record['rouge_l']:.3g}, "
                     f"chrF {record['chrf']:.3g}")
    if "right_call" in record:
        parts.append("right call" if record["right_call"] else "no call" if not record["calls"] else
                     "right function, other arguments" if record["right_name"] else "wrong call")
    if "no_call" in record:
        parts.append("no call" if record["no_call"] else "called a tool")
    return "; ".join(parts)


def fenced(text: str) -> str:
    """Text in a Markdown code fence longer than any run of backticks in it."""
    fence = "`" * max(3, 1 + max((len(run) for run in re.findall("`+", text)), default=0))
    return f"{fence}text\n{text}\n{fence}"
