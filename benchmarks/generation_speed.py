"""Generation speed of a model folder under each implementation and batch size, as the evaluate stage generates.

    python benchmarks/generation_speed.py <model folder> --attention flex_attention --experts grouped_mm \
        --variants eager:20 generate:20 generate:320 generate:320:cudagraphs --new-tokens 64 --out generation.jsonl
The model loads once with the implementations training uses (--attention, --experts, as model.* params), then each
variant `<experts>:<batch>[:<decode step>]` generates one batch of prompts from the built-in questions for
--new-tokens steps (every row runs the full length): `generate` is
lora_pipeline.evaluate.generation.use_for_generation's choice, `eager` the expert loop; the decode step is
eval.decode_step's (eager by default; cudagraphs and inductor compile, so those variants run --calls times, the first
with the compile). Prints one JSON line per call: ms per decode step, new tokens/s, peak GiB.

`cb:<batch>[:<eager|cudagraphs>[:<tokens a step>]]` generates the same prompts through transformers' continuous
batching instead (model.generate_batch: a paged KV cache with its own sliding-window pages, every row's tokens in one
flat batch a step, at most --cb-batch-tokens or the variant's tokens a step; gpt-oss's eager attention as
`paged|eager`, sinks included), with generate's experts; `cudagraphs` records its steps as CUDA graphs, so it runs
--calls times (the first records them). Its line has no ms per decode step (its steps mix prefill and decoding) but
the forward passes it ran and the attention implementation that ran; a variant that fails gives a line with its error
and the next variant runs.
"""
import argparse
import functools
import math
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch
import transformers
from transformers import ContinuousBatchingConfig, GenerationConfig

from lora_pipeline.config.params import LANGUAGE_NAMES
from lora_pipeline.data import builtin as builtin_data
from lora_pipeline.families.gpt_oss import sink_attention
from lora_pipeline.evaluate.generation import generate, use_for_generation
from lora_pipeline.model.chat import prompt_messages
from lora_pipeline.model.loading import experts_implementation, load_model, load_tokenizer, set_experts_implementation

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's bench_rows, however this file is loaded
from bench_rows import emit  # noqa: E402

GPU = torch.cuda.is_available()  # on a CPU (a check of the code with a tiny model): no peak memory
CB_PAGE_SIZE = 64  # tokens a page of the paged cache: a row of a few hundred tokens leaves little of a page unused
CB_BATCH_TOKENS = 512  # tokens a step at most: eager attention's scores are (tokens a step) x (all the rows' keys)


@torch.no_grad()
def continuous_batching(model, tokenizer, prompts: list[str], max_new_tokens: int, stats: dict | None = None,
                        cuda_graphs: bool = False, batch_tokens: int = CB_BATCH_TOKENS,
                        keep: bool = False) -> list[str]:
    """Greedy generation of rendered prompts through transformers' continuous batching (model.generate_batch), every
    row for max_new_tokens tokens: the EOS tokens are suppressed, as generate's min_new_tokens=max_new_tokens does
    (continuous batching drops the min_new_tokens processor). Returns the new text as generate_from_prompts does
    (special tokens kept, padding removed). The paged cache holds all the rows at once (num_blocks from their
    lengths, not from the free GPU memory: eager attention's scores need that memory); `batch_tokens` caps the tokens
    of a step, at least one per row. No flash attention (gpt-oss's sinks are in no kernel here): eager becomes
    `paged|eager`. `cuda_graphs`: steps recorded as CUDA graphs when first met (no warm-up at the largest shapes);
    `keep`: the manager, its cache and graphs stay on the model for the next call
    (model.destroy_cached_continuous_batching_manager() ends it). `stats`, if given, gets seconds, new_tokens,
    forwards (generation steps), attention (the implementation the forwards that ran in Python ran: none where all
    steps were graph replays), batch_tokens and cuda_graphs (whether steps ran as graphs: none without a GPU)."""
    if "auto_switch_to_flash" not in ContinuousBatchingConfig.__dataclass_fields__:
        raise RuntimeError("continuous batching here is written for transformers 5.24 (benchmarks/gpu-wheels.txt): "
                           f"{transformers.__version__}'s ContinuousBatchingConfig has no auto_switch_to_flash")
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos or -1,
                              suppress_tokens=eos or None, pad_token_id=tokenizer.pad_token_id)
    pages = sum(math.ceil((len(ids) + max_new_tokens) / CB_PAGE_SIZE) + 1 for ids in encoded)
    cb_config = ContinuousBatchingConfig(page_size=CB_PAGE_SIZE, num_blocks=pages, use_cuda_graph=cuda_graphs,
                                         max_batch_tokens=max(batch_tokens, 64 * math.ceil(len(encoded) / 64)),
                                         auto_switch_to_flash=False)
    chosen = model.config._attn_implementation
    if chosen == sink_attention.NAME:  # continuous batching pages transformers' own implementations only
        model.set_attn_implementation("eager")
    ran = set()
    hook = model.register_forward_pre_hook(lambda module, args: ran.add(module.config._attn_implementation))
    # Continuous batching builds its logits processors without a device: the suppressed ids would stay on the CPU
    # and be copied to the GPU at every step, which a CUDA graph cannot record. They are made on the model's device.
    model._get_logits_processor = functools.partial(model._get_logits_processor, device=model.device)
    if GPU:
        torch.cuda.empty_cache()  # the cache's memory check counts what an earlier variant left reserved as used
    started = time.perf_counter()
    try:
        outputs = model.generate_batch(inputs=encoded, generation_config=config, continuous_batching_config=cb_config,
                                       persistent_manager=True, warmup=False)
    finally:
        hook.remove()
        del model._get_logits_processor
        if model.config._attn_implementation != chosen:
            model.set_attn_implementation(chosen)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    seconds = time.perf_counter() - started
    manager = model._cached_continuous_batching_manager
    forwards, graphs = manager.current_batch, manager.continuous_batching_config.use_cuda_graph
    if not keep:
        model.destroy_cached_continuous_batching_manager()
    rows = list(outputs.values())
    failed = [o.error for o in rows if o.error is not None]
    if len(rows) != len(prompts) or failed:
        raise RuntimeError(f"continuous batching returned {len(rows)} of {len(prompts)} rows; errors: {failed[:3]}")
    if stats is not None:
        stats.update(seconds=seconds, new_tokens=sum(len(o.generated_tokens) for o in rows), forwards=forwards,
                     attention=",".join(sorted(ran)), batch_tokens=cb_config.max_batch_tokens,
                     cuda_graphs=any(graphs))
    texts = [tokenizer.decode(o.generated_tokens, skip_special_tokens=False) for o in rows]
    return [t.replace(tokenizer.pad_token, "") if tokenizer.pad_token else t for t in texts]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--attention", default="eager")
    parser.add_argument("--experts", default="eager")
    parser.add_argument("--variants", nargs="+", default=["generate:20", "generate:320"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--calls", type=int, default=2, help="calls of each compiled variant (the first compiles)")
    parser.add_argument("--cb-batch-tokens", type=int, default=CB_BATCH_TOKENS,
                        help="continuous batching: tokens a step at most (at least the batch)")
    parser.add_argument("--out")
    args = parser.parse_args()
    params = SimpleNamespace(dtype="bfloat16", attn_implementation=args.attention,
                             experts_implementation=args.experts, trust_remote_code=False)
    started = time.perf_counter()
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, params, device_map={"": "cuda" if GPU else "cpu"}).eval()
    load_seconds = time.perf_counter() - started
    chosen = use_for_generation(model)
    rows = builtin_data.generate(400, seed=1)
    questions = [next(m["content"] for m in r["messages"] if m["role"] == "user") for r in rows]
    for variant in args.variants:
        experts, batch, *step = variant.split(":")
        if experts == "cb":
            try:
                run_continuous_batching(model, tokenizer, args, questions, int(batch), *(step or ["eager"]),
                                        chosen=chosen, load_seconds=load_seconds)
            except Exception as error:  # recorded, and the next variant runs
                traceback.print_exc()
                emit({"model": args.model, "variant": variant, "generation": "continuous_batching",
                      "error": f"{type(error).__name__}: {error}"[:2000], "device": device_name()}, args.out)
            continue
        decode_step = use_for_generation(model, step[0] if step else "eager")["decode_step"]
        if chosen["experts"]:
            set_experts_implementation(model, chosen["experts"] if experts == "generate" else experts)
        conversations = conversations_of(questions, int(batch))
        if decode_step == "eager":
            generate(model, tokenizer, conversations[:2], 4, 2)  # warm-up (a compiled step compiles for its shape)
        for call in range(1, 1 + (args.calls if decode_step != "eager" else 1)):
            reset_peak()
            stats = {}
            generate(model, tokenizer, conversations, args.new_tokens, int(batch), stats=stats,
                     decode_step=decode_step, min_new_tokens=args.new_tokens)
            result = {"model": args.model, "attention": chosen["attention"], "experts": experts_implementation(model),
                      "batch": int(batch), "decode_step": decode_step, "call": call,
                      "new_tokens": stats["new_tokens"], "decode_steps": stats["decode_steps"],
                      "seconds": round(stats["seconds"], 2),
                      "ms_per_step": round(1000 * stats["seconds"] / stats["decode_steps"], 1),
                      "new_tokens_per_s": round(stats["new_tokens"] / stats["seconds"], 1),
                      "peak_gib": peak_gib(), "load_seconds": round(load_seconds, 1), "device": device_name()}
            emit(result, args.out)


def reset_peak() -> None:
    if GPU:
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 1) if GPU else None


def device_name() -> str:
    return torch.cuda.get_device_name() if GPU else "cpu"


def conversations_of(questions: list[str], batch: int) -> list[list[dict]]:
    """The first `batch` questions as the evaluate stage asks them, each in one of the languages in turn."""
    languages = list(LANGUAGE_NAMES)
    return [prompt_messages(q, LANGUAGE_NAMES[languages[i % len(languages)]]) for i, q in enumerate(questions[:batch])]


def run_continuous_batching(model, tokenizer, args, questions: list[str], batch: int, step: str = "eager",
                            batch_tokens: str | None = None, *, chosen: dict, load_seconds: float) -> None:
    """A `cb:<batch>[:<step>[:<tokens a step>]]` variant: the batch's prompts (rendered as generate renders them)
    through continuous_batching, once (eager, after a small warm-up call) or --calls times (cudagraphs, the first
    recording the graphs); one JSON line a call."""
    if step not in ("eager", "cudagraphs"):
        raise ValueError(f"cb:{batch}:{step}: continuous batching runs eager or cudagraphs steps")
    batch_tokens = int(batch_tokens) if batch_tokens else args.cb_batch_tokens
    if chosen["experts"]:
        set_experts_implementation(model, chosen["experts"])
    prompts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
               for c in conversations_of(questions, batch)]
    graphs, attention = step == "cudagraphs", None
    try:
        if not graphs:
            continuous_batching(model, tokenizer, prompts[:2], 4)  # warm-up
        for call in range(1, 1 + (args.calls if graphs else 1)):
            reset_peak()
            stats = {}
            continuous_batching(model, tokenizer, prompts, args.new_tokens, stats, cuda_graphs=graphs,
                                batch_tokens=batch_tokens, keep=graphs)
            attention = stats["attention"] or attention  # a call of graph replays only runs no forward in Python
            result = {"model": args.model, "attention": attention, "experts": experts_implementation(model),
                      "batch": batch, "cache": "paged", "decode_step": step, "generation": "continuous_batching",
                      "batch_tokens": stats["batch_tokens"], "call": call, "new_tokens": stats["new_tokens"],
                      "forwards": stats["forwards"], "cuda_graphs": stats["cuda_graphs"],
                      "seconds": round(stats["seconds"], 2),
                      "new_tokens_per_s": round(stats["new_tokens"] / stats["seconds"], 1),
                      "peak_gib": peak_gib(), "load_seconds": round(load_seconds, 1), "device": device_name()}
            emit(result, args.out)
    finally:
        model.destroy_cached_continuous_batching_manager()


if __name__ == "__main__":
    main()
