"""gpt-oss decoding into static caches, so that a compiled decode step does not specialise on a length, against the
shipped eager generate: a full-length static cache (the sliding-window layers as full-length static layers, the window
applied by the mask alone), and lora_pipeline.evaluate.window_cache.WindowCache (what evaluate decodes into when
eval.decode_step compiles: the window layers keep their token count out of the step).

    python benchmarks/full_static_cache.py <model folder> --batch 301 --new-tokens 512 \
        --steps eager-pad128 window-pad128 window-cudagraphs-pad128 --check-steps 4 --out static.jsonl
    python benchmarks/full_static_cache.py --tiny --new-tokens 24   (CPU: a tiny gpt-oss, window 16, 8 prompts)
Steps: eager (the shipped eager path), eager-halves (it, the rows in two batches: other GEMM shapes, the same
arithmetic, so its difference from eager is the model's rounding noise floor), static (the full-length static cache,
not compiled), cudagraphs and inductor (it, compiled by generate as eval.decode_step compiles; run --calls times, the
first compiles), window, window-cudagraphs and window-inductor (the same with WindowCache; pad the prompts to at
least the window, 128 tokens for gpt-oss-20b); <step>-pad<N> pads the prompts to a multiple of N instead of 64
(other shapes, the same arithmetic); cudagraphs-stock is cudagraphs under torch's own "cudagraphs" backend, which
copies every weight into the CUDA graph's memory each step; repeat-kv-<step> runs <step> with transformers' eager
attention (repeat_kv's copies of the cache) instead of what evaluate decodes with (sink_attention's). Prompts as
benchmarks/generation_speed.py builds them; greedy, every row runs --new-tokens. Each step first prints a logit
check against the first step: per generated step, among the rows whose tokens so far equal the first step's, the
largest and mean |logit difference| over the mean |logit| and the share of equal top-1 tokens; then its timing, and
how many of its rows and tokens equal the first step's. --layer-check: each decoder layer's attention and MLP outputs
in the prefill against the first step's (steps with its padding), to find where two ways of decoding first part.
"""
import argparse
import copy
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch._dynamo.utils import counters
from transformers import StaticCache

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]
from lora_pipeline.data import builtin as builtin_data  # noqa: E402
from lora_pipeline.evaluate.generation import decode_step_options, use_for_generation  # noqa: E402
from lora_pipeline.evaluate.window_cache import WindowCache  # noqa: E402
from lora_pipeline.model.loading import load_model, load_tokenizer  # noqa: E402
from bench_rows import emit  # noqa: E402  (this folder's)
from generation_speed import conversations_of  # noqa: E402  (the same prompts)


REPEAT_KV = "eager"  # transformers' gpt-oss eager attention: repeat_kv copies the KV cache once per query head


def full_static_cache(model, max_len):
    config = copy.deepcopy(model.config)
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    config.sliding_window = None
    return StaticCache(config=config, max_cache_len=max_len)


def base_step(how: str) -> str:
    """A step's name without its attention prefix and padding suffix: repeat-kv-window-cudagraphs-pad128 ->
    window-cudagraphs."""
    return how.removeprefix("repeat-kv-").split("-pad")[0]


def run(model, inputs, new_tokens, pad_id, how, **extra):
    if how.startswith("repeat-kv-"):  # the step after it, with transformers' eager attention
        chosen = model.config._attn_implementation
        model.set_attn_implementation(REPEAT_KV)
        try:
            return run(model, inputs, new_tokens, pad_id, how.removeprefix("repeat-kv-"), **extra)
        finally:
            model.set_attn_implementation(chosen)
    how = base_step(how)
    if how == "eager-halves":  # the same rows in two batches: other GEMM shapes, the same arithmetic
        half = inputs["input_ids"].shape[0] // 2
        parts = [run(model, {k: v[rows] for k, v in inputs.items()}, new_tokens, pad_id, "eager", **extra)
                 for rows in (slice(0, half), slice(half, None))]
        (first, _), (second, _) = parts
        seconds = sum(part[1] for part in parts)
        if extra.get("return_dict_in_generate"):  # the sequences and each step's logits, the halves' rows in order
            return SimpleNamespace(sequences=torch.cat([first.sequences, second.sequences]),
                                   logits=tuple(torch.cat(pair) for pair in zip(first.logits, second.logits))), seconds
        return torch.cat([first, second]), seconds
    options = {}
    if how != "eager":
        width = inputs["input_ids"].shape[1]
        if how.startswith("window"):  # what evaluate decodes into: window_cache.WindowCache
            options["cache"] = WindowCache(model.config, max_cache_len=width + new_tokens)
            step = how.removeprefix("window").lstrip("-") or "static"
        else:
            options["cache"] = full_static_cache(model, width + new_tokens)
            step = how
        if step == "static":
            options["disable_compile"] = True
        else:
            compile_on_cpu = model.device.type != "cuda"
            options["compile_config"] = decode_step_options(step.removesuffix("-stock"),
                                                            compile_on_cpu)["compile_config"]
            if step == "cudagraphs-stock":  # torch's own backend: it copies every weight into the graph each step
                options["compile_config"].backend = "cudagraphs"

    if model.device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=pad_id, **options, **extra)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    if "cache" in options:  # the cache passed was the one decoded into, each layer holding every token fed
        counts = {getattr(layer, "cumulative_length_int", None) for layer in options["cache"].layers} - {None}
        assert options["cache"].get_seq_length() > 0 and counts <= {inputs["input_ids"].shape[1] + new_tokens - 1}
    if extra:
        return out, seconds
    return out[:, inputs["input_ids"].shape[1]:], seconds


def logit_check(model, inputs, pad_id, how, reference, steps):
    """Per generated step: among rows whose tokens so far equal the reference's (same inputs), the largest
    |logit - reference logit| over the mean |reference logit|, and how many such rows there are."""
    out, _ = run(model, inputs, steps, pad_id, how, output_logits=True, return_dict_in_generate=True)
    width = inputs["input_ids"].shape[1]
    tokens = out.sequences[:, width:]
    result = []
    if reference is None:
        return (tokens, out.logits), result
    ref_tokens, ref_logits = reference
    for t in range(steps):
        same = (tokens[:, :t] == ref_tokens[:, :t]).all(dim=1)
        if not same.any():
            break
        a, b = out.logits[t][same].float(), ref_logits[t][same].float()
        scale = b.abs().mean()
        result.append({"step": t, "rows": int(same.sum()), "max_rel": round(float((a - b).abs().max() / scale), 4),
                       "mean_rel": round(float((a - b).abs().mean() / scale), 5),
                       "top1_equal": round(float((a.argmax(-1) == b.argmax(-1)).float().mean()), 4)})
    return (tokens, out.logits), result


def prefill_layers(model, inputs, pad_id, how, rows=32):
    """Each decoder layer's attention and MLP outputs in the prefill of `how`, at the real (unpadded) tokens of the
    first `rows` rows, as float32 on the CPU: {(layer, part): tensor}."""
    real = inputs["attention_mask"][:rows].bool()
    captured, hooks = {}, []

    def keep(key):
        def hook(module, args, output):  # one token generated: prefills only (eager-halves runs two)
            out = output[0] if isinstance(output, tuple) else output
            captured.setdefault(key, []).append(out[:rows].float().cpu())
        return hook

    for i, layer in enumerate(model.model.layers):
        hooks += [layer.self_attn.register_forward_hook(keep((i, "attention"))),
                  layer.mlp.register_forward_hook(keep((i, "mlp")))]
    try:
        run(model, inputs, 1, pad_id, how)
    finally:
        for hook in hooks:
            hook.remove()
    return {key: torch.cat(parts)[:rows][real.cpu()] for key, parts in captured.items()}


def layer_check(reference, layers):
    """Per layer, the mean |difference| of its attention and MLP outputs from the reference's over their mean
    |value|: where two ways of decoding first part in the prefill (identical inputs give 0.0 at layer 0's attention
    only if the attention computes the same bits)."""
    rows = []
    for (i, part), want in reference.items():
        got = layers[(i, part)]
        rows.append({"layer": i, "part": part,
                     "mean_rel": float(f"{float((got - want).abs().mean() / want.abs().mean()):.3g}")})
    return rows


def profile_decode_steps(model, inputs, pad_id, how, steps):
    """torch.profiler's table of `steps` decode steps, after the prefill and one step left out, by device time (the
    GPU's kernels; on the CPU its ops); of eager-halves, its first half."""
    from torch.profiler import ProfilerActivity, profile, schedule
    from transformers import LogitsProcessor, LogitsProcessorList

    class StepMark(LogitsProcessor):  # generate calls it once a step, outside the (compiled) forward
        def __call__(self, input_ids, scores):
            prof.step()
            return scores

    cuda = model.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=steps, repeat=1)) as prof:
        run(model, inputs, steps + 2, pad_id, how, logits_processor=LogitsProcessorList([StepMark()]))
    table = prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=16,
                                      max_name_column_width=70)
    return f"profile of {how}: {steps} decode steps, the prefill and the first step left out\n{table}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--batch", type=int, default=301)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--steps", nargs="+", default=["eager", "static"])
    parser.add_argument("--calls", type=int, default=2)
    parser.add_argument("--check-steps", type=int, default=6)
    parser.add_argument("--profile", type=int, default=0, help="then profile this many decode steps of each step")
    parser.add_argument("--layer-check", action="store_true",
                        help="each layer's prefill outputs against the first step's (the same padding only)")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.tiny:
        import tempfile
        from helpers import GPT_OSS_PROMPTS, build_tiny_gpt_oss, decoding_gpt_oss, word_tokenizer
        folder = Path(tempfile.mkdtemp())
        build_tiny_gpt_oss(folder, vocab_size=512, sliding_window=16)
        model = decoding_gpt_oss(folder)
        tokenizer = word_tokenizer({f"t{i}": i for i in range(512)})
        prompts = GPT_OSS_PROMPTS
    else:
        params = SimpleNamespace(dtype="bfloat16", attn_implementation="flex_attention",
                                 experts_implementation="grouped_mm", trust_remote_code=False)
        tokenizer = load_tokenizer(args.model)
        model = load_model(args.model, params, device_map={"": "cuda"}).eval()
        rows = builtin_data.generate(400, seed=1)
        questions = [next(m["content"] for m in r["messages"] if m["role"] == "user") for r in rows]
        prompts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                   for c in conversations_of(questions, args.batch)]
    chosen = use_for_generation(model)
    tokenizer.padding_side = "left"
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    def padded(how):
        multiple = int(how.split("-pad")[1]) if "-pad" in how else 64
        return tokenizer.pad({"input_ids": encoded}, pad_to_multiple_of=multiple, return_tensors="pt").to(model.device)
    reference = None
    logit_reference = layer_reference = None
    with torch.no_grad():
        for how in args.steps:
            try:
                inputs = padded(how)
                got, check = logit_check(model, inputs, tokenizer.pad_token_id, how, logit_reference, args.check_steps)
                logit_reference = logit_reference or got
                emit({"step": how, "logit_check": check}, args.out)
            except Exception as exc:
                print(json.dumps({"step": how, "logit_check_error": f"{type(exc).__name__}: {exc}"[:1500]}), flush=True)
            if args.layer_check:
                width = inputs["input_ids"].shape[1]
                layers = prefill_layers(model, inputs, tokenizer.pad_token_id, how)
                if layer_reference is None:
                    layer_reference = (width, layers)
                elif layer_reference[0] == width:
                    emit({"step": how, "layer_check": layer_check(layer_reference[1], layers)}, args.out)
                del layers
            compiled = base_step(how) not in ("eager", "eager-halves", "static", "window")
            for call in range(1, 1 + (args.calls if compiled else 1)):
                if model.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                try:
                    new, seconds = run(model, inputs, args.new_tokens, tokenizer.pad_token_id, how)
                except Exception as exc:  # a lever that fails is reported, the next one runs
                    print(json.dumps({"step": how, "call": call, "error": f"{type(exc).__name__}: {exc}"[:1500]}),
                          flush=True)
                    break
                if reference is None:
                    reference = new
                same_rows = int((new == reference).all(dim=1).sum())
                same_tokens = float((new == reference).float().mean())
                row = {"step": how, "call": call, "batch": len(prompts), "prompt_width": inputs["input_ids"].shape[1],
                       "new_tokens": int(new.numel()), "seconds": round(seconds, 2),
                       "ms_per_step": round(1000 * seconds / new.shape[1], 1),
                       "new_tokens_per_s": round(new.numel() / seconds, 1),
                       "rows_equal_to_first": same_rows, "tokens_equal_to_first": round(same_tokens, 4),
                       "attention": REPEAT_KV if how.startswith("repeat-kv-") else chosen["attention"],
                       "experts": chosen["experts"],
                       "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if model.device.type == "cuda"
                       else None, "device": torch.cuda.get_device_name() if model.device.type == "cuda" else "cpu"}
                emit(row, args.out)
            if args.profile:  # where a decode step's time goes: the kernels of --profile steps, prefill left out
                print(profile_decode_steps(model, inputs, tokenizer.pad_token_id, how, args.profile), flush=True)
            if model.device.type == "cuda":  # what the compiled steps hold: graphs compiled, CUDA-graph pools
                print(json.dumps({"after": how, "allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 1),
                                  "reserved_gib": round(torch.cuda.memory_reserved() / 2**30, 1),
                                  "dynamo": {k: dict(v) for k, v in counters.items()
                                             if k in ("stats", "inductor", "cudagraphs_in_place")}},
                                 default=str)[:3000], flush=True)


if __name__ == "__main__":
    main()
