"""Text generation for evaluation and serving: the implementations that decode, length-sorted batches, and the
batches split over the processes of a launch."""
from __future__ import annotations

import math
import time

import torch
from transformers import CompileConfig
from transformers.integrations.moe import ExpertsInterface, grouped_mm_experts_forward

from lora_pipeline.evaluate import captured_decode
from lora_pipeline.families.gpt_oss import sink_attention
from lora_pipeline.evaluate.cuda_graphs import cudagraphs_in_place
from lora_pipeline.evaluate.window_cache import WindowCache, sliding_window
from lora_pipeline.launch.distributed import gather, process_group
from lora_pipeline.model.loading import experts_implementation, inference_attention, set_experts_implementation

# transformers' generate swaps grouped_mm for batched_mm while it decodes, and batched_mm copies each selected
# expert's weights once per token: a whole prompt batch in prefill asks for hundreds of GiB on gpt-oss-20b. The same
# grouped kernels (tokens sorted by expert, one grouped GEMM per projection) under a name of their own are kept.
GROUPED_FOR_GENERATION = "grouped_mm_generate"
ExpertsInterface.register(GROUPED_FOR_GENERATION, grouped_mm_experts_forward)


# How each decode step runs (eval.decode_step). eager: every op launched from Python, into a KV cache that grows.
# cudagraphs, inductor: a static KV cache (fixed shapes; window_cache.WindowCache where the model has sliding-window
# layers), with generate compiling the decode step (torch.compile, whole graph): cudagraphs replays the step's
# recorded CUDA graph, one launch instead of hundreds, the weights read where they lie (cuda_graphs.py); inductor
# ("reduce-overhead") fuses the kernels too, and records them as a CUDA graph. captured: greedy decoding whose eager
# step is recorded once as a CUDA graph with torch.cuda.graph, no compiler (captured_decode.py), on the same caches.
DECODE_STEPS = ("eager", "cudagraphs", "inductor", "captured")


def evaluation_attention(model_type: str, attention: str) -> tuple[str, list[str]]:
    """The attention that evaluation's passes run (the held-out loss and decoding), given the one the model was loaded
    with, and why it differs: loading.inference_attention's choice for passes without gradients, then gpt-oss's eager
    attention as sink_attention's (for_model: the same arithmetic, no copies of the KV cache)."""
    attention, note = inference_attention(model_type, attention)
    attention, sinks_note = sink_attention.for_model(model_type, attention)
    return attention, [n for n in (note, sinks_note) if n]


def decoding_implementations(model_type: str, attention: str, experts: str | None, decode_step: str = "eager",
                             device_type: str = "cuda") -> dict:
    """The attention and experts implementations and the decode step generation runs, given those the model was
    loaded with and the step asked for, and why any differs: evaluation's attention (evaluation_attention), grouped
    experts keep their grouped kernels while decoding, and a compiled decode step needs a GPU."""
    attention, notes = evaluation_attention(model_type, attention)
    if experts in ("grouped_mm", "batched_mm"):
        notes.append(f"{experts} experts decode as {GROUPED_FOR_GENERATION} (grouped_mm that generate keeps)")
        experts = GROUPED_FOR_GENERATION
    if decode_step not in DECODE_STEPS:
        raise ValueError(f"eval.decode_step: {decode_step!r} is not one of {', '.join(DECODE_STEPS)}")
    if decode_step != "eager" and device_type != "cuda":
        notes.append(f"the {decode_step} decode step needs a GPU: eager")
        decode_step = "eager"
    return {"attention": attention, "experts": experts, "decode_step": decode_step, "notes": notes}


def decode_cache(decode_step: str, config) -> str:
    """The KV cache a decode step runs on (generate_from_prompts): a dynamic one for the eager step, else a static
    one, a WindowCache where the model has sliding-window layers."""
    return "dynamic" if decode_step == "eager" else "WindowCache" if sliding_window(config) else "static"


def use_for_generation(model, decode_step: str = "eager") -> dict:
    """Switch a loaded model to the implementations that decode (decoding_implementations) and return them, with the
    cache the step runs on; pass the returned decode_step to generate."""
    chosen = decoding_implementations(model.config.model_type, model.config._attn_implementation,
                                      experts_implementation(model), decode_step, model.device.type)
    if chosen["attention"] != model.config._attn_implementation:
        model.set_attn_implementation(chosen["attention"])
    if chosen["experts"]:
        set_experts_implementation(model, chosen["experts"])
    if chosen["decode_step"] == "captured" and (why := captured_decode.unsupported(model)):
        chosen["notes"].append(f"the captured decode step cannot decode this model ({why}): eager")
        chosen["decode_step"] = "eager"
    chosen["cache"] = decode_cache(chosen["decode_step"], model.config)
    return chosen


def decode_step_options(decode_step: str, compile_on_cpu: bool = False) -> dict:
    """transformers generate's arguments for a decode step of DECODE_STEPS. `compile_on_cpu`: compile on the CPU too
    (transformers compiles on GPUs only), for checking on a CPU that the step compiles as one graph."""
    if decode_step in ("eager", "captured"):
        return {}
    backend = cudagraphs_in_place if decode_step == "cudagraphs" else decode_step
    config = CompileConfig(backend=backend, mode="reduce-overhead" if decode_step == "inductor" else None,
                           fullgraph=True, dynamic=False)
    config._compile_all_devices = compile_on_cpu
    return {"cache_implementation": "static", "compile_config": config}


def generate(model, tokenizer, conversations: list[list[dict]], max_new_tokens: int, batch_size: int,
             do_sample: bool = False, stats: dict | None = None, decode_step: str = "eager",
             tools: list[list | None] | None = None, **options) -> list[str]:
    """Batched generation (left padding) of the assistant turn; returns the new text, special tokens kept.
    `tools`: each conversation's function schemas for the chat template, or None. `options`: further arguments of
    transformers' generate (e.g. min_new_tokens)."""
    tools = tools or [None] * len(conversations)
    prompts = [tokenizer.apply_chat_template(c, tools=t, tokenize=False, add_generation_prompt=True)
               for c, t in zip(conversations, tools)]
    return generate_from_prompts(model, tokenizer, prompts, max_new_tokens, batch_size, stats=stats,
                                 decode_step=decode_step, do_sample=do_sample, **options)


PAD_MULTIPLE = 64  # a compiled decode step's prompt widths: fewer distinct shapes, fewer compiles


def batches(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Indices in batches of similar lengths (shortest first), so little of each batch is padding; the same batches
    whatever the number of processes, so each prompt is decoded as one process would decode it."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[start:start + batch_size] for start in range(0, len(order), batch_size)]


@torch.no_grad()
def generate_from_prompts(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int,
                          stats: dict | None = None, decode_step: str = "eager", compile_on_cpu: bool = False,
                          **sampling) -> list[str]:
    """Batched generation (left padding) after prompts already rendered with the chat template; returns the new
    text, special tokens kept. In a launch of several processes each takes every n-th batch and all get every text.
    `sampling`: do_sample, temperature, top_p (greedy unless do_sample), or other arguments of transformers'
    generate. `decode_step`: one of DECODE_STEPS (use_for_generation's choice; `compile_on_cpu` as in
    decode_step_options), on the cache decode_cache names. A static cache (a compiled step) compiles once per batch
    shape, so its prompts are padded to a multiple of PAD_MULTIPLE tokens; a WindowCache's, to at least the window.
    `stats`, if given, accumulates this process's new tokens, decode steps, seconds, and prompt tokens without and
    with the batches' padding. The captured step decodes greedily, and takes no other generate arguments; its prompts
    are padded to at least the window too."""
    if decode_step == "captured" and any(sampling.values()):
        raise ValueError(f"the captured decode step decodes greedily: {sampling} asks for more; use eval.decode_step: "
                         "eager or cudagraphs")
    tokenizer.padding_side = "left"
    sampling |= decode_step_options(decode_step, compile_on_cpu)
    cache = decode_cache(decode_step, model.config)
    compiled = decode_step in ("cudagraphs", "inductor")  # compiled once per batch shape
    window = sliding_window(model.config) if cache == "WindowCache" else None
    rank, world = process_group()
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    mine = []
    for batch in batches([len(ids) for ids in encoded], batch_size)[rank::world]:
        rows = {"input_ids": [encoded[i] for i in batch]}
        options = sampling
        if compiled or window:  # a multiple of PAD_MULTIPLE (compiled), and at least the window
            longest = max(len(ids) for ids in rows["input_ids"])
            width = max(math.ceil(longest / PAD_MULTIPLE) * PAD_MULTIPLE if compiled else longest, window or 0)
            inputs = tokenizer.pad(rows, padding="max_length", max_length=width, return_tensors="pt")
        else:
            inputs = tokenizer.pad(rows, return_tensors="pt")
        inputs = inputs.to(model.device)
        started = time.perf_counter()
        if decode_step == "captured":  # its own cache
            new = captured_decode.greedy_generate(model, inputs["input_ids"], inputs["attention_mask"], max_new_tokens,
                                                  tokenizer.pad_token_id, capture=model.device.type == "cuda")
        else:
            if window:
                options = {k: v for k, v in sampling.items() if k != "cache_implementation"}
                options["cache"] = WindowCache(model.config,
                                               max_cache_len=inputs["input_ids"].shape[1] + max_new_tokens)
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                 **options)
            new = out[:, inputs["input_ids"].shape[1]:]
            if window:
                options["cache"].check_counts()
        if stats is not None:
            if model.device.type == "cuda":
                torch.cuda.synchronize(model.device)
            stats["seconds"] = stats.get("seconds", 0.0) + time.perf_counter() - started
            stats["decode_steps"] = stats.get("decode_steps", 0) + new.shape[1]
            stats["new_tokens"] = stats.get("new_tokens", 0) + int((new != tokenizer.pad_token_id).sum())
            stats["prompts"] = stats.get("prompts", 0) + len(batch)
            stats["prompt_tokens"] = stats.get("prompt_tokens", 0) + int(inputs["attention_mask"].sum())
            stats["padded_prompt_tokens"] = stats.get("padded_prompt_tokens", 0) + inputs["input_ids"].numel()
        for i, row in zip(batch, new):
            text = tokenizer.decode(row, skip_special_tokens=False)
            mine.append((i, text.replace(tokenizer.pad_token, "") if tokenizer.pad_token else text))
    tokenizer.padding_side = "right"
    outputs = [""] * len(prompts)
    for i, text in gather(mine):
        outputs[i] = text
    return outputs
