"""Interrupted training resumes from its last checkpoint, loses no step on SIGTERM, and ends where an
uninterrupted run ends; a checkpoint of other params is never resumed. A stage stopped by a signal ends with one
line, no traceback: the stage, the signal, the checkpoint kept and the way on."""
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load, load_file

from conftest import SHORT_RUN, edited_params, run, run_env, set_params
from lora_pipeline.launch.checkpoints import DAMAGED, MANIFEST

ADAPTER = "models/adapter/adapter_model.safetensors"
STEPS = SHORT_RUN["train.sft.max_steps"]
SIGTERM_STOP = "train stopped by SIGTERM (signal 15) at step "


@pytest.fixture(scope="module")
def short_repo(short_runs):
    """The short run's first clone (12 steps with a checkpoint every 2), back at its commit with the data ready and
    no training; the adapter and metrics of its one uninterrupted training, which DVC's run cache keeps but
    dvc.lock's commit does not know (every training here runs with --no-run-cache)."""
    clone = short_runs[0]
    reference, reference_metrics = load(clone.files[ADAPTER]), json.loads(clone.files["metrics/train.json"])
    forget_training(clone.repo)
    return clone.repo, reference, reference_metrics


def forget_training(repo):
    """Back to a workspace where training never ran: no train outputs, no train entry in dvc.lock."""
    run(["git", "checkout", "--", "dvc.lock", "params.yaml"], repo)
    for path in ("models/adapter", "metrics/train.json", "plots/train_loss.csv"):
        target = repo / path
        shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)


def run_facts(repo) -> dict:
    """What the train stage records beside its outputs: timings and the step it resumed from."""
    return json.loads((repo / "logs/train_speed.json").read_text())


def checkpoints(repo):
    """The manifests of the complete checkpoints (the train stage writes each one's manifest last)."""
    folder = repo / "checkpoints"
    return sorted(folder.glob(f"train-*/checkpoint-*/{MANIFEST}")) if folder.is_dir() else []


def step_of(checkpoint: Path) -> int:
    """The optimizer step a checkpoint folder (checkpoint-<step>) holds."""
    return int(checkpoint.name.split("-")[1])


def complete_checkpoints(repo) -> list:
    """The complete checkpoints' folders, oldest step first."""
    return sorted((p.parent for p in checkpoints(repo)), key=step_of)


def start_training(repo, accelerate_config="cpu"):
    """`dvc repro train` (never restored from DVC's run cache) in its own process group (so a kill reaches DVC, the
    launcher and the worker)."""
    set_params(repo, **{"train.accelerate_config": accelerate_config})
    return subprocess.Popen(["dvc", "repro", "--no-run-cache", "train"], cwd=repo, env=run_env(),
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_checkpoint_step(proc, repo, step):
    """Poll until a complete checkpoint at `step` or beyond exists; fail if training ends first."""
    while not any(step_of(p.parent) >= step for p in checkpoints(repo)):
        if proc.poll() is not None:
            pytest.fail(f"training ended before checkpoint {step}:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.2)


def workers(proc):
    """The training worker processes under DVC and the launcher (lora_pipeline.launch.stage_launch, or accelerate's)."""
    return [p for p in psutil.Process(proc.pid).children(recursive=True)
            if re.fullmatch(r"\S+ (-u )?-m stages\.train", " ".join(p.cmdline()))]


def running_workers(proc, what: str):
    """The training workers, once there are any; fails if the run ends first."""
    while not (found := workers(proc)):
        if proc.poll() is not None:
            pytest.fail(f"training ended before {what}:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.1)
    return found


def killed_training(repo, at_step, accelerate_config="cpu") -> tuple[int, str]:
    """Start training, SIGKILL DVC, the launcher and the workers (these stop at their next step when the launcher
    is gone) once a checkpoint at `at_step` exists; return the last complete checkpoint's step and the run's output."""
    proc = start_training(repo, accelerate_config)
    wait_for_checkpoint_step(proc, repo, at_step)
    training = workers(proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    psutil.wait_procs(training)
    return step_of(complete_checkpoints(repo)[-1]), proc.stdout.read()


def assert_same_adapter(repo, reference):
    resumed = load_file(repo / ADAPTER)
    assert resumed.keys() == reference.keys()
    worst = max((resumed[k] - reference[k]).abs().max().item() / reference[k].abs().max().item() for k in reference)
    assert worst < 1e-4, f"resumed adapter differs from the uninterrupted one by {worst:.3g} (relative)"


def sigterm_step(output: str) -> int:
    """The step a SIGTERM stopped the training at, read from its one line; fails the test without that line."""
    assert SIGTERM_STOP in output, output[-3000:]
    return int(output.split(SIGTERM_STOP)[1].split(";")[0])


def stopped_training(repo):
    """Start training, SIGTERM the worker once checkpoint 4 is complete; its output and return code."""
    proc = start_training(repo)
    wait_for_checkpoint_step(proc, repo, 4)
    for worker in running_workers(proc, "its SIGTERM"):
        worker.send_signal(signal.SIGTERM)
    output, _ = proc.communicate()
    return output, proc.returncode


def test_sigterm_to_the_worker_loses_no_step_and_a_damaged_newest_checkpoint_is_set_aside(short_repo):
    """SIGTERM to the worker: it checkpoints the step it stopped at and says so in one line. Then that newest
    checkpoint's adapter and optimizer state cut off halfway, as a full disk or a lost node leaves them: the next run
    sets it aside with one line, resumes from the one before (a stop by SIGTERM saves one more checkpoint after
    checkpoint 4, so there is always one before) and ends as an uninterrupted run. The next test resumes from a
    SIGTERM's checkpoint itself."""
    repo, reference, _ = short_repo
    forget_training(repo)
    output, returncode = stopped_training(repo)
    assert returncode != 0, "an interrupted training must not count as done"
    stopped_at = sigterm_step(output)
    assert stopped_at < STEPS
    *_, before, newest = complete_checkpoints(repo)
    assert step_of(newest) == stopped_at, "the step the worker stopped at is checkpointed"
    assert f"; kept: checkpoint {newest.relative_to(repo)} (step {stopped_at}); `dvc repro` resumes from it" in output
    assert output.count(" stopped by ") == 1 and "Traceback" not in output, output[-3000:]

    for name in ("adapter_model.safetensors", "optimizer.pt"):
        path = newest / name
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    output = run(["dvc", "repro", "--no-run-cache", "train"], repo)
    set_aside = [line for line in output.splitlines() if line.startswith(f"{newest.name} set aside in ")]
    assert len(set_aside) == 1 and "adapter_model.safetensors is " in set_aside[0], output[-3000:]
    assert f"resuming from {before.relative_to(repo)}" in output
    assert run_facts(repo)["resumed_from_step"] == step_of(before)
    assert json.loads((repo / "metrics/train.json").read_text())["steps"] == STEPS
    assert_same_adapter(repo, reference)
    damaged = newest.parent / DAMAGED / newest.name
    assert (damaged / "optimizer.pt").is_file() and not checkpoints(repo), "kept aside; the finished run's removed"


def test_sigterm_to_dvc_alone_stops_the_orphaned_training_and_only_its_own_params_resume_it(short_repo):
    """DVC exits on SIGTERM without stopping the stage's launcher; the worker notices at its next step, saves a
    checkpoint and stops, instead of training on unrecorded. A training of other params then starts afresh and keeps
    that checkpoint for its run; back at the stopped run's params, the next run resumes there."""
    repo, reference, _ = short_repo
    forget_training(repo)
    proc = start_training(repo)
    wait_for_checkpoint_step(proc, repo, 4)
    proc.send_signal(signal.SIGTERM)  # DVC alone, not its process group
    output, _ = proc.communicate()  # returns once DVC and the workers, which share its output, have exited
    stopped_at = sigterm_step(output)
    assert stopped_at < STEPS
    assert step_of(complete_checkpoints(repo)[-1]) == stopped_at

    kept = checkpoints(repo)[0].parents[1].name
    with edited_params(repo, **{"lora.r": 4, "train.sft.max_steps": 8}):  # other params: a fresh run, a short one
        output = run(["dvc", "repro", "--no-run-cache", "train"], repo)
    assert "resuming from" not in output
    assert (repo / "checkpoints" / kept).is_dir(), "the other run's checkpoint is kept for that run"
    assert run_facts(repo)["resumed_from_step"] == 0

    run(["dvc", "repro", "--no-run-cache", "train"], repo)
    assert run_facts(repo)["resumed_from_step"] == stopped_at
    assert_same_adapter(repo, reference)


def test_sigkill_of_the_training_process_ends_in_one_line_and_of_everything_resumes(short_repo):
    """The worker killed (the OOM killer's way): no chance to save, so the last complete checkpoint is kept; the
    launcher says so in one line, with no traceback, and `dvc repro` resumes from it. The resumed run killed whole (DVC,
    the launcher and the worker, as a lost machine): the next resumes from its last checkpoint and ends where an
    uninterrupted run ends, leaving no checkpoint behind."""
    repo, reference, reference_metrics = short_repo
    forget_training(repo)
    proc = start_training(repo)
    wait_for_checkpoint_step(proc, repo, 4)
    for worker in running_workers(proc, "its SIGKILL"):
        worker.send_signal(signal.SIGKILL)
    output, _ = proc.communicate()
    assert proc.returncode != 0
    kept = complete_checkpoints(repo)[-1]
    step = step_of(kept)
    line = (f"train stopped by SIGKILL (signal 9); kept: checkpoint {kept.relative_to(repo)} (step {step}); "
            "`dvc repro` resumes from it")
    assert [text for text in output.splitlines() if " stopped by " in text] == [line], output[-3000:]
    assert "Traceback" not in output and "CalledProcessError" not in output, output[-3000:]

    done, output = killed_training(repo, at_step=step + 2)
    assert f"resuming from {kept.relative_to(repo)}" in output, output[-3000:]
    output = run(["dvc", "repro", "--no-run-cache", "train"], repo)
    assert "resuming from checkpoints/train-" in output
    metrics = json.loads((repo / "metrics/train.json").read_text())
    assert run_facts(repo)["resumed_from_step"] == done > step and metrics["steps"] == STEPS
    assert metrics.keys() == reference_metrics.keys() and metrics["tokens"] == reference_metrics["tokens"]
    assert metrics["train_loss"] == pytest.approx(reference_metrics["train_loss"], rel=1e-4)
    assert_same_adapter(repo, reference)
    assert not checkpoints(repo), "a finished run leaves no checkpoint behind"


def running_with_torch(proc: subprocess.Popen, cmdline: str) -> list[psutil.Process]:
    """proc's descendants whose command line matches, once they have loaded torch."""
    found = []
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if re.fullmatch(cmdline, " ".join(child.cmdline())) and any("libtorch" in m.path
                                                                         for m in child.memory_maps()):
                found.append(child)
        except psutil.NoSuchProcess:  # ended meanwhile (a zombie too)
            pass
    return found


def test_sigterm_to_evaluate_ends_in_one_line(short_repo):
    """evaluate keeps no partial work: the line says so, and that `dvc repro` runs it again."""
    repo, _, _ = short_repo
    forget_training(repo)
    proc = subprocess.Popen(["dvc", "repro", "--no-run-cache", "evaluate_base"], cwd=repo, env=run_env(),
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # the evaluation runs in the launcher's process (one process: stage_launch.run_here), once it has loaded torch
    while not (evaluating := running_with_torch(proc, r"\S+ -m lora_pipeline\.launch evaluate_base")):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.1)
    evaluating[0].send_signal(signal.SIGTERM)
    output, _ = proc.communicate()
    assert proc.returncode != 0
    line = "evaluate_base stopped by SIGTERM (signal 15); kept: no checkpoint; `dvc repro` runs it again"
    assert [text for text in output.splitlines() if " stopped by " in text] == [line], output[-3000:]
    assert "Traceback" not in output, output[-3000:]


def test_two_processes_resume_after_a_kill(short_repo):
    repo, _, _ = short_repo
    forget_training(repo)
    set_params(repo, **{"train.accelerate_config": "cpu_ddp"})
    run(["accelerate", "launch", "--config_file", "configs/accelerate/cpu_ddp.yaml", "-m", "stages.train"], repo)
    reference = load_file(repo / ADAPTER)
    done, _ = killed_training(repo, at_step=4, accelerate_config="cpu_ddp")
    written = json.loads((complete_checkpoints(repo)[-1] / MANIFEST).read_text())["files"]
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= written.keys(), "the manifest waits for every process's files"
    output = run(["dvc", "repro", "--no-run-cache", "train"], repo)
    assert "resuming from" in output
    metrics = json.loads((repo / "metrics/train.json").read_text())
    assert metrics["world_size"] == 2 and run_facts(repo)["resumed_from_step"] == done and metrics["steps"] == STEPS
    assert_same_adapter(repo, reference)


def test_a_second_training_of_the_same_run_is_refused(tmp_path):
    from lora_pipeline.launch.checkpoints import hold_run_lock

    held = hold_run_lock(tmp_path / "train-abc")
    with pytest.raises(SystemExit, match="another training of the same params, code and data is running"):
        hold_run_lock(tmp_path / "train-abc")
    held.close()
    hold_run_lock(tmp_path / "train-abc").close()  # free again once the first one is gone
