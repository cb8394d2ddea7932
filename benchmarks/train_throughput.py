"""Training throughput of a recipe on GPUs, through the project's own code path, on the standard workload.

The model is the recipe's architecture at full size (or reduced depth), randomly initialised and saved to
disk first, then loaded exactly as the train stage loads it (models/base -> load_model, MXFP4 dequantized for
gpt-oss); LoRA, SFTConfig and Liger come from the recipe file. The workload is the seed baseline's
(../shared/bench/seed_baseline.py), so the two tokens/s figures compare as a ratio on one machine.

    accelerate launch --config_file configs/accelerate/multi_gpu_2.yaml benchmarks/train_throughput.py \
        --recipe recipes/qwen2-0.5b.yaml --arch qwen2-0.5b --out results.jsonl
Prints one JSON line: tokens/s over all processes (non-padding tokens after warm-up), peak GiB per GPU, loss.
"""
import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lora_pipeline.params import StageParams, validate  # noqa: E402
from lora_pipeline.modeling import apply_liger, load_model, lora_config, training_device_map  # noqa: E402

# The seed baseline's standard workloads (same generator, same seeds).
WORKLOADS = {
    "qwen2-0.5b": dict(n=2000, median=600, sigma=0.7, lo=32, hi=4096, vocab=151936, seed=1),
    "gpt-oss-20b": dict(n=200, median=900, sigma=0.6, lo=64, hi=4096, vocab=201088, seed=2),
}
WARM_STEPS = {"qwen2-0.5b": 3, "gpt-oss-20b": 2}


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

    from lora_pipeline import builtin_data
    from lora_pipeline.chat import conversation
    from lora_pipeline.tiny_models import tokenizer_corpus, train_tokenizer

    rows = builtin_data.generate(n, seed)
    with tempfile.TemporaryDirectory() as tmp:
        train_tokenizer(tokenizer_corpus(rows), 1024, "tiny-qwen2", Path(tmp))
        tok = AutoTokenizer.from_pretrained(tmp)
    return [{"input_ids": list(tok.apply_chat_template(conversation(r), tokenize=True, return_dict=True)["input_ids"])}
            for r in rows]


def build_checkpoint(arch: str, layers: int | None, out: Path) -> None:
    """Random-init model of the real config, saved as the train stage would find it in models/base."""
    from transformers import GptOssConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    from tokenizers import Tokenizer, models

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "<unk>": 2},
                                                                              unk_token="<unk>")),
                                  pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    torch.manual_seed(0)
    if arch == "qwen2-0.5b":  # Qwen/Qwen2-0.5B's config.json
        cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers or 24,
                          num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=131072,
                          rope_theta=1e6, tie_word_embeddings=True, rms_norm_eps=1e-6, use_cache=False)
        with torch.device("cuda"):
            model = Qwen2ForCausalLM(cfg)
        model.save_pretrained(out)
    else:  # openai/gpt-oss-20b's config.json, experts written in MXFP4 like the released checkpoint
        from lora_pipeline.mxfp4 import save_mxfp4_checkpoint
        from transformers import GptOssForCausalLM

        n = layers or 24
        cfg = GptOssConfig(num_hidden_layers=n, num_local_experts=32, num_experts_per_tok=4, vocab_size=201088,
                           hidden_size=2880, intermediate_size=2880, head_dim=64, num_attention_heads=64,
                           num_key_value_heads=8, sliding_window=128, use_cache=False,
                           layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)])
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("cuda"):
                model = GptOssForCausalLM(cfg)
        finally:
            torch.set_default_dtype(torch.float32)
        save_mxfp4_checkpoint(model, out)
    tok.save_pretrained(out)
    del model
    torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True, help="a recipes/*.yaml file")
    parser.add_argument("--arch", choices=sorted(WORKLOADS), required=True)
    parser.add_argument("--layers", type=int, help="reduced depth (default: the real one)")
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps after warm-up")
    parser.add_argument("--workload", choices=["standard", "builtin"], default="standard",
                        help="standard: the seed baseline's random token ids (for tokens/s); builtin: real text")
    parser.add_argument("--liger", choices=["recipe", "on", "off"], default="recipe")
    parser.add_argument("--checkpoint", default="/tmp/bench-base", help="where the random-init model is written")
    parser.add_argument("--out", help="append the JSON line to this file")
    args = parser.parse_args()

    from accelerate import PartialState
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    state = PartialState()
    raw = yaml.safe_load(Path(args.recipe).read_text())
    params = validate(raw, source=args.recipe)
    view = StageParams(params, "benchmark", ["model", "train", "lora"])  # the sections this script reads
    model_p, train_p, lora_p = view.model, view.train, view.lora
    checkpoint = Path(args.checkpoint)
    if state.is_main_process and not (checkpoint / "config.json").is_file():
        start = time.perf_counter()
        build_checkpoint(args.arch, args.layers, checkpoint)
        print(f"built {args.arch} checkpoint in {time.perf_counter() - start:.0f}s", flush=True)
    state.wait_for_everyone()

    start = time.perf_counter()
    model = load_model(checkpoint, model_p, device_map=training_device_map())
    load_s = time.perf_counter() - start
    model.config.use_cache = False
    wanted = {"recipe": train_p.liger, "on": True, "off": False}[args.liger]
    liger = apply_liger(model, wanted)
    warm = WARM_STEPS[args.arch]
    sft = train_p.sft.to_dict() | {"max_steps": warm + args.steps, "logging_steps": 1, "num_train_epochs": 1}
    marks, tokens = {}, [0]

    class Clock(TrainerCallback):
        def on_step_end(self, a, s, control, **kwargs):
            torch.cuda.synchronize()
            if s.global_step in (warm, warm + args.steps):
                marks[s.global_step] = (time.perf_counter(), tokens[0])

    rows = workload(**WORKLOADS[args.arch]) if args.workload == "standard" else builtin_workload(2000, 0)
    config = SFTConfig(output_dir="/tmp/bench-out", report_to="none", save_strategy="no",
                       gradient_checkpointing_kwargs={"use_reentrant": False}, dataloader_pin_memory=False, **sft)
    trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_list(rows),
                         processing_class=AutoTokenizer.from_pretrained(checkpoint), peft_config=lora_config(lora_p),
                         callbacks=[Clock()])
    inner = trainer.data_collator

    def counting(features):
        batch = inner(features)
        tokens[0] += int((batch["labels"] != -100).sum())
        return batch

    trainer.data_collator = counting
    trainer.train()
    (t0, k0), (t1, k1) = marks[warm], marks[warm + args.steps]
    local = torch.tensor([k1 - k0, t1 - t0, torch.cuda.max_memory_allocated() / 2**30], device="cuda")
    gathered = trainer.accelerator.gather(local[None]).cpu()  # one row per process
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if state.is_main_process:
        row = {"arch": args.arch, "layers": args.layers or "full", "recipe": args.recipe, "processes": state.num_processes,
               "workload": args.workload,
               "tokens_per_s": round(float(gathered[:, 0].sum() / gathered[:, 1].max())),
               "step_s": round(float(gathered[:, 1].max()) / args.steps, 3),
               "peak_gib_per_gpu": [round(float(x), 1) for x in gathered[:, 2]], "load_s": round(load_s, 1),
               "loss_first": losses[0], "loss_last": losses[-1], "liger": liger["applied"],
               "liger_kernels": len(liger["kernels"]), "gpu": torch.cuda.get_device_name(),
               "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
