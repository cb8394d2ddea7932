"""train: LoRA fine-tuning of models/base on data/split/train.jsonl with TRL's SFTTrainer.

Launched by accelerate, one process per device (dvc.yaml's cmd):
    accelerate launch --config_file configs/accelerate/cpu.yaml -m stages.train
Rank 0 alone writes the adapter, metrics/train.json and plots/train_loss.csv.
"""
import csv
import json
import time
from pathlib import Path

import torch
from datasets import Dataset
from trl import SFTConfig, SFTTrainer

from lora_pipeline.chat import conversation
from lora_pipeline.data import read_jsonl
from lora_pipeline.modeling import apply_liger, load_model, load_tokenizer, lora_config, training_device_map
from lora_pipeline.params import load_params

BASE, TRAIN, ADAPTER = Path("models/base"), Path("data/split/train.jsonl"), Path("models/adapter")
METRICS, LOSS_LOG = Path("metrics/train.json"), Path("plots/train_loss.csv")

params = load_params("train")
on_gpu = torch.cuda.is_available()
sft = params.train.sft.to_dict()
if not on_gpu and (sft["bf16"] or sft["fp16"]):
    raise SystemExit("train.sft.bf16/fp16 need a GPU; set both to false to train on the CPU")

tokenizer = load_tokenizer(BASE)
model = load_model(BASE, params.model, device_map=training_device_map())
model.config.use_cache = False
liger = apply_liger(model, params.train.liger)
train_set = Dataset.from_list([{"messages": conversation(row)} for row in read_jsonl(TRAIN)])

args = SFTConfig(
    output_dir=str(ADAPTER),
    **sft,
    use_cpu=not on_gpu,  # with MULTI_GPU launch on a CPU this makes the processes one DDP group over gloo
    save_strategy="no",
    report_to="none",  # the register stage sends the per-step log to MLflow, in the pipeline run's own run
    include_num_input_tokens_seen="non_padding",
    dataloader_num_workers=0,
    gradient_checkpointing_kwargs={"use_reentrant": False} if sft["gradient_checkpointing"] else None,
)
trainer = SFTTrainer(model=model, args=args, train_dataset=train_set, processing_class=tokenizer,
                     peft_config=lora_config(params.lora))
start = time.perf_counter()
result = trainer.train()
seconds = time.perf_counter() - start
trainer.save_model(str(ADAPTER))

if trainer.is_world_process_zero():
    tokens = trainer.state.num_input_tokens_seen  # non-padding tokens over all processes
    history = [h for h in trainer.state.log_history if "loss" in h]
    metrics = {
        "train_loss": result.training_loss,
        "final_loss": history[-1]["loss"] if history else None,
        "steps": trainer.state.global_step,
        "world_size": args.world_size,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "seconds": seconds,
        "trainable_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else 0.0,
        "liger_applied": int(liger["applied"]),
    }
    METRICS.parent.mkdir(exist_ok=True)
    METRICS.write_text(json.dumps(metrics, indent=2) + "\n")
    LOSS_LOG.parent.mkdir(exist_ok=True)
    with open(LOSS_LOG, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["step", "loss", "learning_rate", "grad_norm"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(history)
    info = {"liger": liger, "world_size": args.world_size, "device": str(model.device),
            "torch": torch.__version__, "base": str(BASE)}
    (ADAPTER / "training_info.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(metrics, indent=2))
