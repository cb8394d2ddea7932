"""The same LoRA training with the base in full precision, nf4 and int8 (quantization.method): peak memory, tokens/s
and held-out loss, each method in its own process.

The model is Qwen2-0.5B's architecture at full size (or `--layers` deep; `--tiny`: the params file's model.tiny, for
a CPU), randomly initialised from its config, saved with a byte-level BPE trained on the built-in data, then loaded
and trained by lora_pipeline.train.training.build_trainer exactly as the train stage does (the one loader, QLoRA
preparation, the recipe's levers), from the recipe plus any `--set key=value`. The data is the built-in multilingual
reasoning set (data.builtin_rows, data.builtin_seed), split as the split stage splits it; the held-out loss is the
evaluate stage's (assistant tokens of the test rows), before training and after the same `--steps`.

    python benchmarks/quantization.py --recipe qwen2-0.5b --steps 30 --out bench/quantization.json
Prints one JSON line per method and a table; --out gets the list of them.
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

if "LOCAL_RANK" not in os.environ:  # one process, not under accelerate/torchrun: one GPU, as Trainer would otherwise
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")  # wrap the model in nn.DataParallel, which SFTTrainer refuses

import torch

from cli.recipes import apply_sets, compose
from lora_pipeline.config.params import Params, ParamsError, for_stage, validate

METHODS = ("none", "nf4", "int8")
WARM_STEPS = 2  # optimizer steps before the clock starts (allocations, kernel selection)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="qwen2-0.5b", help="a recipe: recipes/<name>.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a params key, e.g. quantization.compute_dtype=bfloat16")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--steps", type=int, default=30, help="timed optimizer steps, after %d warm-up steps" % WARM_STEPS)
    parser.add_argument("--layers", type=int, help="reduced depth (default: Qwen2-0.5B's 24)")
    parser.add_argument("--tiny", action="store_true", help="the params file's model.tiny sizes instead (a CPU run)")
    parser.add_argument("--checkpoint", default="/tmp/bench-quantization-base", help="where the random-init model goes")
    parser.add_argument("--out", help="write the list of results (JSON) here")
    parser.add_argument("--method", choices=METHODS, help=argparse.SUPPRESS)  # one method, in this process
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    args.params = benchmark_params(args.recipe, args.set, args.method or args.methods[0], args.steps)
    return args


def benchmark_params(recipe: str, sets: list[str], method: str, steps: int) -> Params:
    """The recipe with `sets` applied and quantization.method, validated; train for exactly the steps measured."""
    try:
        raw = compose(recipe)
    except ParamsError as exc:
        raise SystemExit(f"--recipe: {exc}") from None
    try:
        apply_sets(raw, sets)
    except ParamsError as exc:
        raise SystemExit(str(exc)) from None
    raw["quantization"]["method"] = method
    raw["train"]["checkpoint_steps"] = 0
    raw["train"]["sft"] |= {"max_steps": WARM_STEPS + steps, "num_train_epochs": 1, "logging_steps": 1}
    try:
        params = validate(raw, source=f"recipes/{recipe}.yaml")
    except ParamsError as exc:
        raise SystemExit(str(exc)) from None
    return for_stage(params, "benchmark", ["data", "model", "quantization", "split", "train", "lora"])


def builtin_split(data, split) -> tuple[list[dict], list[dict]]:
    """The built-in rows, split and de-duplicated as the split stage does."""
    from lora_pipeline.data import builtin as builtin_data
    from lora_pipeline.data.splitting import remove_test_prompts, split_rows

    train, test = split_rows(builtin_data.generate(data.builtin_rows, data.builtin_seed), split.test_size, split.seed)
    return remove_test_prompts(train, test)[0], test


def build_checkpoint(out: Path, rows: list[dict], tiny, layers: int | None) -> None:
    """Random-init Qwen2 (Qwen/Qwen2-0.5B's config, or the tiny sizes) saved with a BPE trained on the rows."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from lora_pipeline.model.tiny import tiny_qwen2, tokenizer_corpus, train_tokenizer

    train_tokenizer(tokenizer_corpus(rows), 1024, "tiny-qwen2", out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    if tiny is not None:
        model = tiny_qwen2(tokenizer, tiny)
    else:
        torch.manual_seed(0)
        config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                             num_hidden_layers=layers or 24, num_attention_heads=14, num_key_value_heads=2,
                             max_position_embeddings=131072, rope_theta=1e6, tie_word_embeddings=True,
                             rms_norm_eps=1e-6, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)


def measure(args) -> dict:
    """Train with one quantization.method through the train stage's trainer; time, memory and held-out loss."""
    from datasets import Dataset
    from transformers import TrainerCallback

    from lora_pipeline.model.chat import conversation
    from lora_pipeline.evaluate.heldout import heldout_loss
    from lora_pipeline.model.loading import load_tokenizer
    from lora_pipeline.train.training import build_trainer

    params, gpu = args.params, torch.cuda.is_available()
    train_rows, test_rows = builtin_split(params.data, params.split)
    heldout = [conversation(r) for r in test_rows]
    marks = {}

    class Clock(TrainerCallback):
        def on_step_end(self, a, state, control, **kwargs):
            if gpu:
                torch.cuda.synchronize()
            if state.global_step in (WARM_STEPS, WARM_STEPS + args.steps):
                marks[state.global_step] = (time.perf_counter(), state.num_input_tokens_seen)

    trainer, implementations = build_trainer(
        params, Path(args.checkpoint), Dataset.from_list([{"messages": conversation(r)} for r in train_rows]),
        Path(args.checkpoint).with_name(Path(args.checkpoint).name + f"-out-{args.method}"), callbacks=[Clock()])
    model_gib = torch.cuda.memory_allocated() / 2**30 if gpu else 0.0
    tokenizer = load_tokenizer(args.checkpoint)

    trainer.train()
    trainer.model.eval()
    with torch.no_grad(), trainer.accelerator.autocast():
        after = heldout_loss(trainer.model, tokenizer, heldout, max_length=params.train.sft.max_length, batch_size=16)
        # LoRA starts as the identity (B = 0): the base alone is the model before training. Measured after it, as
        # bitsandbytes repacks 4-bit weights for CPU inference in a layout that cannot train afterwards.
        with trainer.model.disable_adapter():
            before = heldout_loss(trainer.model, tokenizer, heldout, max_length=params.train.sft.max_length,
                                  batch_size=16)
    (t0, k0), (t1, k1) = marks[WARM_STEPS], marks[WARM_STEPS + args.steps]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    import importlib.metadata as metadata

    return {"method": args.method, "quantization": params.quantization.dump(), "steps": args.steps,
            "warm_steps": WARM_STEPS, "tokens_per_s": round((k1 - k0) / (t1 - t0)),
            "step_s": round((t1 - t0) / args.steps, 4),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if gpu else 0.0,
            "model_gib": round(model_gib, 2),
            "heldout_loss_before": round(before["loss"], 4), "heldout_loss": round(after["loss"], 4),
            "heldout_rows": len(heldout), "heldout_tokens": after["tokens"],
            "train_loss_first": losses[0], "train_loss_last": losses[-1],
            "micro_batch": params.train.sft.per_device_train_batch_size, "max_length": params.train.sft.max_length,
            "model": "tiny" if args.tiny else f"qwen2-0.5b, {args.layers or 24} layers",
            "dtype": params.model.dtype, "implementations": implementations,
            "device": torch.cuda.get_device_name() if gpu else "cpu", "torch": torch.__version__,
            "bitsandbytes": metadata.version("bitsandbytes"), "date": time.strftime("%Y-%m-%d")}


def main(argv=None):
    args = parse_args(argv)
    checkpoint = Path(args.checkpoint)
    if not (checkpoint / "config.json").is_file():
        start = time.perf_counter()
        train_rows, _ = builtin_split(args.params.data, args.params.split)
        build_checkpoint(checkpoint, train_rows, args.params.model.tiny if args.tiny else None, args.layers)
        print(f"built the random-init base in {checkpoint} in {time.perf_counter() - start:.0f} s", flush=True)
    if args.method:
        print(json.dumps(measure(args)), flush=True)
        return
    results = []
    for method in args.methods:  # a process each: its own peak memory, nothing left over from the last
        proc = subprocess.run([sys.executable, __file__, *(sys.argv[1:] if argv is None else argv), "--method", method,
                               "--checkpoint", args.checkpoint], capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode == 0 and lines:
            results.append(json.loads(lines[-1]))
        else:  # recorded, and the other methods still measured
            results.append({"method": method, "error": f"exit {proc.returncode}: {proc.stderr[-3000:]}"})
        print(json.dumps(results[-1]), flush=True)
    print(f"\n{'method':8} {'tokens/s':>9} {'peak GiB':>9} {'model GiB':>10} {'held-out loss':>22}")
    for r in results:
        if "error" in r:
            print(f"{r['method']:8} failed: {r['error'].strip().splitlines()[-1][:100]}")
        else:
            print(f"{r['method']:8} {r['tokens_per_s']:>9,} {r['peak_gib']:>9} {r['model_gib']:>10} "
                  f"{r['heldout_loss_before']:>10} -> {r['heldout_loss']:<8}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    if any("error" in r for r in results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
