"""How the accelerated stages start (python -m lora_pipeline.launch <stage>): accelerate or Slurm, the machine
checks, checkpoints kept across a stop, the process group."""
