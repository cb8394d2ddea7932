"""Generation speed of a model folder under each implementation and batch size, as the evaluate stage generates.

    python benchmarks/generation_speed.py <model folder> --attention flex_attention --experts grouped_mm \
        --variants eager:20 generate:20 generate:320 generate:320:cudagraphs --new-tokens 64 --out generation.jsonl
The model loads once with the implementations training uses (--attention, --experts, as model.* params), then each
variant `<experts>:<batch>[:<decode step>]` generates one batch of prompts from the built-in questions for
--new-tokens steps (every row runs the full length): `generate` is
lora_pipeline.evaluate.generation.use_for_generation's choice, `eager` the expert loop; the decode step is
eval.decode_step's (eager by default; cudagraphs and inductor compile, so those variants run --calls times, the first
with the compile). Prints one JSON line per call: ms per decode step, new tokens/s, peak GiB.
"""
import argparse
import json
import time
from types import SimpleNamespace

import torch

from lora_pipeline.config.params import LANGUAGE_NAMES
from lora_pipeline.data import builtin as builtin_data
from lora_pipeline.evaluate.generation import generate, use_for_generation
from lora_pipeline.model.chat import prompt_messages
from lora_pipeline.model.loading import experts_implementation, load_model, load_tokenizer, set_experts_implementation


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--attention", default="eager")
    parser.add_argument("--experts", default="eager")
    parser.add_argument("--variants", nargs="+", default=["generate:20", "generate:320"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--calls", type=int, default=2, help="calls of each compiled variant (the first compiles)")
    parser.add_argument("--out")
    args = parser.parse_args()
    params = SimpleNamespace(dtype="bfloat16", attn_implementation=args.attention,
                             experts_implementation=args.experts, trust_remote_code=False)
    started = time.perf_counter()
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, params, device_map={"": "cuda"}).eval()
    load_seconds = time.perf_counter() - started
    chosen = use_for_generation(model)
    rows = builtin_data.generate(400, seed=1)
    questions = [next(m["content"] for m in r["messages"] if m["role"] == "user") for r in rows]
    languages = list(LANGUAGE_NAMES)
    for variant in args.variants:
        experts, batch, *step = variant.split(":")
        decode_step = use_for_generation(model, step[0] if step else "eager")["decode_step"]
        if chosen["experts"]:
            set_experts_implementation(model, chosen["experts"] if experts == "generate" else experts)
        conversations = [prompt_messages(q, LANGUAGE_NAMES[languages[i % len(languages)]])
                         for i, q in enumerate(questions[: int(batch)])]
        if decode_step == "eager":
            generate(model, tokenizer, conversations[:2], 4, 2)  # warm-up (a compiled step compiles for its shape)
        for call in range(1, 1 + (args.calls if decode_step != "eager" else 1)):
            torch.cuda.reset_peak_memory_stats()
            stats = {}
            generate(model, tokenizer, conversations, args.new_tokens, int(batch), stats=stats,
                     decode_step=decode_step, min_new_tokens=args.new_tokens)
            result = {"model": args.model, "attention": chosen["attention"], "experts": experts_implementation(model),
                      "batch": int(batch), "decode_step": decode_step, "call": call,
                      "new_tokens": stats["new_tokens"], "decode_steps": stats["decode_steps"],
                      "seconds": round(stats["seconds"], 2),
                      "ms_per_step": round(1000 * stats["seconds"] / stats["decode_steps"], 1),
                      "new_tokens_per_s": round(stats["new_tokens"] / stats["seconds"], 1),
                      "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1),
                      "load_seconds": round(load_seconds, 1),
                      "device": torch.cuda.get_device_name()}
            print(json.dumps(result), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
