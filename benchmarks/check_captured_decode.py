"""The captured decode step (eval.decode_step: captured) on a GPU: its tokens against the same step run eagerly and
against transformers' generate, and its ms per decode step against generate's eager and cudagraphs steps.

    python benchmarks/check_captured_decode.py <model folder> --batch 221 --new-tokens 256 --out bench/generation.jsonl
The model loads in bfloat16 with the attention evaluation decodes with (use_for_generation); the prompts are the
built-in questions as the evaluate stage asks them, left-padded into one batch. Every variant runs every row to
--new-tokens (the end of sequence turned off), so that their tokens compare one for one: `captured` twice (the first
call runs the warm-up step and records the graph), `captured, not recorded` (the same step, eagerly), and generate with
its eager step on a dynamic cache, its eager step on a static cache, and its `cudagraphs` step (twice: the first
compiles). One JSON line per call: seconds, ms per decode step, new tokens/s, peak GiB, and the share of tokens and
rows equal to the first captured call's.
"""
import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from lora_pipeline.data import builtin as builtin_data
from lora_pipeline.evaluate.captured_decode import greedy_generate
from lora_pipeline.evaluate.generation import decode_step_options, use_for_generation
from lora_pipeline.model.loading import load_model, load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's modules, however this file is loaded
from bench_rows import emit  # noqa: E402
from generation_speed import conversations_of, device_name, peak_gib, reset_peak  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, default=221)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--label", default="", help="what the model is, for the rows")
    parser.add_argument("--out")
    args = parser.parse_args()
    params = SimpleNamespace(dtype="bfloat16", attn_implementation="sdpa", experts_implementation=None,
                             trust_remote_code=False)
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, params, device_map={"": "cuda"}).eval()
    chosen = use_for_generation(model, "captured")
    model.generation_config.eos_token_id = None  # every row runs the full length
    questions = [next(m["content"] for m in r["messages"] if m["role"] == "user")
                 for r in builtin_data.generate(max(400, args.batch), seed=1)]
    prompts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
               for c in conversations_of(questions, args.batch)]
    tokenizer.padding_side = "left"
    inputs = tokenizer(prompts, add_special_tokens=False, padding=True, return_tensors="pt").to("cuda")
    ids, mask, pad = inputs["input_ids"], inputs["attention_mask"], tokenizer.pad_token_id
    width = ids.shape[1]

    def generate(**options):
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False,
                              pad_token_id=pad, **options)[:, width:]

    variants = [("captured", lambda: greedy_generate(model, ids, mask, args.new_tokens, pad)),
                ("captured", lambda: greedy_generate(model, ids, mask, args.new_tokens, pad)),
                ("captured, not recorded", lambda: greedy_generate(model, ids, mask, args.new_tokens, pad,
                                                                   capture=False)),
                ("generate eager, dynamic cache", generate),
                ("generate eager, static cache", lambda: generate(cache_implementation="static")),
                ("generate cudagraphs", lambda: generate(**decode_step_options("cudagraphs"))),
                ("generate cudagraphs", lambda: generate(**decode_step_options("cudagraphs")))]
    first, calls = None, {}
    for name, run in variants:
        calls[name] = calls.get(name, 0) + 1
        reset_peak()
        torch.cuda.synchronize()
        started = time.perf_counter()
        new = run()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        first = new if first is None else first
        emit({"model": args.label or args.model, "check": "captured decode step", "decode_step": name,
              "call": calls[name], "batch": args.batch, "prompt_width": width, "new_tokens": new.numel(),
              "seconds": round(seconds, 2), "ms_per_step": round(1000 * seconds / new.shape[1], 1),
              "new_tokens_per_s": round(new.numel() / seconds, 1),
              "rows_equal_to_first": int((new == first).all(dim=1).sum()),
              "tokens_equal_to_first": round(float((new == first).float().mean()), 4),
              "attention": chosen["attention"], "peak_gib": peak_gib(), "device": device_name()}, args.out)


if __name__ == "__main__":
    main()
