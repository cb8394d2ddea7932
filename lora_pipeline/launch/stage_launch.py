"""`accelerate launch` for a stage, ending in one line instead of accelerate's traceback when a signal stops the
stage's process: which stage, which signal, the checkpoint kept and the way on (dvc.yaml's cmds):
    python -m lora_pipeline.launch.stage_launch --config_file configs/accelerate/cpu.yaml -m stages.train
Its arguments are accelerate launch's. Another launcher reports a stop alike with checkpoints.stop_line and
checkpoints.kept_checkpoint.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from lora_pipeline.launch.checkpoints import kept_checkpoint, stop_line


def stopping_signal(error: BaseException) -> int | None:
    """The signal that stopped a stage's process, from what accelerate's launcher raised, or None: a process that
    exited by itself has said why. The one-process launcher raises CalledProcessError (a negative return code: the
    signal); the multi-process one (torch's elastic agent) ChildFailedError (a worker's negative exit code), or
    SignalException when the launcher itself got the signal."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if isinstance(error, subprocess.CalledProcessError):
        return -error.returncode if error.returncode < 0 else None
    if isinstance(error, ChildFailedError):
        return next((-failure.exitcode for failure in error.failures.values() if failure.exitcode < 0), None)
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


if __name__ == "__main__":
    main()
