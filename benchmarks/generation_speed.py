"""Generation speed of a model folder under each implementation, batch size and decode step, as the evaluate stage
generates, and each call's text against the first call's: the GPU check of the decode steps (eval.decode_step).

    python benchmarks/generation_speed.py <model folder> --attention flex_attention --experts grouped_mm \
        --variants generate:301 generate:301:captured generate:301:cudagraphs --new-tokens 512 --out generation.jsonl
The model loads once with the implementations training uses (--attention, --experts, as model.* params); each variant
`<experts>:<batch>[:<decode step>]` generates one batch of the built-in questions, every row --new-tokens long (no end
of sequence): `generate` is use_for_generation's experts, `eager` the expert loop; a captured or compiled step runs
--calls times, the first recording or compiling it. One JSON line per call: ms per decode step, new tokens/s, peak
GiB, and how many rows' text equals the first call's.
"""
import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from lora_pipeline.config.params import LANGUAGE_NAMES
from lora_pipeline.data import builtin as builtin_data
from lora_pipeline.evaluate.generation import generate, use_for_generation
from lora_pipeline.model.chat import prompt_messages
from lora_pipeline.model.loading import experts_implementation, load_model, load_tokenizer, set_experts_implementation

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's bench_rows, however this file is loaded
from bench_rows import emit  # noqa: E402

GPU = torch.cuda.is_available()  # on a CPU (a check of the code with a tiny model): no peak memory


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--attention", default="eager")
    parser.add_argument("--experts", default="eager")
    parser.add_argument("--variants", nargs="+", default=["generate:20", "generate:320"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--calls", type=int, default=2,
                        help="calls of each captured or compiled variant (the first records or compiles it)")
    parser.add_argument("--out")
    args = parser.parse_args()
    started = time.perf_counter()
    tokenizer, model = load_bf16(args.model, args.attention, args.experts)
    load_seconds = time.perf_counter() - started
    chosen = use_for_generation(model)
    model.generation_config.eos_token_id = None  # every row runs the full length, whichever the step
    first = None
    for variant in args.variants:
        experts, batch, *step = variant.split(":")
        decode_step = use_for_generation(model, step[0] if step else "eager")["decode_step"]
        if chosen["experts"]:
            set_experts_implementation(model, chosen["experts"] if experts == "generate" else experts)
        conversations = conversations_of(int(batch))
        if decode_step == "eager":
            generate(model, tokenizer, conversations[:2], 4, 2)  # warm-up (a compiled step compiles for its shape)
        for call in range(1, 1 + (args.calls if decode_step != "eager" else 1)):
            reset_peak()
            stats = {}
            texts = generate(model, tokenizer, conversations, args.new_tokens, int(batch), stats=stats,
                             decode_step=decode_step)
            first = first or texts
            result = {"model": args.model, "attention": chosen["attention"], "experts": experts_implementation(model),
                      "batch": int(batch), "decode_step": decode_step, "call": call,
                      "new_tokens": stats["new_tokens"], "decode_steps": stats["decode_steps"],
                      "seconds": round(stats["seconds"], 2),
                      "ms_per_step": round(1000 * stats["seconds"] / stats["decode_steps"], 1),
                      "new_tokens_per_s": round(stats["new_tokens"] / stats["seconds"], 1),
                      "rows_equal_to_first": sum(a == b for a, b in zip(texts, first)),
                      "peak_gib": peak_gib(), "load_seconds": round(load_seconds, 1), "device": device_name()}
            emit(result, args.out)


def reset_peak() -> None:
    if GPU:
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 1) if GPU else None


def device_name() -> str:
    return torch.cuda.get_device_name() if GPU else "cpu"


def load_bf16(folder: str, attention: str, experts: str | None):
    """The tokenizer, and the model in bfloat16 with these implementations (model.* params), on the GPU if any."""
    params = SimpleNamespace(dtype="bfloat16", attn_implementation=attention, experts_implementation=experts,
                             trust_remote_code=False)
    return load_tokenizer(folder), load_model(folder, params, device_map={"": "cuda" if GPU else "cpu"}).eval()


def conversations_of(batch: int) -> list[list[dict]]:
    """The first `batch` built-in questions as the evaluate stage asks them, each in one of the languages in turn."""
    rows = builtin_data.generate(max(400, batch), seed=1)
    questions = [next(m["content"] for m in r["messages"] if m["role"] == "user") for r in rows]
    languages = list(LANGUAGE_NAMES)
    return [prompt_messages(q, LANGUAGE_NAMES[languages[i % len(languages)]]) for i, q in enumerate(questions[:batch])]


if __name__ == "__main__":
    main()
