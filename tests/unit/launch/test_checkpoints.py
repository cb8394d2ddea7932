"""A checkpoint is resumed only if its files are as its manifest recorded them; a damaged one is set aside, kept,
and the one before it is used (checkpoint folders of real files, no training); what a stopped training kept, and the
line that says so."""
import json
import re

import pytest
import torch
from safetensors.torch import save_file

from conftest import ROOT
from lora_pipeline.launch.checkpoints import (DAMAGED, MANIFEST, clear_run, content_hash, hold_run_lock,
                                              kept_checkpoint, last_complete, stop_line, write_manifest)


def write_checkpoint(run, step: int):
    """A checkpoint as the Trainer leaves it for one process, with the manifest the train stage writes last."""
    folder = run / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(step)
    save_file({"lora_A": torch.randn(8, 64, generator=generator), "lora_B": torch.randn(64, 8, generator=generator)},
              folder / "adapter_model.safetensors")
    torch.save({"state": {0: {"exp_avg": torch.randn(512, generator=generator)}}}, folder / "optimizer.pt")
    torch.save({"last_epoch": step}, folder / "scheduler.pt")
    torch.save({"cpu": torch.random.get_rng_state()}, folder / "rng_state.pth")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "num_input_tokens_seen": 10 * step}))
    write_manifest(folder)
    return folder


def cut_in_half(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def run(tmp_path):
    """A run's checkpoint folder holding checkpoint-4 and checkpoint-8, both whole."""
    run = tmp_path / "train-0123456789abcdef"
    for step in (4, 8):
        write_checkpoint(run, step)
    return run


def test_the_newest_whole_checkpoint_is_resumed(run):
    lines = []
    assert last_complete(run, report=lines.append) == run / "checkpoint-8"
    assert lines == [] and not (run / DAMAGED).exists()
    manifest = json.loads((run / "checkpoint-8" / MANIFEST).read_text())["files"]
    assert sorted(manifest) == ["adapter_model.safetensors", "optimizer.pt", "rng_state.pth", "scheduler.pt",
                                "trainer_state.json"]


DAMAGES = {
    "adapter cut in half": (lambda c: cut_in_half(c / "adapter_model.safetensors"),
                            r"adapter_model\.safetensors is \d+ bytes, \d+ were written"),
    "optimizer cut in half": (lambda c: cut_in_half(c / "optimizer.pt"),
                              r"optimizer\.pt is \d+ bytes, \d+ were written"),
    "scheduler missing": (lambda c: (c / "scheduler.pt").unlink(), r"scheduler\.pt is missing"),
    "no manifest": (lambda c: (c / MANIFEST).unlink(), rf"no {MANIFEST} \(its saving did not finish\)"),
    "manifest cut in half": (lambda c: cut_in_half(c / MANIFEST), rf"{MANIFEST} is unreadable"),
    "optimizer bytes changed": (lambda c: flip_a_byte(c / "optimizer.pt"), r"optimizer\.pt has other bytes"),
}


@pytest.mark.parametrize("damage", DAMAGES, ids=list(DAMAGES))
def test_a_damaged_checkpoint_is_set_aside_and_the_one_before_resumed(run, damage):
    harm, reason = DAMAGES[damage]
    harm(run / "checkpoint-8")
    kept = sorted(p.name for p in (run / "checkpoint-8").iterdir())
    lines = []
    assert last_complete(run, report=lines.append) == run / "checkpoint-4"
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"checkpoint-8 set aside in {run / DAMAGED}: ")
    assert re.search(reason, lines[0]), lines[0]
    assert not (run / "checkpoint-8").exists()
    assert sorted(p.name for p in (run / DAMAGED / "checkpoint-8").iterdir()) == kept, "set aside whole, not deleted"
    lines.clear()
    assert last_complete(run, report=lines.append) == run / "checkpoint-4" and lines == [], "the next lookup too"


def test_with_every_checkpoint_damaged_training_starts_from_step_0(run):
    cut_in_half(run / "checkpoint-8" / "adapter_model.safetensors")
    (run / "checkpoint-4" / "scheduler.pt").unlink()
    lines = []
    assert last_complete(run, report=lines.append) is None
    assert [line.split(" set aside")[0] for line in lines] == ["checkpoint-8", "checkpoint-4"]
    assert sorted(p.name for p in (run / DAMAGED).iterdir()) == ["checkpoint-4", "checkpoint-8"]
    assert last_complete(run.parent / "never-trained") is None


def test_a_step_damaged_twice_keeps_both(run):
    """A run resumed from checkpoint-4 writes checkpoint-8 again; damaged again, it is set aside beside the first."""
    (run / "checkpoint-8" / MANIFEST).unlink()
    last_complete(run, report=lambda line: None)
    write_checkpoint(run, 8)
    (run / "checkpoint-8" / "optimizer.pt").unlink()
    last_complete(run, report=lambda line: None)
    assert sorted(p.name for p in (run / DAMAGED).iterdir()) == ["checkpoint-8", "checkpoint-8.2"]


def test_damaged_checkpoints_are_invisible_to_rotation_and_outlive_the_finished_run(run):
    from transformers.trainer_utils import sort_checkpoints

    cut_in_half(run / "checkpoint-8" / "optimizer.pt")
    last_complete(run, report=lambda line: None)
    assert sort_checkpoints(str(run)) == [str(run / "checkpoint-4")], "the Trainer's rotation sees only checkpoint-4"
    clear_run(run)
    assert [p.name for p in run.iterdir()] == [DAMAGED] and (run / DAMAGED / "checkpoint-8" / "optimizer.pt").is_file()
    whole = run.parent / "whole-run"
    write_checkpoint(whole, 4)
    clear_run(whole)
    assert not whole.exists(), "a run with nothing set aside leaves nothing"


def test_the_checkpoint_kept_is_the_newest_whole_one_of_the_run_locked_since(tmp_path):
    import os
    import time

    older = tmp_path / "checkpoints" / "train-older"
    write_checkpoint(older, 50)
    hold_run_lock(older).close()
    os.utime(older / ".lock", (0, 0))  # locked by a run long ago
    started = time.time()
    assert kept_checkpoint(started, tmp_path) is None  # no training took a lock since
    run = tmp_path / "checkpoints" / "train-now"
    lock = hold_run_lock(run)
    assert kept_checkpoint(started, tmp_path) is None  # locked, nothing saved yet
    write_checkpoint(run, 4)
    write_checkpoint(run, 8)
    (run / "checkpoint-12").mkdir()  # being saved when the process died: no manifest
    assert kept_checkpoint(started, tmp_path) == run / "checkpoint-8"
    lock.close()


def test_stop_line_names_stage_signal_checkpoint_and_the_way_on():
    from pathlib import Path

    assert stop_line("train", 9, Path("checkpoints/train-ab/checkpoint-8")) == \
        "train stopped by SIGKILL (signal 9); kept: checkpoint checkpoints/train-ab/checkpoint-8 (step 8); " \
        "`dvc repro` resumes from it"
    assert stop_line("train", 15, Path("checkpoints/train-ab/checkpoint-12"), at_step=12).startswith(
        "train stopped by SIGTERM (signal 15) at step 12; kept: checkpoint checkpoints/train-ab/checkpoint-12")
    assert stop_line("evaluate", 15, None) == \
        "evaluate stopped by SIGTERM (signal 15); kept: no checkpoint; `dvc repro` runs it again"


def test_a_folder_hash_skips_python_bytecode_as_dvcignore_does(tmp_path):
    """run_fingerprint hashes the stage's folder deps as DVC does: .dvcignore keeps __pycache__ and *.pyc out."""
    package = tmp_path / "package"
    package.mkdir()
    (package / "module.py").write_text("x = 1\n")
    source_only = content_hash(package)
    (package / "__pycache__").mkdir()
    (package / "__pycache__" / "module.cpython-311.pyc").write_bytes(b"\x00bytecode")
    (package / "stray.pyc").write_bytes(b"\x00bytecode")
    assert content_hash(package) == source_only
    (package / "module.py").write_text("x = 2\n")
    assert content_hash(package) != source_only
    ignored = (ROOT / ".dvcignore").read_text().split()
    assert "__pycache__" in ignored and "*.pyc" in ignored

