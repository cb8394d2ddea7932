"""evaluate and evaluate_base: held-out loss, reasoning-language compliance, answer accuracy (built-in set, MGSM), the
held-out answers against their references (text and tool calls) and the demo, for one model.

    accelerate launch --config_file configs/accelerate/<eval.accelerate_config>.yaml -m stages.evaluate [base]
finetuned (the default; dvc stage evaluate): models/merged -> metrics/eval.json, with the base's figures from
metrics/eval_base.json under "base", the demo, reports/task.md (the references beside both models' answers) and the
report. base (dvc stage evaluate_base): models/base as it is trained (the quantization params) ->
metrics/eval_base.json; it runs again only when the base or the eval params change, not for every new adapter.
Several processes split the batches; rank 0 writes.
"""
import json
import sys
import time
from pathlib import Path

import psutil
import torch

from lora_pipeline.config.outputs import METRICS, read_jsonl, write_json, write_jsonl, write_text
from lora_pipeline.config.params import LANGUAGE_NAMES, load_params
from lora_pipeline.evaluate.eval_checks import check_eval
from lora_pipeline.evaluate.figures import report_figures
from lora_pipeline.evaluate.generation import generate, use_for_generation
from lora_pipeline.evaluate.heldout import heldout_loss, use_for_loss
from lora_pipeline.evaluate.report import plot_report, write_compliance
from lora_pipeline.evaluate.scoring import (answer_correct, asks_reasoning_language, detect_language, eval_figures,
                                            read_mgsm)
from lora_pipeline.evaluate.task import asked_turn, prompt_shown, reference, score_answer, task_report
from lora_pipeline.launch.distributed import launch_state, process_group
from lora_pipeline.launch.stage_launch import seconds_since_launch
from lora_pipeline.model.chat import conversation, prompt_messages, split_reasoning
from lora_pipeline.model.loading import load_model, load_tokenizer

TEST, LOSS_LOG, REPORTS = Path("data/split/test.jsonl"), Path("plots/train_loss.csv"), Path("reports")
TASK_REPORT = REPORTS / "task.md"  # each held-out question's reference beside both models' answers
# What each model's evaluation reads and writes.
MODELS = {
    "finetuned": {"stage": "evaluate", "model": Path("models/merged"), "metrics": METRICS["eval"],
                  "generations": REPORTS / "generations.jsonl", "compliance": Path("plots/compliance/finetuned.csv"),
                  "speed": Path("logs/evaluate.json")},
    "base": {"stage": "evaluate_base", "model": Path("models/base"), "metrics": Path("metrics/eval_base.json"),
             "generations": REPORTS / "generations_base.jsonl", "compliance": Path("plots/compliance/base.csv"),
             "speed": Path("logs/evaluate_base.json")},
}
DEMO = [{"role": "system", "content": "reasoning language: German"},
        {"role": "user", "content": "¿Cuál es el capital de Australia?"}]


def user_question(row):
    return next(m["content"] for m in row["messages"] if m["role"] == "user")


def row_prompt(row) -> list[dict]:
    """A held-out row's conversation up to the assistant turn it is asked for (task.asked_turn: its first tool call,
    else its last assistant turn): what the row asks."""
    messages = conversation(row)
    return messages[:asked_turn(messages)]


def progress(line: str) -> None:
    """A line of where the stage is, from the first process only: its passes run for minutes on a large model."""
    if process_group()[0] == 0:
        print(f"evaluate: {line}", flush=True)


def evaluate(model, tokenizer, ev, heldout: list, questions: list):
    """Every measure for one model (the `eval` params `ev`; held-out conversations for the loss, test rows to ask);
    returns (metrics, generation records, {"timings", "implementations"} of what ran)."""
    started = time.perf_counter()
    implementations = {"loss": use_for_loss(model)}
    progress(f"held-out loss over {len(heldout)} rows ({implementations['loss']['attention']} attention)")
    loss = heldout_loss(model, tokenizer, heldout, max_length=2048, batch_size=ev.batch_size)
    timings = {"loss_seconds": time.perf_counter() - started}
    implementations["generation"] = use_for_generation(model, ev.decode_step)

    # Every prompt in one list, generated in length-sorted batches: each held-out question that asks for a reasoning
    # language once per reasoning language (any other once, as its row asks it), MGSM with reasoning asked in the
    # question's own language, and the demo.
    cases = [(row, lang) for row in questions for lang in (ev.languages if asks_reasoning_language(row) else [None])]
    mgsm = {lang: read_mgsm(ev.mgsm.path, lang, ev.mgsm.limit) for lang in ev.mgsm.languages} if ev.mgsm.path else {}
    conversations = [prompt_messages(user_question(r), LANGUAGE_NAMES[lang], r.get("developer", "")) if lang
                     else row_prompt(r) for r, lang in cases]
    conversations += [prompt_messages(r["question"], LANGUAGE_NAMES[lang]) for lang, rows in mgsm.items() for r in rows]
    conversations.append(DEMO)
    # Each prompt's function schemas for the chat template: a row asked as it asks keeps its own.
    tools = [(r.get("tools") or None) if lang is None else None for r, lang in cases]
    tools += [None] * (len(conversations) - len(tools))
    stats = {}
    chosen = implementations["generation"]
    progress(f"loss {loss['loss']:.4f} in {timings['loss_seconds']:.1f} s; generating answers to "
             f"{len(conversations)} prompts, up to {ev.max_new_tokens} new tokens each ({chosen['attention']} "
             f"attention, {chosen['decode_step']} decode step)")
    outputs = iter(generate(model, tokenizer, conversations, ev.max_new_tokens, ev.batch_size, ev.do_sample, stats,
                            chosen["decode_step"], tools=tools if any(tools) else None))
    timings["generation"] = stats | {"new_tokens_per_s": stats.get("new_tokens", 0) / max(stats.get("seconds", 0), 1e-9),
                                     "ms_per_step": 1000 * stats.get("seconds", 0) / max(stats.get("decode_steps", 0), 1)}

    records = []
    for (row, lang), text, asked in zip(cases, outputs, conversations):
        if lang is None:  # asked as the row asks it: scored against the row's own answer
            records.append({"set": "heldout", "question": user_question(row), "generated": text}
                           | score_answer(reference(row), text) | {"prompt": prompt_shown(asked)})
            continue
        reasoning, final = split_reasoning(text)
        record = {"set": "heldout", "reasoning_language": lang, "question": user_question(row), "generated": text,
                  "reasoning_detected": detect_language(reasoning), "final_detected": detect_language(final)}
        if "user_language" in row:
            record["user_language"] = row["user_language"]
        if "answer" in row:
            record["correct"] = answer_correct(final, row["answer"])
        records.append(record)
    heldout_records, mgsm_correct = list(records), {}
    for lang, rows in mgsm.items():
        texts = [next(outputs) for _ in rows]
        mgsm_correct[lang] = [answer_correct(split_reasoning(t)[1], r["answer"]) for r, t in zip(rows, texts)]
        records += [{"set": f"mgsm_{lang}", "question": r["question"], "answer": r["answer"], "generated": t,
                     "correct": c} for r, t, c in zip(rows, texts, mgsm_correct[lang])]

    demo = next(outputs)
    metrics = eval_figures(ev.languages, loss, heldout_records, mgsm_correct, detect_language(split_reasoning(demo)[0]))
    records.append({"set": "demo", "generated": demo})
    return metrics, records, {"timings": timings, "implementations": implementations}


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "finetuned"
    if name not in MODELS:
        raise SystemExit(f"usage: python -m stages.evaluate [base]; got {name!r}")
    paths = MODELS[name]
    params = load_params(paths["stage"])
    ev = params.eval
    check_eval(ev)  # every input, before loading a model
    process_started = psutil.Process().create_time()
    # the launcher's and this interpreter's start, the imports: as train and merge record it
    metrics, records, speed = {}, [], {"startup_seconds": seconds_since_launch()}
    state = launch_state()  # under accelerate launch with several processes: joins their group
    device = state.device if state.device.type == "cuda" else torch.device("cpu")
    if name == "finetuned" or ev.include_base:
        test_rows = read_jsonl(TEST)
        heldout = [conversation(r) if "messages" in r else r["text"] for r in test_rows[: ev.loss_rows or None]]
        questions = [r for r in test_rows if any(m["role"] == "user" for m in r.get("messages", []))][: ev.prompts]
        started = time.perf_counter()
        tokenizer = load_tokenizer(paths["model"], trust_remote_code=params.model.trust_remote_code)
        # The base as it was trained (quantization params); the merged model in full precision, as saved.
        quantization = params.quantization if name == "base" else None
        model = load_model(paths["model"], params.model, quantization, device_map={"": device}).eval()
        speed["load_seconds"] = time.perf_counter() - started
        torch.manual_seed(0)
        metrics, records, ran = evaluate(model, tokenizer, ev, heldout, questions)
        speed |= ran
        for record in records:
            record["model"] = name
    if state.process_index != 0:
        return
    speed |= {"model": name, "processes": state.num_processes, "device": str(device),
              "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0,
              "process_seconds": time.time() - process_started}
    write_json(paths["speed"], speed)
    write_compliance(metrics.get("compliance", {}), paths["compliance"])
    write_jsonl(records, paths["generations"])
    if name == "base":
        write_json(paths["metrics"], metrics)  # {} with eval.include_base false
        print(json.dumps({"metrics": metrics, "speed": speed}, indent=2))
        return

    base = json.loads(MODELS["base"]["metrics"].read_text())
    write_json(paths["metrics"], metrics | ({"base": base} if base else {}))
    base_records = read_jsonl(MODELS["base"]["generations"])
    write_text(TASK_REPORT, task_report(records, base_records, metrics, base, report_figures()))
    transcripts = records + base_records
    demo_lines = []
    for record in (r for r in transcripts if r["set"] == "demo"):
        reasoning, final = split_reasoning(record["generated"])
        demo_lines += [f"== {record['model']} model ==", "system: reasoning language: German",
                       "user: ¿Cuál es el capital de Australia?", f"reasoning ({detect_language(reasoning)}): {reasoning}",
                       f"final ({detect_language(final)}): {final}", f"raw: {record['generated']}", ""]
    write_text(REPORTS / "demo.txt", "\n".join(demo_lines))
    plot_report(LOSS_LOG, {"finetuned": metrics} | ({"base": base} if base else {}), REPORTS)
    print(json.dumps({"metrics": metrics, "speed": speed}, indent=2))


if __name__ == "__main__":
    main()
