"""The report a test still running after STALL_REPORT_EVERY_S prints: its processes, its own innermost frames, and
its node id on the last line, where a log cut short by a hang ends."""
import subprocess
import sys
import threading
import time

import psutil
import pytest

from conftest import described, detached_processes, pipe_holders, stall_report

pytestmark = pytest.mark.unit


def waits_on_a_child(started: threading.Event, done: threading.Event):
    child = subprocess.Popen(["sleep", "30"])
    started.set()
    done.wait()
    child.kill()
    child.wait()


def polled(find, enough) -> list:
    """find() every 0.05 s until enough(what it found), 600 times at most; what it found last."""
    for _ in range(600):
        found = find()
        if enough(found):
            break
        time.sleep(0.05)
    return found


def test_the_report_names_the_test_last_with_its_frames_and_processes():
    started, done = threading.Event(), threading.Event()
    waiting = threading.Thread(target=waits_on_a_child, args=(started, done))
    waiting.start()
    try:
        started.wait()
        time.sleep(0.2)  # the thread is inside done.wait() by now
        lines = stall_report("tests/e2e/test_x.py::test_y", waiting.ident, 15).splitlines()
    finally:
        done.set()
        waiting.join()
    assert lines[-1] == "[stalled? 15 min] tests/e2e/test_x.py::test_y"
    frames = lines[lines.index("its innermost frames:") + 1:-1]
    assert any("waits_on_a_child: done.wait()" in frame for frame in frames), frames
    assert not any("/_pytest/" in frame or "pluggy" in frame for frame in frames)
    assert any(line.endswith(": sleep 30") for line in lines), lines


def test_the_report_names_a_process_left_behind_that_holds_the_output_being_read():
    """A command that has exited but left a process holding its output: a read of that output waits on the process,
    which is no longer a child. The report names it, and shows the exited command as a zombie."""
    proc = subprocess.Popen(["sh", "-c", "sleep 30 & exit 0"], stdout=subprocess.PIPE)
    left = []
    try:
        left = polled(lambda: pipe_holders(exclude=set()),  # until sh has exited and its background sleep started
                      lambda found: psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE and len(found) == 1
                      and described(found[0]) == f"  pid {found[0].pid} sleeping: sleep 30")
        report = stall_report("tests/e2e/test_x.py::test_y", threading.get_ident(), 15)
    finally:
        for process in left:
            process.kill()
        proc.stdout.close()
        proc.wait()
    assert len(left) == 1, left
    lines = report.splitlines()
    assert f"  pid {proc.pid} zombie" in lines, report
    held = lines[lines.index("other processes holding a pipe it reads (1):") + 1]
    assert held == f"  pid {left[0].pid} sleeping: sleep 30", report


def test_the_report_names_a_process_of_this_environment_left_in_the_background():
    """A command that starts a process in its own session and exits (as `dvc queue start` leaves its workers): the
    process is nobody's child here, and the report still names it."""
    script = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'], " \
             "start_new_session=True)"
    subprocess.run([sys.executable, "-c", script], check=True)
    left = []
    try:
        left = polled(lambda: [process for process in detached_processes()  # until the background process started
                               if "time.sleep(30)" in " ".join(process.cmdline())], bool)
        report = stall_report("tests/e2e/test_x.py::test_y", threading.get_ident(), 15)
    finally:
        for process in left:
            process.kill()
    assert len(left) == 1, left
    lines = report.splitlines()
    detached = lines[[i for i, line in enumerate(lines) if line.startswith("other processes of this environment")][0]:]
    assert any(line.startswith(f"  pid {left[0].pid} ") and "time.sleep(30)" in line for line in detached), lines
