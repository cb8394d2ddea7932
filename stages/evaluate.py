"""evaluate: held-out loss, reasoning-language compliance, answer accuracy (built-in set, MGSM) and the demo.

    python -m stages.evaluate
Evaluates models/merged and, with eval.include_base, models/base too (the "before" figures, under "base").
"""
import json
from pathlib import Path

import torch

from lora_pipeline.chat import conversation, prompt_messages, split_reasoning
from lora_pipeline.data import read_jsonl, write_jsonl
from lora_pipeline.languages import LANGUAGE_NAMES
from lora_pipeline.metrics import answer_correct, check_eval, detect_language, generate, heldout_loss, read_mgsm
from lora_pipeline.modeling import device, load_model, load_tokenizer
from lora_pipeline.outputs import write_json, write_text
from lora_pipeline.params import load_params
from lora_pipeline.report import plot_report, write_compliance

BASE, MERGED, TEST = Path("models/base"), Path("models/merged"), Path("data/split/test.jsonl")
METRICS, COMPLIANCE, LOSS_LOG = Path("metrics/eval.json"), Path("plots/compliance"), Path("plots/train_loss.csv")
REPORTS = Path("reports")
DEMO = [{"role": "system", "content": "reasoning language: German"},
        {"role": "user", "content": "¿Cuál es el capital de Australia?"}]

def user_question(row):
    return next(m["content"] for m in row["messages"] if m["role"] == "user")


def evaluate(model, tokenizer, ev, heldout: list, questions: list):
    """Every measure for one model (the `eval` params `ev`; held-out conversations for the loss, test rows to ask);
    returns (metrics, generation records)."""
    gen = dict(max_new_tokens=ev.max_new_tokens, batch_size=ev.batch_size, do_sample=ev.do_sample)
    metrics = {"test": heldout_loss(model, tokenizer, heldout, max_length=2048, batch_size=ev.batch_size)}

    # Each held-out question asked once per reasoning language.
    cases = [(row, lang) for row in questions for lang in ev.languages]
    outputs = generate(model, tokenizer, [prompt_messages(user_question(r), LANGUAGE_NAMES[lang], r.get("developer", ""))
                                          for r, lang in cases], **gen)
    records = []
    for (row, lang), text in zip(cases, outputs):
        reasoning, final = split_reasoning(text)
        record = {"set": "heldout", "reasoning_language": lang, "question": user_question(row), "generated": text,
                  "reasoning_detected": detect_language(reasoning), "final_detected": detect_language(final)}
        if "user_language" in row:
            record["user_language"] = row["user_language"]
        if "answer" in row:
            record["correct"] = answer_correct(final, row["answer"])
        records.append(record)
    compliance = {lang: sum(r["reasoning_detected"] == lang for r in records if r["reasoning_language"] == lang)
                  / len(questions) for lang in ev.languages}
    compliance["overall"] = sum(r["reasoning_detected"] == r["reasoning_language"] for r in records) / len(records)
    metrics["compliance"] = compliance
    with_user_lang = [r for r in records if "user_language" in r]
    if with_user_lang:
        metrics["final_language_rate"] = sum(r["final_detected"] == r["user_language"] for r in with_user_lang) / len(with_user_lang)
    with_answer = [r for r in records if "correct" in r]
    if with_answer:
        metrics["accuracy"] = {"builtin": sum(r["correct"] for r in with_answer) / len(with_answer)}

    if ev.mgsm.path:  # reasoning asked in the question's own language
        per_lang = {}
        for lang in ev.mgsm.languages:
            rows = read_mgsm(ev.mgsm.path, lang, ev.mgsm.limit)
            texts = generate(model, tokenizer, [prompt_messages(r["question"], LANGUAGE_NAMES[lang]) for r in rows], **gen)
            correct = [answer_correct(split_reasoning(t)[1], r["answer"]) for r, t in zip(rows, texts)]
            per_lang[lang] = sum(correct) / len(correct)
            records += [{"set": f"mgsm_{lang}", "question": r["question"], "answer": r["answer"], "generated": t,
                         "correct": c} for r, t, c in zip(rows, texts, correct)]
        per_lang["overall"] = sum(per_lang.values()) / len(per_lang)
        metrics.setdefault("accuracy", {})["mgsm"] = per_lang

    demo = generate(model, tokenizer, [DEMO], **gen)[0]
    metrics["demo_reasoning_is_german"] = int(detect_language(split_reasoning(demo)[0]) == "de")
    records.append({"set": "demo", "generated": demo})
    return metrics, records


def main():
    params = load_params("evaluate")
    ev = params.eval
    check_eval(ev)  # every input, before loading a model
    test_rows = read_jsonl(TEST)
    heldout = [conversation(r) for r in test_rows[: ev.loss_rows or None]]
    questions = [r for r in test_rows if any(m["role"] == "user" for m in r["messages"])][: ev.prompts]
    models = {"finetuned": MERGED} | ({"base": BASE} if ev.include_base else {})
    results, transcripts = {}, []
    for name, path in models.items():
        tokenizer = load_tokenizer(path, trust_remote_code=params.model.trust_remote_code)
        # The base as it was trained (quantization params); the merged model in full precision, as saved.
        model = load_model(path, params.model, params.quantization if name == "base" else None).to(device()).eval()
        torch.manual_seed(0)
        metrics, records = evaluate(model, tokenizer, ev, heldout, questions)
        results[name] = metrics
        for record in records:
            record["model"] = name
        transcripts += records
        del model

    metrics = results["finetuned"] | ({"base": results["base"]} if "base" in results else {})
    write_json(METRICS, metrics)
    write_compliance(results, COMPLIANCE)
    write_jsonl(transcripts, REPORTS / "generations.jsonl")
    demo_lines = []
    for record in (r for r in transcripts if r["set"] == "demo"):
        reasoning, final = split_reasoning(record["generated"])
        demo_lines += [f"== {record['model']} model ==", "system: reasoning language: German",
                       "user: ¿Cuál es el capital de Australia?", f"reasoning ({detect_language(reasoning)}): {reasoning}",
                       f"final ({detect_language(final)}): {final}", f"raw: {record['generated']}", ""]
    write_text(REPORTS / "demo.txt", "\n".join(demo_lines))
    plot_report(LOSS_LOG, results, REPORTS)
    print(json.dumps(metrics, indent=2))


if __name__ == "__main__":
    main()
