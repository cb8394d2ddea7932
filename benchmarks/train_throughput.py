"""Training throughput of a recipe on GPUs, through the train stage's own trainer, on the standard workload.

    accelerate launch --config_file configs/accelerate/multi_gpu_2.yaml benchmarks/train_throughput.py \
        --recipe qwen2-0.5b --arch qwen2-0.5b --out ours.jsonl
The model (the recipe's architecture, random init) is saved to disk first and built by build_trainer as the train
stage builds it, from the recipe plus any `--set key=value`; the workload is the seed baseline's, so the tokens/s
compare as a ratio on one machine. A split of the global batch set by hand needs --set train.global_batch_size=0.
One JSON line: docs/performance.md#how-it-is-measured says what each figure is.
"""
import argparse
import collections
import faulthandler
import json
import os
import math
import random
import time
import traceback
import warnings
from pathlib import Path

if "LOCAL_RANK" not in os.environ:  # one process, not under accelerate/torchrun: one GPU, as Trainer would otherwise
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")  # wrap the model in nn.DataParallel, which SFTTrainer refuses

import torch

from cli.recipes import apply_sets, compose
from lora_pipeline.config.params import for_stage, validate
from lora_pipeline.families.gpt_oss.mxfp4_experts import paths_run
from lora_pipeline.train.training import build_trainer
from bench_rows import emit

# The seed baseline's standard workloads (same generator, same seeds).
WORKLOADS = {
    "qwen2-0.5b": dict(n=2000, median=600, sigma=0.7, lo=32, hi=4096, vocab=151936, seed=1),
    "gpt-oss-20b": dict(n=200, median=900, sigma=0.6, lo=64, hi=4096, vocab=201088, seed=2),
}
WARM_STEPS = 3  # untimed: compiles for the first shapes, then dynamic ones
# Dense bf16 peak of the H100/H200 SXM by the datasheet (no sparsity), for MFU.
PEAK_FLOPS = 989e12


def workload(n, median, sigma, lo, hi, vocab, seed):
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        length = int(min(hi, max(lo, math.exp(math.log(median) + sigma * rng.gauss(0, 1)))))
        rows.append({"input_ids": [rng.randrange(3, vocab) for _ in range(length)]})
    return rows


def builtin_workload(n: int, seed: int) -> list[dict]:
    """The built-in multilingual reasoning conversations as token ids (a BPE trained on them, ids < 1024): a
    workload with structure, so the loss of a randomly initialised model visibly falls."""
    import tempfile

    from transformers import AutoTokenizer

    from lora_pipeline.data import builtin as builtin_data
    from lora_pipeline.model.chat import conversation
    from lora_pipeline.model.tiny import tokenizer_corpus, train_tokenizer

    rows = builtin_data.generate(n, seed)
    with tempfile.TemporaryDirectory() as tmp:
        train_tokenizer(tokenizer_corpus(rows), 1024, "tiny-qwen2", Path(tmp))
        tok = AutoTokenizer.from_pretrained(tmp)
    return [{"input_ids": list(tok.apply_chat_template(conversation(r), tokenize=True, return_dict=True)["input_ids"])}
            for r in rows]


def build_checkpoint(arch: str, layers: int | None, out: Path) -> None:
    """Random-init model of the real config, saved as the train stage would find it in models/base."""
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM
    from tokenizers import Tokenizer, models

    from lora_pipeline.families.gpt_oss.mxfp4_checkpoint import save_mxfp4_checkpoint
    from pipeline_setup import gpt_oss_20b_config, qwen2_0_5b_config, random_bf16_model  # benchmarks/

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "<unk>": 2},
                                                                              unk_token="<unk>")),
                                  pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    torch.manual_seed(0)
    if arch == "qwen2-0.5b":  # Qwen/Qwen2-0.5B's config.json
        with torch.device("cuda"):
            model = Qwen2ForCausalLM(qwen2_0_5b_config(num_hidden_layers=layers or 24, use_cache=False))
        model.save_pretrained(out)
    else:  # openai/gpt-oss-20b's, experts written in MXFP4 like the released checkpoint
        model = random_bf16_model(gpt_oss_20b_config(layers or 24), "cuda")
        save_mxfp4_checkpoint(model, out)
    tok.save_pretrained(out)
    del model
    torch.cuda.empty_cache()


def active_params(model) -> int:
    """Parameters one token passes through: all but the input embedding (a lookup), with MoE experts counted
    top_k/num_experts (each token visits top_k of them). A tied lm_head is counted once, as a matmul."""
    config = model.config
    embed = model.get_input_embeddings().weight
    total = 0
    for name, p in model.named_parameters():
        if p is embed and not config.tie_word_embeddings:
            continue
        share = config.num_experts_per_tok / config.num_local_experts if ".experts." in name else 1.0
        total += getattr(p, "ds_numel", p.numel()) * share  # DeepSpeed ZeRO-3 leaves a 0-element placeholder
    for name, b in model.named_buffers():  # experts packed in MXFP4 (grouped_mm_mxfp4): two values a byte
        if ".experts." in name and name.endswith("_blocks"):
            total += b.numel() * 2 * config.num_experts_per_tok / config.num_local_experts
    return int(total)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True, help="a recipe: recipes/<name>.yaml, e.g. qwen2-0.5b or "
                        "seed/qwen2-0.5b (the seed's exact settings)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a params key, e.g. train.sft.per_device_train_batch_size=8")
    parser.add_argument("--arch", choices=sorted(WORKLOADS), required=True)
    parser.add_argument("--layers", type=int, help="reduced depth (default: the real one)")
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps after warm-up")
    parser.add_argument("--workload", choices=["standard", "builtin"], default="standard",
                        help="standard: the seed baseline's random token ids (for tokens/s); builtin: real text")
    parser.add_argument("--checkpoint", default="/tmp/bench-base", help="where the random-init model is written")
    parser.add_argument("--label", default="", help="a name for this configuration in the output")
    parser.add_argument("--profile", help="after the timed steps, profile 3 more with torch.profiler; write the top "
                        "kernels and host ops to this file")
    parser.add_argument("--seed-result", help="the seed baseline's JSON lines from the same call: adds the ratio")
    parser.add_argument("--commit", default="", help="the project's git commit, recorded with the result")
    parser.add_argument("--out", help="append the JSON line to this file")
    parser.add_argument("--logging-steps", type=int, help="log (and read the loss) every N steps (default: the "
                        "recipe's train.sft.logging_steps; with --workload builtin, 1)")
    parser.add_argument("--sync-debug", action="store_true", help="after the timed (and profiled) steps, run one "
                        "more step under torch.cuda.set_sync_debug_mode and print where the host waited for the GPU")
    parser.add_argument("--stacks-every", type=int, metavar="S", help="print every thread's Python stack every S "
                        "seconds (to find where a slow or stuck run spends its time)")
    args = parser.parse_args()

    if args.stacks_every:
        faulthandler.dump_traceback_later(args.stacks_every, repeat=True)
    from accelerate import PartialState
    from datasets import Dataset
    from transformers import TrainerCallback
    from pipeline_setup import cut_to_depth  # benchmarks/, the script's folder

    state = PartialState()
    raw = compose(args.recipe)
    if args.layers:
        cut_to_depth(raw, args.layers)
    raw = apply_sets(raw, args.set)
    warm = WARM_STEPS
    raw["train"]["checkpoint_steps"] = 0
    profiled = 3 if args.profile else 0
    sync_step = warm + args.steps + profiled  # the step after it runs under the sync debug mode
    raw["train"]["sft"] |= {"max_steps": sync_step + int(args.sync_debug), "num_train_epochs": 1}
    if args.logging_steps or args.workload == "builtin":  # the built-in workload is for loss curves: every step
        raw["train"]["sft"]["logging_steps"] = args.logging_steps or 1
    params = for_stage(validate(raw, source=f"recipes/{args.recipe}.yaml"), "benchmark",
                         ["model", "quantization", "train", "lora"])
    checkpoint = Path(args.checkpoint)
    if state.is_main_process and not (checkpoint / "config.json").is_file():
        start = time.perf_counter()
        build_checkpoint(args.arch, args.layers, checkpoint)
        print(f"built {args.arch} checkpoint in {time.perf_counter() - start:.0f}s", flush=True)
    state.wait_for_everyone()

    marks, tokens, last, load_peak = {}, [0], [time.perf_counter()], [0.0]

    class Clock(TrainerCallback):
        def on_train_begin(self, a, s, control, **kwargs):  # after accelerate has wrapped the model
            load_peak[0] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()  # peak_gib: training alone

        def on_step_end(self, a, s, control, **kwargs):
            marked = s.global_step in (warm, warm + args.steps)
            if marked:  # else the host runs ahead of the GPU, as in the train stage
                torch.cuda.synchronize()
            now = time.perf_counter()
            if state.is_main_process:  # progress (as the host sees it): compile time shows up as slow first steps
                print(f"# step {s.global_step}: {now - last[0]:.1f}s, {torch.cuda.memory_allocated() / 2**30:.1f} GiB "
                      f"allocated, peak {torch.cuda.max_memory_allocated() / 2**30:.1f}", flush=True)
            last[0] = now
            if marked:
                marks[s.global_step] = (time.perf_counter(), int(tokens[0]))
            if profiled and s.global_step == warm + args.steps:
                profiler.start()
            if profiled and s.global_step == warm + args.steps + profiled:
                profiler.stop()
            if args.sync_debug and s.global_step == sync_step:
                torch.cuda.set_sync_debug_mode("warn")

    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                  torch.profiler.ProfilerActivity.CUDA]) if profiled else None

    rows = workload(**WORKLOADS[args.arch]) if args.workload == "standard" else builtin_workload(2000, 0)
    start = time.perf_counter()
    trainer, implementations = build_trainer(params, checkpoint, Dataset.from_list(rows), Path("/tmp/bench-out"),
                                             callbacks=[Clock()])
    print(f"# rank {state.process_index}: model loaded and trainer built in {time.perf_counter() - start:.0f}s",
          flush=True)
    last[0] = time.perf_counter()
    tokens[0] = torch.zeros((), dtype=torch.int64, device="cuda")

    def count_trained_tokens(module, args_, kwargs):  # what the model is given to learn, summed on the GPU
        tokens[0] += (kwargs["labels"] != -100).sum()

    trainer.model.register_forward_pre_hook(count_trained_tokens, with_kwargs=True)
    syncs = collections.Counter()

    def note_sync(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):  # where in Python the host waited: the innermost frames outside torch
            frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename][-3:]
            syncs[" < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))] += 1
        else:
            show_warning(message, category, filename, lineno, file, line)

    if args.sync_debug:  # only then: "always" would repeat every other warning at every step too
        show_warning, warnings.showwarning = warnings.showwarning, note_sync
        warnings.simplefilter("always", UserWarning)
    trainer.train()
    torch.cuda.set_sync_debug_mode(0)
    if args.sync_debug and state.is_main_process:
        print(f"# host waits for the GPU in one step: {sum(syncs.values())}", flush=True)
        for where, n in syncs.most_common():
            print(f"#   {n} x {where}", flush=True)
    if profiled and state.is_main_process:
        events = profiler.key_averages()
        tables = [f"sorted by {key}:\n" + events.table(sort_by=key, row_limit=30, max_name_column_width=70)
                  for key in ("self_cuda_time_total", "self_cpu_time_total")]  # the GPU's work, then the host's
        Path(args.profile).write_text(f"{args.recipe} {args.set} ({profiled} optimizer steps)\n" + "\n".join(tables))
    (t0, k0), (t1, k1) = marks[warm], marks[warm + args.steps]
    local = torch.tensor([k1 - k0, t1 - t0, torch.cuda.max_memory_allocated() / 2**30, load_peak[0]], device="cuda")
    gathered = trainer.accelerator.gather(local[None]).cpu()  # one row per process
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if state.is_main_process:
        sft = trainer.args
        tokens_per_s = float(gathered[:, 0].sum() / gathered[:, 1].max())
        n_active = active_params(trainer.model)
        flops_per_gpu = 4 * n_active * tokens_per_s / state.num_processes  # LoRA: ~4 x active params per token
        row = {"recipe": args.recipe, "label": args.label, "arch": args.arch,
               "layers": args.layers or "full", "gpus": state.num_processes, "workload": args.workload,
               "distributed": str(state.distributed_type).split(".")[-1],
               "tokens_per_s": round(tokens_per_s),
               "step_s": round(float(gathered[:, 1].max()) / args.steps, 3), "timed_steps": args.steps,
               "peak_gib": round(float(gathered[:, 2].max()), 1),  # while training
               "load_peak_gib": round(float(gathered[:, 3].max()), 1),  # while loading and wrapping the model
               "mfu": round(flops_per_gpu / PEAK_FLOPS, 3), "active_params": n_active,
               "global_batch": sft.per_device_train_batch_size * sft.gradient_accumulation_steps * state.num_processes,
               "micro_batch": sft.per_device_train_batch_size, "grad_accum": sft.gradient_accumulation_steps,
               "max_length": raw["train"]["sft"]["max_length"], "logging_steps": sft.logging_steps,
               "dtype": raw["model"]["dtype"], "commit": args.commit,
               "implementations": implementations, "mxfp4_paths": paths_run(trainer.model), "overrides": args.set,
               "loss_first": losses[0], "loss_last": losses[-1], "losses": losses,
               "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
        if args.seed_result and Path(args.seed_result).is_file():
            seeds = [json.loads(line) for line in Path(args.seed_result).read_text().splitlines() if line.strip()]
            same_arch = [r for r in seeds if r["recipe"] == args.arch]  # none when the seed ran another arch
            if same_arch:
                seed = same_arch[-1]
                row |= {"seed_tokens_per_s": seed["tokens_per_s"], "seed_peak_gib": seed["peak_gib"],
                        "ratio": round(tokens_per_s / seed["tokens_per_s"], 2)}
        emit(row, args.out)


if __name__ == "__main__":
    main()
