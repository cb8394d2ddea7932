"""The stage launcher (accelerate launch's arguments): a stage's process that a signal stops, or a signal to the
launcher alone, ends in one line naming the stage and the signal, with no traceback; through the one-process
launcher and torch's multi-process one. The stage here is a module that waits; the real stages:
tests/e2e/test_resume.py."""
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
