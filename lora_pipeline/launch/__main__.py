"""python -m lora_pipeline.launch <stage>: start a stage here or through Slurm (lora_pipeline.launch.launcher)."""
import atexit
import gc

from lora_pipeline.launch.launcher import main

atexit.register(gc.freeze)  # no last garbage collection at exit over accelerate's and torch's objects (stages/__init__)
main()
