"""A Slurm job's output as the launcher reads it: what reaches the terminal, and the one line for each way a job
ends (a lost node, an error of a task's own, the time limit, a cancel, a preemption, out of memory), from lines as
srun --label and slurmstepd write them."""
from pathlib import Path

import pytest

from lora_pipeline.config.params import ROOT, read_yaml, validate
from lora_pipeline.launch.launcher import slurm_seconds, srun_command, srun_settings
from lora_pipeline.launch.slurm_step import StepOutput

CHECKPOINT = Path("checkpoints/train-0123456789abcdef/checkpoint-20")
STEP = "0:  13%|█▎        | 40/300 [00:08<00:44,  5.90it/s]"
RANK0_TRACEBACK = [
    "0:  13%|█▎        | 40/300 [00:08<00:53,  4.85it/s][rank0]: Traceback (most recent call last):",
    '0: [rank0]:   File "stages/train.py", line 62, in main',
    "0: [rank0]: RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:31361: Connection reset",
]
KILLED_NODE = [
    "1: E1207 18:49:14.704000 5148 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -9) "
    "local_rank: 0 (pid: 5200) of binary: python",
    f"1: train stopped by SIGKILL (signal 9); kept: checkpoint {CHECKPOINT} (step 20); `dvc repro` resumes from it",
    "srun: error: n2: task 1: Exited with exit code 137",
    "srun: launch/slurm: _step_signal: Terminating StepId=7.0",
    "0: slurmstepd-n1: error: *** STEP 7.0 ON n1 CANCELLED AT 2026-12-07T18:49:14 ***",
    "0: W1207 18:49:14.893000 5154 torch/distributed/elastic/agent/server/api.py:753] Received 15 death signal, "
    "shutting down workers",
    f"0: train stopped by SIGTERM (signal 15); kept: checkpoint {CHECKPOINT} (step 20); `dvc repro` resumes from it",
    "srun: error: n1: task 0: Exited with exit code 143",
]


def read(lines: list[str]) -> tuple[StepOutput, list[str]]:
    output = StepOutput("train")
    shown = [line for line in map(output.feed, lines) if line is not None]
    return output, shown


def test_a_lost_node_ends_in_one_line_naming_it_and_the_signal_with_no_traceback_of_the_other_ranks():
    output, shown = read([STEP, *RANK0_TRACEBACK, *KILLED_NODE])
    assert shown == [STEP.removeprefix("0: ")]  # the training's lines until the fault, label taken off
    assert output.shown_after() == []  # a signal ended it: no task's traceback is its own error
    assert output.verdict(CHECKPOINT) == (
        "train: task 1 on node n2 failed first: its train process ended by SIGKILL (signal 9); Slurm ended the job's "
        f"other tasks; kept: checkpoint {CHECKPOINT} (step 20); `dvc repro` resumes from it")


def test_a_task_that_fails_by_an_error_of_its_own_shows_that_error_and_not_the_others():
    own = ["1: Traceback (most recent call last):", "1: ModuleNotFoundError: No module named 'nosuch'"]
    output, shown = read([STEP, "0: Traceback (most recent call last):", "0: RuntimeError: Connection closed by peer",
                          *own, "srun: error: n2: task 1: Exited with exit code 1",
                          "srun: error: n1: task 0: Terminated"])
    assert shown == [STEP.removeprefix("0: ")]
    assert output.shown_after() == [line.removeprefix("1: ") for line in own]
    assert output.verdict(None).startswith("train: task 1 on node n2 failed first: exit code 1 (its error above); "
                                           "Slurm ended the job's other tasks; kept: no checkpoint")


def test_an_exit_code_past_128_or_srun_s_killed_by_signal_is_read_as_the_signal():
    output, _ = read(["srun: error: n1: task 0: Exited with exit code 137"])
    assert "exit code 137, as when SIGKILL (signal 9) kills a process" in output.verdict(None)
    output, _ = read(["srun: error: n2: task 1: Killed by signal 9"])
    assert "task 1 on node n2 failed first: killed by SIGKILL (signal 9)" in output.verdict(None)


def test_out_of_memory_is_named_where_slurm_says_so():
    output, _ = read(["1: slurmstepd-n2: error: Detected 1 oom_kill event in StepId=9.0. Some of the step tasks have "
                      "been OOM Killed.", "srun: error: n2: task 1: Out Of Memory"])
    assert "task 1 on node n2 failed first: out of memory (Slurm's oom-kill)" in output.verdict(None)


def test_the_step_saved_ahead_of_the_time_limit_is_kept_and_said():
    saved = Path("checkpoints/train-0123456789abcdef/checkpoint-102")
    output, shown = read([STEP, f"0: train stopped by SIGUSR1 (signal 10) at step 102; kept: checkpoint {saved} "
                                f"(step 102); `dvc repro` resumes from it",
                          f"1: train stopped by SIGUSR1 (signal 10); kept: checkpoint {saved} (step 102)",
                          "srun: error: n1: task 0: Exited with exit code 138", "srun: error: n2: task 1: Terminated"])
    assert shown == [STEP.removeprefix("0: ")]
    assert output.verdict(saved, "3") == (
        "train: the Slurm job reached its time limit (launch.slurm.time 3); every process saved at the step it was at "
        f"on Slurm's signal; kept: checkpoint {saved} (step 102); `dvc repro` resumes from it")


def test_a_time_limit_without_the_signal_and_a_cancel_say_so():
    output, _ = read(["0: slurmstepd-n1: error: *** JOB 8 ON n1 CANCELLED AT 2026-12-07T18:52:21 DUE TO TIME LIMIT ***",
                      "srun: error: n1: task 0: Terminated"])
    assert output.verdict(None, "2").startswith("train: the Slurm job reached its time limit (launch.slurm.time 2); "
                                                "kept: no checkpoint")
    output, _ = read([f"{STEP}slurmstepd-n1: error: *** STEP 42.0 ON n1 CANCELLED AT 2026-12-07T19:06:07 ***",
                      "srun: error: n2: task 1: Exited with exit code 143"])
    assert output.cancelled == ("42", "")
    assert output.verdict(CHECKPOINT).startswith("train: the Slurm job was cancelled (scancel); kept: checkpoint")


def test_a_preempted_job_is_submitted_again_from_its_checkpoint():
    output, _ = read(["0: slurmstepd-n1: error: *** STEP 35.0 ON n1 CANCELLED AT 2026-12-07T19:02:58 DUE TO "
                      "PREEMPTION ***", "srun: error: n1: task 0: Killed"])
    assert output.preempted
    assert output.resubmitted(CHECKPOINT) == (f"train: Slurm preempted the job; kept: checkpoint {CHECKPOINT}; it "
                                              "resumes from there; submitted again, it runs once Slurm gives it nodes")
    output, _ = read(["0: slurmstepd-n1: error: *** STEP 42.0 ON n1 CANCELLED AT 2026-12-07T19:06:07 ***"])
    assert not output.preempted
    output.cancelled_because("PREEMPTION")  # the launcher asks Slurm when a grace time's cancel names no reason
    assert output.preempted


@pytest.mark.parametrize("limit, seconds", [("3", 180), ("2:30", 150), ("1:00:00", 3600), ("1-0", 86400),
                                            ("1-2:03", 93780), ("1-2:03:04", 93784), ("INFINITE", None), ("x", None)])
def test_slurm_time_limits_in_each_of_slurm_s_forms(limit, seconds):
    assert slurm_seconds(limit) == seconds


def test_srun_labels_the_lines_and_asks_for_the_signal_ahead_of_a_time_limit_only():
    params = validate(read_yaml(ROOT / "params.yaml"))
    assert "--label" in srun_command("train", params, {})
    assert not any(arg.startswith("--signal") for arg in srun_command("train", params, {}))
    params.launch.slurm.time, params.launch.slurm.save_before_limit = "3", 60
    command = srun_command("train", params, {})
    assert "--time=3" in command and "--signal=USR1@60" in command
    assert srun_settings(command[:command.index("--on-node") - 3]) == "--nodes=1 --ntasks=1 --ntasks-per-node=1 " \
                                                                      "--time=3 --signal=USR1@60"
    params.launch.slurm.save_before_limit = 0
    assert not any(arg.startswith("--signal") for arg in srun_command("train", params, {}))
