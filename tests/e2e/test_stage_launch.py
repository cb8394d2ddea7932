"""The stage launcher (accelerate launch's arguments): a stage's process that a signal stops, or a signal to the
launcher alone, ends in one line naming the stage and the signal, with no traceback; through the one-process
launcher and torch's multi-process one. The stage here is a module that waits; the real stages:
tests/e2e/test_resume.py. A one-process stage run in the launcher's own interpreter (stage_launch.run_here) gets what
accelerate's launcher gives its process, and ends alike on a signal."""
import json
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import ROOT, run_env

pytestmark = pytest.mark.e2e  # real launches, each a few seconds of imports


def launch(tmp_path, config: str) -> tuple[subprocess.Popen, list[psutil.Process]]:
    """The launcher running module `waiting` from tmp_path; returns once its stage processes have started."""
    (tmp_path / "waiting.py").write_text("import time\ntime.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-m", "lora_pipeline.launch.stage_launch", "--config_file",
                             str(ROOT / "configs" / "accelerate" / f"{config}.yaml"), "-m", "waiting"],
                            cwd=tmp_path, env=run_env(PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    while not (stage := [p for p in psutil.Process(proc.pid).children(recursive=True)
                         if p.cmdline()[-2:] == ["-m", "waiting"]]):
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    return proc, stage


@pytest.mark.parametrize("config", ["cpu", "cpu_ddp"])
def test_a_killed_stage_process_ends_in_one_line(tmp_path, config):
    proc, stage = launch(tmp_path, config)
    stage[0].send_signal(signal.SIGKILL)
    output, _ = proc.communicate()
    assert proc.returncode == 128 + signal.SIGKILL
    assert "waiting stopped by SIGKILL (signal 9); kept: no checkpoint; `dvc repro` runs it again" in output
    assert "Traceback" not in output, output


def test_a_sigterm_to_the_launcher_alone_stops_the_stage(tmp_path):
    proc, stage = launch(tmp_path, "cpu")
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate()
    assert not psutil.pid_exists(stage[0].pid) or stage[0].status() == psutil.STATUS_ZOMBIE
    assert proc.returncode == 128 + signal.SIGTERM
    assert "waiting stopped by SIGTERM (signal 15); kept: no checkpoint; `dvc repro` runs it again" in output
    assert "Traceback" not in output, output


# The launcher's interpreter running a one-process stage with accelerate launch's arguments, either way
RUN = "import sys; from lora_pipeline.launch import stage_launch; stage_launch.{}(sys.argv[1:], 'probe'{})"
PROBE = """import json, os, sys
import stages  # pins the CPU numerics, as each stage does
import torch
print(json.dumps({"pid": os.getpid(), "argv": sys.argv[1:], "threads": torch.get_num_threads(),
                  "env": {k: v for k, v in os.environ.items() if k.startswith(("ACCELERATE_", "OMP_", "MKL_"))}}),
      flush=True)
if sys.argv[1:] == ["wait"]:
    __import__("time").sleep(600)
"""


def run_probe(tmp_path, here: bool, *args: str) -> subprocess.Popen:
    (tmp_path / "probe.py").write_text(PROBE)
    code = RUN.format("run_here", ", True") if here else RUN.format("main", "")
    return subprocess.Popen([sys.executable, "-c", code, "--config_file", str(ROOT / "configs/accelerate/cpu.yaml"),
                             "-m", "probe", *args], cwd=tmp_path, env=run_env(PYTHONPATH=str(ROOT)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def probed(output: str) -> dict:
    return json.loads(next(line for line in output.splitlines() if line.startswith("{")))


def test_a_stage_run_in_the_launcher_gets_what_accelerates_launcher_gives_its_process(tmp_path):
    launched, here = run_probe(tmp_path, False, "x", "--y"), run_probe(tmp_path, True, "x", "--y")
    (launched_out, _), (here_out, _) = launched.communicate(), here.communicate()
    assert launched.returncode == 0 and here.returncode == 0, launched_out + here_out
    launched_probe, here_probe = probed(launched_out), probed(here_out)
    assert launched_probe["pid"] != launched.pid and here_probe["pid"] == here.pid  # a new process, or this one
    assert here_probe["argv"] == launched_probe["argv"] == ["x", "--y"]
    assert here_probe["env"] == launched_probe["env"] and here_probe["env"]["ACCELERATE_USE_CPU"] == "True"
    assert here_probe["threads"] == launched_probe["threads"] == 2  # the CPU pin's, over accelerate's


def test_a_sigterm_to_a_stage_run_in_the_launcher_ends_in_one_line(tmp_path):
    proc = run_probe(tmp_path, True, "wait")
    assert proc.stdout.readline().startswith("{")  # the stage is running
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM
    assert "probe stopped by SIGTERM (signal 15); kept: no checkpoint; `dvc repro` runs it again" in output
    assert "Traceback" not in output, output
