"""train: LoRA fine-tuning of models/base on data/split/train.jsonl with TRL's SFTTrainer, resumable.

Launched by accelerate, one process per device (dvc.yaml's cmd):
    accelerate launch --config_file configs/accelerate/cpu.yaml -m stages.train
Checkpoints go to checkpoints/train-<hash of params, code and data> every train.checkpoint_steps steps (and on
SIGTERM/SIGINT), each with a manifest of its files written last; a re-run with the same hash resumes from the
last one whose files still match it (newer, damaged ones are set aside into its damaged/ folder). Rank 0 alone
writes the adapter, metrics/train.json and plots/train_loss.csv; timings and the step a run resumed from go to
logs/train_speed.json, which is no DVC output, so identical trainings give identical outputs. Rank 0 also opens
the pipeline run's MLflow run (resumed after a kill) and sends it each logged step's figures as training goes
(lora_pipeline.train.tracking); the register stage completes that run.
"""
import csv
import io
import json
import os
import sys
import time
from pathlib import Path

import torch
from accelerate.utils import broadcast_object_list
from datasets import Dataset

from lora_pipeline.config import cpu_numerics, outputs
from lora_pipeline.config.outputs import read_jsonl, replace_dir, staging_dir, write_json, write_text
from lora_pipeline.config.params import ROOT, load_params
from lora_pipeline.launch.checkpoints import (clear_run, content_hash, hold_run_lock, last_complete, run_dir,
                                              run_fingerprint, stop_line)
from lora_pipeline.model.chat import training_rows
from lora_pipeline.train.prepared_rows import lost_line
from lora_pipeline.launch.stage_launch import seconds_since_launch
from lora_pipeline.train.training import (LiveMetrics, StepClock, StopOnSignal, WriteManifest, build_trainer,
                                          compile_figures, mean_train_loss, save_adapter)

BASE, TRAIN, ADAPTER = Path("models/base"), Path("data/split/train.jsonl"), Path("models/adapter")
METRICS, LOSS_LOG, SPEED = outputs.METRICS["train"], Path("plots/train_loss.csv"), Path("logs/train_speed.json")


def main():
    startup = seconds_since_launch()
    params = load_params("train")  # the validate stage has already refused what this machine cannot run
    fingerprint = run_fingerprint("train")
    checkpoints, live, resume, tokens_before = run_dir(fingerprint), None, None, 0
    if int(os.environ.get("RANK", "0")) == 0:  # the launcher's rank: accelerate's state is not set up yet
        lock = hold_run_lock(checkpoints)  # noqa: F841 (held until exit)
        resume = last_complete(checkpoints)  # the lock holder alone checks them and sets damaged ones aside
        if resume:
            tokens_before = json.loads((resume / "trainer_state.json").read_text())["num_input_tokens_seen"]
        from lora_pipeline.train.tracking import LiveRun  # rank 0 alone talks to MLflow

        exp_name = os.environ.get("DVC_EXP_NAME")
        live = LiveRun(params.register.experiment, fingerprint, ROOT, run_name=exp_name,
                       tags={"dvc_exp_name": exp_name or "workspace", "train_fingerprint": fingerprint})
    train_set = Dataset.from_list(training_rows(read_jsonl(TRAIN)))  # with tools, TRL passes them to the template
    stopper, clock = StopOnSignal(), StepClock()
    callbacks = [stopper, WriteManifest(), clock] + ([LiveMetrics(live)] if live else [])
    try:
        built = time.perf_counter()
        trainer, implementations = build_trainer(params, BASE, train_set, checkpoints, callbacks=callbacks)
        rank0 = trainer.is_world_process_zero()
        lost = lost_line(trainer.rows_lost, len(train_set), trainer.args.max_length)
        if rank0 and lost:
            print(lost, flush=True)
        resume = broadcast_object_list([resume])[0]  # rank 0's choice, for every process
        if rank0 and resume:
            print(f"resuming from {resume}", flush=True)
        start = time.perf_counter()
        build_seconds = start - built
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
        seconds = time.perf_counter() - start
    except BaseException:
        if live:
            live.finish("FAILED")
        raise
    if stopper.received:
        if live:
            live.finish("KILLED")  # a re-run resumes the run with the training
        if rank0:
            step = trainer.state.global_step
            print(stop_line("train", stopper.received, checkpoints / f"checkpoint-{step}", at_step=step), flush=True)
        sys.exit(128 + stopper.received)

    staged = staging_dir(ADAPTER) if rank0 else None
    trainer.accelerator.wait_for_everyone()
    save_adapter(trainer, ADAPTER.with_name(f".{ADAPTER.name}.tmp"))  # every rank: FSDP/DeepSpeed gather here
    if not rank0:
        return
    (staged / "training_args.bin").unlink(missing_ok=True)  # a pickle: nothing downstream needs to load it
    adapter_config = staged / "adapter_config.json"
    config = json.loads(adapter_config.read_text())
    for key in ("target_modules", "target_parameters"):  # peft keeps them as sets: sort for the same bytes each run
        if isinstance(config.get(key), list):
            config[key] = sorted(config[key])
    write_json(adapter_config, config)
    write_json(staged / "training_info.json", {"implementations": implementations,
                                               "world_size": trainer.args.world_size, "base": str(BASE)})
    replace_dir(staged, ADAPTER)

    history = [h for h in trainer.state.log_history if "loss" in h]
    write_json(METRICS, {
        # from the log, which a resumed run restores with its checkpoint: the same whether or not it was resumed
        "train_loss": mean_train_loss(history),
        "final_loss": history[-1]["loss"] if history else None,
        "steps": trainer.state.global_step,
        "world_size": trainer.args.world_size,
        # the batch that ran: sequences per optimizer step over all processes, and each process's split of them
        "global_batch_size": trainer.args.per_device_train_batch_size * trainer.args.gradient_accumulation_steps
                             * trainer.args.world_size,
        "micro_batch_size": trainer.args.per_device_train_batch_size,
        "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps,
        "tokens": trainer.state.num_input_tokens_seen,  # non-padding tokens over all processes
        "trainable_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "liger_applied": int(implementations["liger"]["applied"]),
        **trainer.rows_lost,  # what the cut at train.sft.max_length loses
    })
    rows = io.StringIO()
    writer = csv.DictWriter(rows, fieldnames=["step", "loss", "learning_rate", "grad_norm"], extrasaction="ignore",
                            lineterminator="\n")
    writer.writeheader()
    writer.writerows(history)
    write_text(LOSS_LOG, rows.getvalue())
    speed = {"seconds": seconds, "tokens_per_s": (trainer.state.num_input_tokens_seen - tokens_before) / seconds,
             "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0,
             "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
             "cpu_kernels": cpu_numerics.describe(),
             "world_size": trainer.args.world_size, "implementations": implementations,
             "resumed_from_step": int(resume.name.split("-")[1]) if resume else 0,
             # where a run's time goes before its steady pace: start-up, model load and trainer, the first step
             "startup_seconds": startup, "build_seconds": build_seconds, **clock.figures(),
             "compile": compile_figures()}
    write_json(SPEED, speed)
    clear_run(checkpoints)  # finished: nothing left to resume
    unsent = live.finish("FINISHED", adapter_hash=content_hash(ADAPTER))
    if unsent:
        print(unsent, flush=True)
    print(json.dumps({"metrics": json.loads(METRICS.read_text()), "speed": speed}, indent=2))


if __name__ == "__main__":
    main()
