"""python -m lora_pipeline.launch <stage>: start a stage here or through Slurm (lora_pipeline.launch.launcher)."""
import atexit
import gc
import signal

from lora_pipeline.launch.stage_launch import mark_launched

mark_launched()  # first: the stage's process measures its start-up from here

# Slurm's signal ahead of a time limit (launch.slurm.save_before_limit) reaches every process of the job. Ignored, and
# so by every process started from here, until training's StopOnSignal takes it (save and stop); other stages run on.
signal.signal(signal.SIGUSR1, signal.SIG_IGN)

from lora_pipeline.launch.launcher import main  # noqa: E402 (after the signal is ignored: the imports take seconds)

atexit.register(gc.freeze)  # no last garbage collection at exit over accelerate's and torch's objects (stages/__init__)
main()
