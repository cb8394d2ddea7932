"""The train stage's trainer levers that can be checked on a CPU: flex attention with eagerly built block masks,
checkpointing every n layers, compiled decoder layers, FSDP2's gathered adapter."""
import multiprocessing

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, masking_utils

from lora_pipeline.model.loading import apply_liger
from lora_pipeline.train.training import (block_masks_built, build_block_masks_eagerly, compile_decoder_layers,
                                          mean_train_loss)


def test_eager_block_masks_keep_packed_rows_apart():
    """Two rows packed into one (padding-free, told apart by position_ids) under flex attention with eagerly built
    block masks give each row's logits as the row alone gives them under sdpa. In a process of its own, tried again
    once after a segfault: flex attention compiled on the CPU crashed while the other test worker ran (2026-12-03,
    not understood); a wrong result exits 1 and fails at once."""
    for _ in range(2):
        process = multiprocessing.get_context("spawn").Process(target=_packed_rows_apart)
        process.start()
        process.join()
        if process.exitcode != -11:  # SIGSEGV
            break
    assert process.exitcode == 0, f"the check's process exited with {process.exitcode}"


def _packed_rows_apart():
    build_block_masks_eagerly()
    assert masking_utils.create_block_mask.__module__ == "lora_pipeline.train.training"
    config = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    lengths = [150, 180]  # the packed length spans three 128-token tiles, a row boundary inside one of them
    ids = torch.randint(0, 97, (1, sum(lengths)))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    model.config._attn_implementation = "flex_attention"
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    model.config._attn_implementation = "sdpa"
    start = 0
    for n in lengths:
        with torch.no_grad():
            alone = model(input_ids=ids[:, start:start + n], use_cache=False).logits
        torch.testing.assert_close(packed[:, start:start + n], alone, rtol=1e-4, atol=1e-4)
        start += n


def _tiny_trainer(tmp_path, name, sets, arch="qwen2"):
    """build_trainer over a 4-layer Qwen2 (random init, word-level tokenizer), or a 2-layer gpt-oss stored in MXFP4
    (arch "gpt-oss"), with params.yaml plus `sets`."""
    import yaml
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from lora_pipeline.config.params import ROOT, for_stage, validate
    from cli.recipes import apply_sets
    from lora_pipeline.train.training import build_trainer

    base = tmp_path / ("base" if arch == "qwen2" else f"base-{arch}")
    if not base.is_dir():
        vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(95)}}
        tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
                                      pad_token="<pad>", eos_token="<eos>")
        torch.manual_seed(0)
        if arch == "qwen2":
            config = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, use_cache=False)
            Qwen2ForCausalLM(config).save_pretrained(base)
        else:
            from helpers import build_tiny_gpt_oss

            build_tiny_gpt_oss(base, vocab_size=97, pad_token_id=0, eos_token_id=1)
            sets = ["quantization.method=mxfp4-dequantize", *sets]
        tok.save_pretrained(base)
    elif arch != "qwen2":
        sets = ["quantization.method=mxfp4-dequantize", *sets]
    raw = apply_sets(yaml.safe_load((ROOT / "params.yaml").read_text()),
                     ["train.checkpoint_steps=0", "train.sft.max_steps=2", "train.sft.warmup_steps=0",
                      "lora.lora_dropout=0.0", "train.sft.assistant_only_loss=false", *sets])
    params = for_stage(validate(raw), "test", ["model", "quantization", "train", "lora"])
    rows = Dataset.from_list([{"input_ids": [(7 * i + j) % 95 + 2 for j in range(20 + i)]} for i in range(32)])
    return build_trainer(params, base, rows, tmp_path / name)


@pytest.mark.parametrize("steps, logging_steps, logged", [(2, 5, [2]), (5, 2, [2, 4, 5])])
def test_the_last_step_is_logged_and_train_loss_is_the_trainers_own(tmp_path, steps, logging_steps, logged):
    """Whatever logging_steps is, the last step is logged, and the mean over the log, each logged loss weighed by the
    steps it covers (metrics/train.json's train_loss), is the Trainer's training_loss."""
    trainer, _ = _tiny_trainer(tmp_path, "run", [f"train.sft.max_steps={steps}",
                                                 f"train.sft.logging_steps={logging_steps}"])
    output = trainer.train()
    assert [entry["step"] for entry in trainer.state.log_history if "loss" in entry] == logged
    assert mean_train_loss(trainer.state.log_history) == pytest.approx(output.training_loss, rel=1e-12)


def test_a_resumed_run_logs_its_checkpoint_step_and_ends_with_the_uninterrupted_train_loss(tmp_path):
    """A checkpoint's step is logged too (step 3 here, with logging_steps 2), so a run resumed from it finds every
    step before it in the restored log: its train_loss is the uninterrupted run's, where the Trainer's training_loss
    covers only the steps since the resume."""
    sets = ["train.sft.max_steps=5", "train.sft.logging_steps=2", "train.checkpoint_steps=3"]
    trainer, _ = _tiny_trainer(tmp_path, "run", sets)
    whole = trainer.train()
    assert [entry["step"] for entry in trainer.state.log_history if "loss" in entry] == [2, 3, 4, 5]
    trainer, _ = _tiny_trainer(tmp_path, "run", sets)
    resumed = trainer.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"))
    assert [entry["step"] for entry in trainer.state.log_history if "loss" in entry] == [2, 3, 4, 5]
    assert mean_train_loss(trainer.state.log_history) == pytest.approx(whole.training_loss, rel=1e-6)
    assert resumed.training_loss != pytest.approx(whole.training_loss, rel=1e-3)


def test_checkpointing_every_second_layer_reaches_the_layers_and_learns_the_same(tmp_path, monkeypatch):
    """train.sft.gradient_checkpointing_kwargs {every_n_layers: 2}: transformers recomputes layers 0 and 2 only,
    and the adapter after two steps is the one training without checkpointing gives. Also: TRL computes the loss
    through its tiled LM head over the backbone, never through the model's own forward, so Liger's fused linear
    cross-entropy (which replaces that forward) would never run: modeling.apply_liger leaves it out."""
    calls, forward = [], Qwen2ForCausalLM.forward
    monkeypatch.setattr(Qwen2ForCausalLM, "forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    adapters = {}
    for name, sets in {"none": [], "every-2": ["train.sft.gradient_checkpointing=true",
                                              "train.sft.gradient_checkpointing_kwargs={every_n_layers: 2}"]}.items():
        trainer, record = _tiny_trainer(tmp_path, name, sets)
        calls.clear()
        trainer.train()
        assert not calls and trainer.state.global_step == 2
        trainer.model(input_ids=torch.tensor([[2, 3, 4]]))  # what the model runs outside the loss: the patched forward
        assert calls == [1]
        layers = trainer.model.base_model.model.model.layers
        flags = [bool(layer.gradient_checkpointing) for layer in layers]
        assert flags == ([True, False, True, False] if sets else [False] * 4), (name, flags)
        assert record["checkpointing_kwargs"] == ({"use_reentrant": False, "every_n_layers": 2} if sets else None)
        adapters[name] = {k: v.detach().clone() for k, v in trainer.model.named_parameters() if v.requires_grad}
    for key, weight in adapters["none"].items():
        torch.testing.assert_close(adapters["every-2"][key], weight, rtol=1e-5, atol=1e-6)


def test_compiled_layers_stay_eager_on_the_cpu_and_compiled_ones_learn_the_same(tmp_path):
    """train.compile_layers on a CPU: the layers stay eager, the record says so and why. Compiled as on a GPU (dynamo
    and AOT autograd here; Inductor's own kernels are checked on the GPU by benchmarks/check_kernels.py), the four
    layers are traced once for all (one graph per shape, shared by the layers), and the adapter after two steps is
    the eager one."""
    from torch._dynamo.utils import counters

    trainer, record = _tiny_trainer(tmp_path, "cpu", ["train.compile_layers=default"])
    assert record["compiled_layers"] == {"mode": "none", "requested": "default",
                                         "reason": "compiled layers need a GPU; eager on the CPU"}
    layers = trainer.model.base_model.model.model.layers
    assert not any(layer._compiled_call_impl for layer in layers)
    adapters = {}
    for name in ("eager", "compiled"):
        trainer, record = _tiny_trainer(tmp_path, name, [])
        assert "compiled_layers" not in record  # a run without the lever records nothing new
        if name == "compiled":
            counters.clear()
            assert compile_decoder_layers(trainer.model, "default", device_type="cuda", backend="aot_eager") == {
                "mode": "default", "backend": "aot_eager", "layers": 4, "layer_class": "Qwen2DecoderLayer"}
        trainer.train()
        adapters[name] = {k: v.detach().clone() for k, v in trainer.model.named_parameters() if v.requires_grad}
    assert 0 < counters["stats"]["unique_graphs"] <= 8  # forward and backward for a shape or two, not per layer
    for key, weight in adapters["eager"].items():
        torch.testing.assert_close(adapters["compiled"][key], weight, rtol=1e-5, atol=1e-6)


@pytest.mark.e2e  # two training processes under torch.distributed.run
def test_compiled_layers_and_sync_free_steps_under_ddp_learn_what_eager_layers_learn(tmp_path):
    """The recipes' 8-GPU path, on 2 CPU processes (gloo): DDP over compiled decoder layers trains the adapter DDP
    over eager layers trains, and with train.host_syncs at_logging it logs the same figures (summed over both
    processes) and trains the same adapter."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    worker = Path(__file__).parents[2] / "ddp_levers_worker.py"  # tests/, beside helpers.py
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(worker), str(tmp_path)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "same").read_text() == "56"  # 7 projections x 4 layers x (A, B), each compared


@pytest.mark.parametrize("setting, processes, built", [("auto", 1, "compiled"), ("auto", 8, "eager"),
                                                       ("eager", 1, "eager"), ("compiled", 2, "compiled")])
def test_block_masks_built_as_set_or_by_process_count(setting, processes, built):
    assert block_masks_built(setting, processes) == built


def test_a_model_without_repeated_layers_is_refused_by_key():
    with pytest.raises(ValueError, match="train.compile_layers: default.*train.compile_layers: none"):
        compile_decoder_layers(torch.nn.Linear(2, 2), "default", device_type="cuda")


def test_liger_declined_by_another_lever_says_why():
    decision = apply_liger(torch.nn.Linear(2, 2), True, declined="train.compile_layers: reason")
    assert decision == {"applied": False, "reason": "train.compile_layers: reason", "kernels": []}


@pytest.mark.e2e  # two training processes under torch.distributed.run
def test_fsdp2_sharded_adapter_is_gathered_whole_and_reloads(tmp_path):
    """Two CPU processes (gloo), the LoRA model sharded by FSDP2 as the train stage's fsdp2 config shards it: the
    trainable tensors the stage saves under FSDP come back whole, and the adapter loads into a fresh base giving the
    unsharded model's logits."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    worker = Path(__file__).parents[2] / "fsdp2_adapter_worker.py"  # tests/, beside helpers.py
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(worker), str(tmp_path / "adapter")], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    assert result["kinds"] == ["DTensor"], result  # the LoRA weights really were sharded
    assert result["tensors"] == result["reference_tensors"] and result["max_tensor_diff"] == 0.0, result
    assert result["max_logit_diff"] < 1e-6, result



def _device_reads(trainer, step: int, files=("trainer.py", "sft_trainer.py", "training.py")) -> list[str]:
    """The places in `files` (by default TRL's, the Trainer's and this project's training code; None: anywhere, a
    backward's under accelerate's backward call) that read a tensor's value to the host (`.item()`, `bool()`,
    `.tolist()`, a selection by a boolean mask, forward or backward: on a GPU, each waits for it) during optimizer
    step `step`."""
    import traceback
    from pathlib import Path

    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import TrainerCallback

    reads = []
    aten = torch.ops.aten
    always = (aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
              aten.masked_scatter_backward.default)
    by_mask = (aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default)

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            masks = func in by_mask and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                            for i in args[1] if i is not None)
            if func in always or masks:
                frame = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename][-1]
                if files is None or Path(frame.filename).name in files:
                    reads.append(f"{Path(frame.filename).name}:{frame.lineno}")
            return func(*args, **(kwargs or {}))

    mode = Reads()

    class During(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == step - 1:
                mode.__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step:
                mode.__exit__(None, None, None)

    trainer.add_callback(During())
    return reads


def _logged_every_second_step(tmp_path, host_syncs: str, arch: str):
    """_tiny_trainer of 4 optimizer steps of 2 micro-steps each over padding-free rows, logged at steps 2 and 4."""
    return _tiny_trainer(tmp_path, host_syncs, [
        "train.sft.padding_free=true", "train.sft.max_steps=4", "train.sft.logging_steps=2",
        "train.sft.gradient_accumulation_steps=2", "train.sft.per_device_train_batch_size=4",
        f"train.host_syncs={host_syncs}"], arch=arch)


@pytest.mark.parametrize("arch", ["qwen2", "gpt-oss"])
def test_host_syncs_at_logging_read_nothing_between_logs_and_log_what_trl_logs(tmp_path, arch):
    """train.host_syncs: at_logging. A step that is not logged reads no value from the device in TRL's, the
    Trainer's or the project's code (TRL's own way reads several: the check can fail), and the logs are TRL's and
    the Trainer's own: loss, entropy, token accuracy, token counts, grad norm and (gpt-oss, an MoE) the router's aux
    loss, equal, also when one micro-step's loss is nan (the Trainer then logs the mean of the others in its place).
    The adapters are equal."""
    import math

    results = {}
    for setting in ("each_step", "at_logging"):
        trainer, record = _logged_every_second_step(tmp_path, setting, arch)
        assert trainer.aux_loss_enabled == (arch == "gpt-oss")
        assert (record.get("host_syncs", {}).get("trainer") == "SyncFreeSFTTrainer") == (setting == "at_logging")
        reads = _device_reads(trainer, step=3)
        compute_loss, calls = trainer.compute_loss, []

        def nan_once(*args, **kwargs):  # micro-step 3's loss is nan; its gradient is not
            calls.append(1)
            loss = compute_loss(*args, **kwargs)
            return loss + torch.tensor(math.nan) if len(calls) == 3 else loss

        trainer.compute_loss = nan_once
        trainer.train()
        assert len(calls) == 8
        logs = [{k: v for k, v in entry.items() if k not in ("train_runtime", "train_samples_per_second",
                                                              "train_steps_per_second", "train_tokens_per_second")}
                for entry in trainer.state.log_history]
        adapter = {k: v.detach().clone() for k, v in trainer.model.named_parameters() if v.requires_grad}
        results[setting] = logs, reads, adapter, trainer.state.num_input_tokens_seen
    each, free = results["each_step"], results["at_logging"]
    assert each[1] and not free[1], (each[1], free[1])
    assert len(each[0]) == 3 and all(math.isfinite(entry.get("loss", 0.0)) for entry in each[0])
    assert ("aux_loss" in each[0][0]) == (arch == "gpt-oss")
    assert free[0] == each[0]
    assert free[3] == each[3] > 0
    for key, weight in each[2].items():
        torch.testing.assert_close(free[2][key], weight, rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["qwen2", "gpt-oss"])
def test_at_logging_scores_every_position_where_trl_would_select_the_labelled_ones(tmp_path, monkeypatch, arch):
    """On a GPU with Triton, TRL's LM head selects the labelled positions by a boolean mask, forward and backward:
    four reads a micro-step, each a wait for the GPU. Under train.host_syncs at_logging it scores every position instead
    (training.every_position_scored): neither its forward nor its backward reads a value, and the step logs the
    loss, entropy and token accuracy TRL's selection logs, to float rounding. TRL is told it runs where Triton is
    (this CPU has none). Reads elsewhere are the tiny models' own on a CPU (sdpa's mask, eager experts)."""
    import trl.trainer.utils

    monkeypatch.setattr(trl.trainer.utils, "_use_triton", lambda device: True)
    results = {}
    for setting in ("each_step", "at_logging"):
        trainer, record = _logged_every_second_step(tmp_path, setting, arch)
        reads = _device_reads(trainer, step=3, files=None)
        trainer.train()
        results[setting] = [entry for entry in trainer.state.log_history if "loss" in entry], reads, record
    (each, each_reads, _), (free, free_reads, record) = results["each_step"], results["at_logging"]

    def lm_head(reads):  # TRL's selection in the forward (its utils.py), and its gradient under accelerate's backward
        return [read for read in reads if read.split(":")[0] in ("utils.py", "accelerator.py")]

    assert {"utils.py:1645", "utils.py:1648"} <= set(lm_head(each_reads)), each_reads  # the check can fail
    assert any(read.startswith("accelerator.py") for read in each_reads), each_reads
    assert lm_head(free_reads) == [], free_reads
    assert record["host_syncs"]["lm_head"] == "every position"
    assert trl.trainer.utils._use_triton(torch.device("cpu"))  # set back after each forward
    assert len(each) == len(free) == 2
    for logged, want in zip(free, each):
        for key in ("loss", "entropy", "mean_token_accuracy"):
            assert logged[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key


def test_at_logging_under_a_trl_without_the_lm_head_hook_fails_before_the_model_loads(tmp_path, monkeypatch):
    """A TRL that no longer has trl.trainer.utils._use_triton cannot score every position: build_trainer says so,
    naming the setting and the way on, before it loads the tokenizer or the model. each_step does not need the hook."""
    import trl.trainer.utils

    import lora_pipeline.train.training as training

    def no_loading(*args, **kwargs):
        raise AssertionError("loaded before the check")

    monkeypatch.delattr(trl.trainer.utils, "_use_triton")
    monkeypatch.setattr(training, "load_tokenizer", no_loading)
    with pytest.raises(RuntimeError, match=r"train.host_syncs: at_logging: .*use host_syncs: each_step"):
        _tiny_trainer(tmp_path, "hookless", ["train.host_syncs=at_logging"])
    with pytest.raises(AssertionError, match="loaded before the check"):
        _tiny_trainer(tmp_path, "hookless", ["train.host_syncs=each_step"])


def test_a_global_batch_trains_as_its_split_set_by_hand(tmp_path):
    """train.global_batch_size 16 with micro-batches of at most 4, in this one process: 4 x GA 4, trained exactly as
    that split set in train.sft trains."""
    derived, record = _tiny_trainer(tmp_path, "global", ["train.global_batch_size=16",
                                                         "train.sft.per_device_train_batch_size=4"])
    by_hand, _ = _tiny_trainer(tmp_path, "by-hand", ["train.sft.per_device_train_batch_size=4",
                                                     "train.sft.gradient_accumulation_steps=4"])
    assert (record["global_batch_size"], record["per_device_train_batch_size"],
            record["gradient_accumulation_steps"]) == (16, 4, 4)
    assert derived.train().training_loss == by_hand.train().training_loss
    assert derived.state.global_step == by_hand.state.global_step == 2
