"""`accelerate launch` for a stage, ending in one line instead of accelerate's traceback when a signal stops the
stage's process: which stage, which signal, the checkpoint kept and the way on (dvc.yaml's cmds):
    python -m lora_pipeline.launch.stage_launch --config_file configs/accelerate/cpu.yaml -m stages.train
Its arguments are accelerate launch's. Another launcher reports a stop alike with checkpoints.stop_line and
checkpoints.kept_checkpoint. run_here runs a one-process stage in the launcher's own interpreter instead.
"""
from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys
import time

from lora_pipeline.launch.checkpoints import kept_checkpoint, stop_line

LAUNCHED_AT = "LORA_PIPELINE_LAUNCHED_AT"  # the wall-clock time `python -m lora_pipeline.launch <stage>` started


def mark_launched(environ=os.environ) -> None:
    """Note in the environment, which the stage's processes inherit (through accelerate and srun too), when the launch
    started; kept where a launcher above this one set it."""
    environ.setdefault(LAUNCHED_AT, repr(time.time()))


def seconds_since_launch(environ=os.environ) -> float | None:
    """Seconds from the launch's start to now: in a stage's main(), its start-up (the launcher's and the stage's
    interpreters, imports, accelerate, srun). None where the stage was started without the launcher."""
    try:
        return time.time() - float(environ[LAUNCHED_AT])
    except (KeyError, ValueError):
        return None


def stopping_signal(error: BaseException) -> int | None:
    """The signal that stopped a stage's process, from what accelerate's launcher raised, or None: a process that
    exited by itself has said why. The one-process launcher raises CalledProcessError (a negative return code: the
    signal); the multi-process one (torch's elastic agent) ChildFailedError (a worker's negative exit code, or 128 +
    the signal a worker stopped on, as train exits after saving), or SignalException when the launcher itself got the
    signal."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if isinstance(error, subprocess.CalledProcessError):
        return -error.returncode if error.returncode < 0 else None
    if isinstance(error, ChildFailedError):
        codes = [failure.exitcode for failure in error.failures.values()]
        return next((-code for code in codes if code < 0), None) or next(
            (code - 128 for code in codes if 128 < code < 128 + signal.NSIG), None)
    if isinstance(error, SignalException):
        return int(error.sigval)
    return None


def _pass_on(signum, frame) -> None:
    """SIGTERM or SIGINT to the launcher alone: passed on to the stage's process, which stops (train with a
    checkpoint), so that the launcher can report it, instead of dying and leaving it to run on unrecorded."""
    import psutil

    for child in psutil.Process().children():
        child.send_signal(signum)


def main(argv: list[str] | None = None, stage: str | None = None) -> None:
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = launch_command_parser().parse_args(argv)
    stage = stage or os.environ.get("DVC_STAGE") or args.training_script.rsplit(".", 1)[-1]
    started = time.time()
    for signum in (signal.SIGTERM, signal.SIGINT):  # torch's multi-process launcher installs its own
        signal.signal(signum, _pass_on)
    try:
        launch_command(args)
    except (subprocess.CalledProcessError, ChildFailedError, SignalException) as error:
        signum = stopping_signal(error)
        if signum is not None:
            # on a line of its own: the process may have died in the middle of one (a progress bar's)
            print("\n" + stop_line(stage, signum, kept_checkpoint(started)), file=sys.stderr, flush=True)
            sys.exit(128 + signum)
        if isinstance(error, subprocess.CalledProcessError):  # the process printed its own error; the traceback
            sys.exit(error.returncode)                         # would only repeat its exit status
        raise


def run_here(argv: list[str], stage: str, use_cpu: bool) -> None:
    """Run a one-process stage in this interpreter, with the command and environment accelerate's one-process launcher
    gives it (prepare_simple_launcher_cmd_env), instead of in a new one: the interpreter's start and the imports of
    torch and accelerate are paid once. A signal that stops it ends in the same one line. For configs that start one
    process (distributed_type NO): accelerate launches the others through torch's multi-process launcher."""
    from lora_pipeline.config import cpu_numerics

    started = time.time()

    def stop(signum, _frame):
        print("\n" + stop_line(stage, signum, kept_checkpoint(started)), file=sys.stderr, flush=True)
        os._exit(128 + signum)  # what the launcher exits with when its stage's process is stopped

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, stop)
    if use_cpu:
        os.environ["ACCELERATE_USE_CPU"] = "True"  # what accelerate sets for a use_cpu config; the pins read it
    cpu_numerics.pin()  # before accelerate imports torch
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import prepare_simple_launcher_cmd_env

    args = _validate_launch_command(launch_command_parser().parse_args(argv))[0]  # accelerate launch's own defaults
    command, env = prepare_simple_launcher_cmd_env(args)
    os.environ.update(env)  # the stage's own import of stages pins again over accelerate's thread count, as before
    module = command.index("-m") + 1
    sys.argv = command[module:]  # [module, its arguments]; runpy puts the module's path first
    runpy.run_module(command[module], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
