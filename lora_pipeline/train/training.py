"""The train stage's trainer (TRL's SFTTrainer over LoRA) with the speed levers params choose, shared with the benchmark."""
from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import time
from pathlib import Path

import torch
from accelerate import PartialState
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
import trl.trainer.utils
from trl import SFTConfig, SFTTrainer

from lora_pipeline.families.gpt_oss.mxfp4_experts import pack_experts
from lora_pipeline.families.gpt_oss.packed_masks import mask_packed_rows
from lora_pipeline.families.gpt_oss.rules import MXFP4_EXPERTS
from lora_pipeline.launch.ancestors import any_gone, dvc_ancestors
from lora_pipeline.launch.checkpoints import write_manifest
from lora_pipeline.model.base_checks import BITSANDBYTES
from lora_pipeline.model.loading import apply_liger, load_model, load_tokenizer, lora_config, training_device_map
from lora_pipeline.train.global_batch import split_global_batch
from lora_pipeline.train.prepared_rows import PreparedRowsSFTTrainer, weight_zero_turns
from lora_pipeline.train.sft_args import train_sft_args

log = logging.getLogger(__name__)


def sft_args(sft: dict, output_dir: Path, checkpoint_steps: int, global_batch_size: int = 0) -> tuple[SFTConfig, dict]:
    """SFTConfig from train.sft plus what the stage owns (output folder, checkpoints, logging), its micro-batch and
    accumulation split from train.global_batch_size over this launch's processes where that is set; and the levers
    as they will run on this machine, with the reason for any that cannot."""
    on_gpu = torch.cuda.is_available()
    sft, notes = dict(sft), []
    if sft["torch_compile"] and not on_gpu:
        notes.append("torch_compile is off on the CPU (compiling there costs more than it saves)")
        sft["torch_compile"] = False
    # Padding-free without packing: TRL truncates the rows to max_length while preparing the data set, but refuses
    # padding_free=True together with max_length (trl 1.16). The collator is switched after preparation instead.
    padding_free_rows = sft["padding_free"] and not sft["packing"]
    if padding_free_rows:
        sft["padding_free"] = False
    # Non-reentrant checkpointing (what LoRA over a frozen base needs); every_n_layers and offload pass through
    sft["gradient_checkpointing_kwargs"] = ({"use_reentrant": False, **sft.get("gradient_checkpointing_kwargs", {})}
                                            if sft["gradient_checkpointing"] else None)
    args = SFTConfig(**sft, **train_sft_args(output_dir, checkpoint_steps, on_gpu))
    if global_batch_size:  # the world size is known once SFTConfig has set up the processes' state
        processes, largest = args.world_size, args.per_device_train_batch_size
        micro, accumulation = split_global_batch(global_batch_size, largest, args.gradient_accumulation_steps,
                                                 processes, f"the {processes} processes of this launch")
        # set as TrainingArguments.set_training sets them: the Trainer reads both when it is built
        args.per_device_train_batch_size, args.gradient_accumulation_steps = micro, accumulation
        share = global_batch_size // processes
        if micro < min(share, largest):
            notes.append(f"micro-batch {micro}: the largest divisor of each process's {share} sequences a step at "
                         f"most train.sft.per_device_train_batch_size {largest}")
    levers = {"padding_free": padding_free_rows or args.padding_free, "packing": args.packing,
              "torch_compile": args.torch_compile, "gradient_checkpointing": args.gradient_checkpointing,
              "checkpointing_kwargs": args.gradient_checkpointing_kwargs,
              "sampling": args.train_sampling_strategy,
              "per_device_train_batch_size": args.per_device_train_batch_size,
              "gradient_accumulation_steps": args.gradient_accumulation_steps, "notes": notes}
    if global_batch_size:  # only then: the adapter's training_info.json of any other run stays as it was
        levers["global_batch_size"] = global_batch_size
    return args, levers


def build_block_masks_eagerly() -> None:
    """Flex attention's block masks built without torch.compile; the attention kernel itself stays compiled.
    transformers compiles `create_block_mask` for each new packed length: for gpt-oss-20b that made the first step
    slow on one GPU and kept every step from finishing on two (DDP). Built eagerly (a dense boolean pass over the
    packed length, the same tiles marked; transient memory grows with the square of the packed length), the first
    step is quicker and the timed steps run as fast (docs/performance.md has the figures)."""
    from torch.nn.attention import flex_attention
    from transformers import masking_utils

    def create_block_mask(*args, _compile=False, **kwargs):
        return flex_attention.create_block_mask(*args, _compile=False, **kwargs)

    masking_utils.create_block_mask = create_block_mask  # what transformers' flex_attention_mask calls


def block_masks_built(setting: str, processes: int) -> str:
    """How flex attention's block masks are built (train.flex_block_mask): auto is compiled in one process (faster
    for Qwen2-0.5B's compiled layers), eager in several, where compiled ones stalled (docs/performance.md)."""
    return setting if setting != "auto" else ("eager" if processes > 1 else "compiled")


def layers_compile(mode: str, device_type: str) -> bool:
    """Whether train.compile_layers compiles the decoder layers on this device: on a GPU only (on a CPU compiling
    costs more than it saves)."""
    return mode != "none" and device_type == "cuda"


def compile_decoder_layers(model, mode: str, device_type: str | None = None, backend: str = "inductor") -> dict:
    """Each decoder layer (the model's repeated block, LoRA included) compiled in place by torch.compile with `mode`
    ("default" or another torch.compile mode), so Inductor fuses LoRA's dropout, scaling and add, the norms, SwiGLU
    and RoPE, and a step launches far fewer kernels (a small model's step is bound by launching them). The first
    packed length compiles a static graph, a second one a graph over a symbolic length that serves every later one.
    On a CPU (device_type, default: where the model is) the layers stay eager: compiling costs more than it saves
    there. Returns what ran, to be recorded."""
    if mode == "none":
        return {"mode": "none"}
    if not layers_compile(mode, device_type or next(model.parameters()).device.type):
        return {"mode": "none", "requested": mode, "reason": "compiled layers need a GPU; eager on the CPU"}
    blocks = set(getattr(model.get_base_model() if hasattr(model, "get_base_model") else model,
                         "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in blocks]
    if not layers:
        raise ValueError(f"train.compile_layers: {mode}, but {type(model).__name__} names no repeated decoder layer "
                         "(_no_split_modules); set train.compile_layers: none")
    for layer in layers:
        layer.compile(backend=backend, mode=None if mode == "default" else mode)
    return {"mode": mode, "backend": backend, "layers": len(layers), "layer_class": type(layers[0]).__name__}


def _read_tensors(values: list) -> list:
    """A metric's values with the GPU tensors among them read as floats, in one transfer."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        return values
    read = iter(torch.stack(tensors).tolist())
    return [next(read) if isinstance(v, torch.Tensor) else v for v in values]


def check_lm_head_hook() -> None:
    """Fail, naming the setting, where this TRL has no trl.trainer.utils._use_triton for every_position_scored."""
    if not hasattr(trl.trainer.utils, "_use_triton"):
        raise RuntimeError("train.host_syncs: at_logging: this TRL no longer chooses its LM head's positions by "
                           "trl.trainer.utils._use_triton; use host_syncs: each_step, or the TRL of requirements.txt")


@contextlib.contextmanager
def every_position_scored():
    """TRL's tiled LM head (fused_lm_head) scores every position of the batch and masks the unlabelled ones after, as
    it does on devices without Triton. On a GPU it would first select the labelled positions with a boolean mask,
    which waits for the GPU to count them: twice in the forward and twice in the backward of every micro-step. The
    unlabelled positions then cost their share of the LM head: few in padding-free rows of whole conversations."""
    check_lm_head_hook()
    chosen = trl.trainer.utils._use_triton
    trl.trainer.utils._use_triton = lambda device: False
    try:
        yield
    finally:
        trl.trainer.utils._use_triton = chosen


class SyncFreeSFTTrainer(PreparedRowsSFTTrainer):
    """SFTTrainer whose own code does not wait for the GPU between logs (train.host_syncs: at_logging). TRL's
    entropy, token accuracy and token count and the Trainer's count of input tokens stay GPU tensors until a step is
    logged or a checkpoint saved; the Trainer's stand-in for a nan or inf loss (the mean of the losses since the last
    log) is chosen on the GPU; TRL's LM head scores every position (every_position_scored). The figures logged are
    those TRL and the Trainer log, read later. The loss is TRL's (with an MoE's router aux loss, as TRL adds it);
    whatever else TRL's compute_loss handles (a compute_loss_func, label smoothing, sequence or tensor parallelism,
    evaluation) runs TRL's own code."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._nan_filter_on_gpu, self.args.logging_nan_inf_filter = self.args.logging_nan_inf_filter, False
        self._pending_tokens = None  # [TRL's num_tokens, the Trainer's num_input_tokens_seen] since last read

    def _plain_loss(self, return_outputs: bool) -> bool:
        config = getattr(self.accelerator, "parallelism_config", None)
        return (self.model.training and not return_outputs and self.compute_loss_func is None
                and self.label_smoother is None and self._tp_size == 1
                and not (config is not None and config.sp_enabled))

    def _count(self, which: int, tokens) -> None:
        """Add to TRL's token count (0) or the Trainer's (1), on the GPU."""
        if self._pending_tokens is None:
            self._pending_tokens = torch.zeros(2, dtype=torch.int64, device=self.args.device)
        self._pending_tokens[which] += tokens

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not self._plain_loss(return_outputs):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        inputs["use_cache"] = False
        if self.aux_loss_enabled:  # MoE (gpt-oss): the router's load-balancing loss, as TRL adds it
            inputs["output_router_logits"] = True
        with every_position_scored():
            outputs = model(**inputs, fused_lm_head=True)  # as TRL: its tiled LM head, log-probs of the labels only
        per_token_loss = -outputs.log_probs
        if self.args.loss_type == "dft":
            per_token_loss = per_token_loss * outputs.log_probs.exp().detach()
        num_tokens = outputs.label_mask.sum() if num_items_in_batch is None else num_items_in_batch
        loss = per_token_loss.sum() / torch.as_tensor(num_tokens).clamp(min=1)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * self.accelerator.num_processes
        if self.aux_loss_enabled:
            steps = self.current_gradient_accumulation_steps if num_items_in_batch is not None else 1
            loss = loss + self.router_aux_loss_coef * outputs.aux_loss / steps
        with torch.no_grad():
            gather = self.accelerator.gather_for_metrics
            valid = gather(outputs.label_mask.sum()).sum()
            for key, total in (("entropy", outputs.entropy.detach().sum()), ("mean_token_accuracy",
                                                                             outputs.is_top1.sum())):
                mean = gather(total).sum() / valid.clamp(min=1)
                self._metrics["train"][key].append(torch.where(valid > 0, mean, 0.0))
            if self.aux_loss_enabled:
                self._metrics["train"]["aux_loss"].append(gather(outputs.aux_loss.detach()).mean())
            # TRL's num_tokens: the attention mask's ones, or the packed length (padding-free)
            self._count(0, inputs["attention_mask"].sum() if "attention_mask" in inputs
                        else inputs["position_ids"].size(1))
        return loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self._nan_filter_on_gpu:
            since_log = 1 + self.state.global_step - self._globalstep_last_logged
            loss = torch.where(torch.isfinite(loss), loss, self._tr_loss / since_log)
        return loss

    def _track_num_input_tokens(self, inputs):
        counted = self.args.include_num_input_tokens_seen
        pad = getattr(self.processing_class, "pad_token_id", None)
        if counted == "no" or "input_ids" not in inputs:
            return super()._track_num_input_tokens(inputs)
        ids = inputs["input_ids"]
        if counted == "non_padding" and "attention_mask" in inputs:
            self._count(1, inputs["attention_mask"].sum())
        elif counted == "non_padding" and pad is not None:
            self._count(1, (ids != pad).sum())
        else:
            self._count(1, ids.numel())

    def _read_pending(self) -> None:
        """The figures kept on the GPU, read: one transfer (and, over several processes, one reduction)."""
        metrics = self._metrics["train"]
        for key in ("entropy", "mean_token_accuracy", "aux_loss"):
            if metrics.get(key):
                metrics[key] = _read_tensors(metrics[key])
        if self._pending_tokens is not None:
            trained, seen = self.accelerator.reduce(self._pending_tokens, reduction="sum").tolist()
            self._pending_tokens.zero_()
            self._total_train_tokens += trained
            if trained or "num_tokens" in metrics:
                metrics["num_tokens"] = [self._total_train_tokens]
            self.state.num_input_tokens_seen += seen

    def log(self, logs, start_time=None):
        self._read_pending()
        super().log(logs, start_time)

    def _save_checkpoint(self, model, trial):
        self._read_pending()  # the token counts go into trainer_state.json
        super()._save_checkpoint(model, trial)


def build_trainer(params, base: Path, train_set, output_dir: Path, callbacks=()) -> tuple[SFTTrainer, dict]:
    """SFTTrainer for the `model`, `quantization`, `train` and `lora` params, and a record of what runs."""
    args, levers = sft_args(params.train.sft.dump(), output_dir, params.train.checkpoint_steps,
                            params.train.global_batch_size)
    if args.assistant_only_loss and "messages" not in train_set.column_names:
        levers["notes"].append("assistant_only_loss is off: text rows have no assistant turns, every token is trained")
        args.assistant_only_loss = False
    weight_zero = weight_zero_turns(train_set)
    if weight_zero and not args.assistant_only_loss:
        raise SystemExit(f"train: {weight_zero} assistant turns of the training data have weight 0 (context, not a "
                         "target), but train.sft.assistant_only_loss is false: the whole sequence would be trained, "
                         "those turns included; set train.sft.assistant_only_loss: true in params.yaml")
    sync_free = params.train.host_syncs == "at_logging"
    if sync_free:  # before the model loads, which takes minutes at full size
        check_lm_head_hook()
    tokenizer = load_tokenizer(base, trust_remote_code=params.model.trust_remote_code)
    model = load_model(base, params.model, params.quantization, device_map=training_device_map())
    model.config.use_cache = False
    packed_row_masks = mask_packed_rows(model) if levers["padding_free"] or levers["packing"] else None
    packed = None
    if params.model.experts_implementation == MXFP4_EXPERTS:  # the frozen experts back in MXFP4, before LoRA
        packed = pack_experts(model, params.lora.target_parameters, params.train.experts_kept_16bit)
        if args.ddp_broadcast_buffers is None:  # DDP would send the packed experts (buffers) before every forward
            args.ddp_broadcast_buffers = False
    quantized = sum(type(m).__name__ in ("Linear4bit", "Linear8bitLt") for m in model.modules())
    if params.quantization.method in BITSANDBYTES:  # QLoRA: the 4/8-bit base frozen, its other weights in float32
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=args.gradient_checkpointing,
                                                gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
    compiling = layers_compile(params.train.compile_layers, next(model.parameters()).device.type)
    liger = apply_liger(model, params.train.liger, declined="train.compile_layers: Inductor fuses the compiled layers' "
                        "norms, SwiGLU and RoPE itself, and Liger's Triton kernels do not compile under it"
                        if compiling else None)
    if sync_free:  # the batch copied to the GPU without waiting (the data loader pins its memory)
        args.accelerator_config.non_blocking = True
    trainer = (SyncFreeSFTTrainer if sync_free else PreparedRowsSFTTrainer)(
        model=model, args=args, train_dataset=train_set, processing_class=tokenizer,
        peft_config=lora_config(params.lora), callbacks=list(callbacks))
    trainer.add_callback(LogLastAndSavedSteps())  # last: after the callbacks that decide a step's checkpoint
    if levers["padding_free"] and not args.padding_free:
        trainer.data_collator.padding_free = trainer.padding_free = True
    if args.bf16 or args.fp16:
        # Under autocast the LoRA matmuls run in 16 bits anyway: peft's cast of every LoRA input to the adapters'
        # float32 only moves bytes (a sizeable share of a step's GPU time: docs/performance.md, Levers).
        from peft.tuners.tuners_utils import BaseTunerLayer

        for module in trainer.model.modules():
            if isinstance(module, BaseTunerLayer):
                module.cast_input_dtype_enabled = False
        levers["lora_input_cast"] = False
    block_mask = None
    if model.config._attn_implementation == "flex_attention":
        if trainer.accelerator.num_processes > 1:
            # DDP's graph splitter (DDPOptimizer) gets in the way of compiling flex attention (pytorch #137481). The
            # compiled attention holds no parameters, so there are no gradient buckets to split it by.
            torch._dynamo.config.optimize_ddp = False
        block_mask = block_masks_built(params.train.flex_block_mask, trainer.accelerator.num_processes)
        if block_mask == "eager":
            build_block_masks_eagerly()
    compiled = compile_decoder_layers(trainer.model, params.train.compile_layers)
    record = {"distributed": trainer.accelerator.distributed_type.value, "processes": trainer.accelerator.num_processes,
              "quantization": params.quantization.method, "quantized_layers": quantized,
              "attention": model.config._attn_implementation, "block_mask": block_mask,
              "experts": getattr(model.config, "_experts_implementation", None), "liger": liger, **levers}
    if packed:  # only then: the adapter's training_info.json of any other run stays as it was
        record["packed_experts"] = {**packed, "ddp_broadcast_buffers": args.ddp_broadcast_buffers}
    if packed_row_masks:  # likewise
        record["packed_row_masks"] = packed_row_masks
    if params.train.compile_layers != "none":  # likewise
        record["compiled_layers"] = compiled
    if sync_free:  # likewise
        record["host_syncs"] = {"setting": "at_logging", "non_blocking_copies": args.dataloader_pin_memory,
                                "trainer": type(trainer).__name__, "lm_head": "every position"}
    log.warning("training with %s", record)
    return trainer, record


def trainable_tensors(model) -> dict[str, torch.Tensor]:
    """The trainable (LoRA) tensors, whole, on the CPU. Under FSDP2 each is a shard (a DTensor), gathered here: a
    collective, so every process calls it."""
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
            for name, p in model.named_parameters() if p.requires_grad}


def save_adapter(trainer: SFTTrainer, folder: Path) -> None:
    """The adapter (and tokenizer) to `folder`; every process calls it, rank 0 writes. Under FSDP only the trainable
    LoRA tensors are gathered: Trainer.save_model would first gather the whole model's state dict on the CPU, slow
    for a large model (docs/gpu-runs.md), to keep the adapter's share of it."""
    if not trainer.is_fsdp_enabled:
        trainer.save_model(str(folder))  # DeepSpeed ZeRO-3 gathers its partitions here
        return
    lora = trainable_tensors(trainer.model)
    if trainer.is_world_process_zero():
        trainer.accelerator.unwrap_model(trainer.model).save_pretrained(folder, state_dict=lora)
        trainer.processing_class.save_pretrained(folder)
    trainer.accelerator.wait_for_everyone()


class StopOnSignal(TrainerCallback):
    """SIGTERM or SIGINT, Slurm's SIGUSR1 ahead of a time limit, or the launcher or DVC gone: finish the current
    optimizer step, save a checkpoint, and stop, so a re-run resumes with no step lost. Every process stops at the
    same step (the flag is reduced across them)."""

    def __init__(self):
        self.received = None
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, self._note)
        # A worker whose launcher died (even by SIGKILL) is re-parented: it stops the same way instead of training
        # on as an orphan beside the next run. So does one whose DVC died: DVC exits on SIGTERM without stopping the
        # stage's launcher, whose training could then no longer be recorded and would hold the run's lock.
        self.launcher = os.getppid()
        self.ancestors = dvc_ancestors()
        self.group = None

    def _note(self, signum, frame):
        self.received = signum

    def _any_process(self, stop: bool) -> bool:
        """Whether any process stops, agreed over a CPU (gloo) group: asking over the GPUs' group would make every
        step wait for the GPU."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return stop
        if self.group is None:  # every process reaches its first step end, and creates the group there together
            self.group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        flag = torch.tensor(float(stop))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag)

    def on_step_end(self, args, state, control, **kwargs):
        if self.received is None and (os.getppid() != self.launcher or any_gone(self.ancestors)):
            self.received = signal.SIGTERM
        if self._any_process(self.received is not None):
            self.received = self.received or signal.SIGTERM
            control.should_save = control.should_training_stop = True
        return control


class LogLastAndSavedSteps(TrainerCallback):
    """Logs the last step, and each step a checkpoint is saved at, whatever logging_steps says: the log then covers
    every step, and a resumed run's log (the checkpoint's) ends at the step it resumes from."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps or control.should_save:
            control.should_log = True
        return control


def mean_train_loss(log_history: list[dict]) -> float | None:
    """The mean loss over the logged steps: each logged loss (the mean over the steps since the log before it) weighed
    by the steps it covers. With every step logged (LogLastAndSavedSteps), the Trainer's training_loss of a run that
    was not resumed, and the same for one that was (the Trainer's figure then covers only the steps since the resume).
    fsum: exactly rounded, so the same bytes on every Python (3.12's sum() adds floats in another way)."""
    logged = [entry for entry in log_history if "loss" in entry]
    if not logged:
        return None
    covered = [entry["step"] - before for entry, before in zip(logged, [0] + [e["step"] for e in logged[:-1]])]
    return math.fsum(entry["loss"] * steps for entry, steps in zip(logged, covered)) / logged[-1]["step"]


class WriteManifest(TrainerCallback):
    """After each checkpoint, the main process records its files' sizes and hashes (checkpoints.write_manifest),
    last: Trainer._save_checkpoint has each process write its own rng_state file with no barrier after it, so all
    processes first wait for each other here."""

    def on_save(self, args, state, control, **kwargs):
        PartialState().wait_for_everyone()
        if state.is_world_process_zero:
            write_manifest(Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")


class StepClock(TrainerCallback):
    """How long the first optimizer step of this process took (compiling, autotuning and the caches' first fill land
    there) against the steps after it (their median), for logs/train_speed.json."""

    def __init__(self):
        self._last, self.step_seconds = None, []

    def on_train_begin(self, args, state, control, **kwargs):
        self._last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.step_seconds.append(now - self._last)
        self._last = now

    def figures(self) -> dict:
        later = sorted(self.step_seconds[1:])
        return {"first_step_seconds": self.step_seconds[0] if self.step_seconds else None,
                "later_step_seconds": later[len(later) // 2] if later else None}


def compile_figures() -> dict:
    """What torch.compile did in this process: seconds in Dynamo's compile (Inductor's included), the graphs it
    compiled, and the hits and misses of Inductor's and AOTAutograd's caches (a warm cache: hits, no misses)."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    cache = {f"{kind}_{outcome}": counters[group][f"{key}_{outcome}"]
             for kind, group, key in (("inductor", "inductor", "fxgraph_cache"),
                                      ("autograd", "aot_autograd", "autograd_cache"))
             for outcome in ("hit", "miss")}
    return {"seconds": sum(compilation_time_metrics.get("_compile.compile_inner", [])),
            "graphs": counters["stats"]["unique_graphs"], **cache}


class LiveMetrics(TrainerCallback):
    """Each logged step's loss, learning rate, grad norm and epoch, the tokens/s since the previous log (all
    processes' non-padding tokens) and, on a GPU, memory allocated and its peak, handed to `sink.record(step, figures)`
    (rank 0's tracking.LiveRun)."""

    def __init__(self, sink):
        self.sink, self._mark = sink, None

    def on_train_begin(self, args, state, control, **kwargs):
        self._mark = (time.perf_counter(), state.num_input_tokens_seen)  # after a resume: the restored count

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "loss" not in logs:  # the end-of-training summary: register logs the stage's own metrics
            return
        now, tokens = time.perf_counter(), state.num_input_tokens_seen
        figures = {k: float(logs[k]) for k in ("loss", "learning_rate", "grad_norm", "epoch")
                   if isinstance(logs.get(k), (int, float))}
        figures["tokens_per_s"] = (tokens - self._mark[1]) / max(now - self._mark[0], 1e-9)
        if torch.cuda.is_available():
            figures["gpu_memory_gib"] = torch.cuda.memory_allocated() / 2**30
            figures["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        self._mark = (now, tokens)
        self.sink.record(state.global_step, figures)
