"""The captured decode step (eval.decode_step: captured) on a GPU: its tokens against the same step run eagerly and
against transformers' generate, and its ms per decode step against generate's eager and cudagraphs steps.

    python benchmarks/check_captured_decode.py <model folder> --batch 221 --new-tokens 256 --out bench/generation.jsonl
The model loads in bfloat16 with the attention evaluation decodes with (use_for_generation); the prompts are the
built-in questions as the evaluate stage asks them, left-padded into one batch. Every variant runs every row to
--new-tokens (the end of sequence turned off), so that their tokens compare one for one: `captured` twice (the first
call runs the warm-up step and records the graph), `captured, unfused decode attention` (gpt-oss: each step's
attention in sink_attention.attend's matmuls and softmax, not attend_fused), `captured, whole cache read` (one graph
whose full-attention layers read the whole cache, not READ_BLOCK blocks), `the prompts' pass alone` (one new token;
in PREFILL_GROUPS groups of rows, and in one), `captured, not recorded` (the same step, eagerly), and generate with
its eager step on a dynamic cache, its eager step on a static cache, and its `cudagraphs` step (twice: the first
compiles). One JSON line per call: seconds, ms per decode step, new tokens/s, peak GiB, and the share of tokens and
rows equal to the first captured call's. `--variants` keeps some of them; `--profile-steps N` adds a line of the GPU
time a decode step's kernels take, by kernel: torch's profiler over the step run eagerly for 2 + N tokens, less the
same for 2 (the prompt's pass and the first step), over N.
gpt-oss: `--attention flex_attention --experts grouped_mm` (as the recipe loads it; evaluation decodes with
`grouped_sink_eager` and `grouped_mm_generate`).
"""
import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from lora_pipeline.data import builtin as builtin_data
from lora_pipeline.families.gpt_oss import sink_attention
from lora_pipeline.evaluate.captured_decode import greedy_generate
from lora_pipeline.evaluate.generation import decode_step_options, use_for_generation
from lora_pipeline.evaluate.window_cache import sliding_window
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
    parser.add_argument("--attention", default="sdpa")
    parser.add_argument("--experts", default=None)
    parser.add_argument("--variants", nargs="*", default=None,
                        help="some of: captured unfused whole prefill uncaptured eager static cudagraphs "
                        "(default: all)")
    parser.add_argument("--width", type=int, default=0, help="left-pad the prompts to this many tokens (a stage's "
                        "prompt width: its padded_prompt_tokens / prompts)")
    parser.add_argument("--profile-steps", type=int, default=0)
    parser.add_argument("--out")
    args = parser.parse_args()
    params = SimpleNamespace(dtype="bfloat16", attn_implementation=args.attention,
                             experts_implementation=args.experts, trust_remote_code=False)
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, params, device_map={"": "cuda"}).eval()
    chosen = use_for_generation(model, "captured")
    model.generation_config.eos_token_id = None  # every row runs the full length
    questions = [next(m["content"] for m in r["messages"] if m["role"] == "user")
                 for r in builtin_data.generate(max(400, args.batch), seed=1)]
    prompts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
               for c in conversations_of(questions, args.batch)]
    tokenizer.padding_side = "left"
    window = sliding_window(model.config) or 0  # the captured step's WindowCache needs prompts at least this wide
    inputs = tokenizer(prompts, add_special_tokens=False, padding="longest", return_tensors="pt")
    if inputs["input_ids"].shape[1] < max(window, args.width):
        inputs = tokenizer(prompts, add_special_tokens=False, padding="max_length", max_length=max(window, args.width),
                           return_tensors="pt")
    inputs = inputs.to("cuda")
    ids, mask, pad = inputs["input_ids"], inputs["attention_mask"], tokenizer.pad_token_id
    width = ids.shape[1]

    def generate(**options):
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False,
                              pad_token_id=pad, **options)[:, width:]

    variants = [("captured", "captured", lambda: greedy_generate(model, ids, mask, args.new_tokens, pad)),
                ("captured", "captured", lambda: greedy_generate(model, ids, mask, args.new_tokens, pad)),
                ("unfused", "captured, unfused decode attention",
                 lambda: unfused(model, ids, mask, args.new_tokens, pad)),
                ("whole", "captured, whole cache read",
                 lambda: greedy_generate(model, ids, mask, args.new_tokens, pad, read_block=width + args.new_tokens)),
                ("prefill", "the prompts' pass alone", lambda: greedy_generate(model, ids, mask, 1, pad)),
                ("prefill", "the prompts' pass alone, one group",
                 lambda: greedy_generate(model, ids, mask, 1, pad, prefill_groups=1)),
                ("uncaptured", "captured, not recorded",
                 lambda: greedy_generate(model, ids, mask, args.new_tokens, pad, capture=False)),
                ("eager", "generate eager, dynamic cache", generate),
                ("static", "generate eager, static cache", lambda: generate(cache_implementation="static")),
                ("cudagraphs", "generate cudagraphs", lambda: generate(**decode_step_options("cudagraphs"))),
                ("cudagraphs", "generate cudagraphs", lambda: generate(**decode_step_options("cudagraphs")))]
    variants = [(name, run) for key, name, run in variants if args.variants is None or key in args.variants]
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
              "rows_equal_to_first": int((new == first[:, :new.shape[1]]).all(dim=1).sum()),
              "tokens_equal_to_first": round(float((new == first[:, :new.shape[1]]).float().mean()), 4),
              "attention": chosen["attention"], "experts": chosen["experts"], "peak_gib": peak_gib(),
              "device": device_name()}, args.out)
    if args.profile_steps:
        short = kernel_ms(lambda: greedy_generate(model, ids, mask, 2, pad, capture=False))
        long = kernel_ms(lambda: greedy_generate(model, ids, mask, 2 + args.profile_steps, pad, capture=False))
        per_step = {name: (long[name] - short.get(name, 0.0)) / args.profile_steps for name in long}
        top = sorted(per_step.items(), key=lambda kv: -kv[1])[:12]
        emit({"model": args.label or args.model, "check": "captured decode step", "profile": "kernel ms a decode step",
              "batch": args.batch, "prompt_width": width, "steps": args.profile_steps,
              "kernel_ms_per_step": round(sum(per_step.values()), 2),
              "top_kernels_ms": [[name[:90], round(ms, 3)] for name, ms in top],
              "attention": chosen["attention"], "experts": chosen["experts"], "device": device_name()}, args.out)


def unfused(*args):
    """greedy_generate(*args) with gpt-oss's decode steps attending unfused (sink_attention.attend, not
    attend_fused)."""
    with sink_attention.fused_decode(False):
        return greedy_generate(*args)


def kernel_ms(run) -> dict[str, float]:
    """GPU milliseconds by kernel name over one call of `run`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as profiled:
        run()
        torch.cuda.synchronize()
    return {event.key: event.device_time_total / 1000 for event in profiled.key_averages()
            if event.device_time_total > 0}


if __name__ == "__main__":
    main()
