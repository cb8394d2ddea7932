"""python -m lora_pipeline.launch <stage>: start a stage here or through Slurm (lora_pipeline.launch.launcher)."""
from lora_pipeline.launch.launcher import main

main()
