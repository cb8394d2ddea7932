"""How the accelerated stages start (python -m lora_pipeline.launch <stage>): accelerate or Slurm, the machine
checks, checkpoints kept across a stop, the process group.

The way into a stage, once:
1. dvc.yaml's cmd. validate, fetch, split and register run their script directly: `python -m stages.<name>`.
   train, merge, evaluate_base and evaluate run `python -m lora_pipeline.launch <stage>` (__main__.py).
2. launcher.main reads the stage's params and picks how it starts:
   - launch.launcher local: `accelerate launch` with the stage's config (launcher.STAGES, local_command).
     An evaluation that starts one process runs in the launcher's own interpreter (stage_launch.run_here).
   - launch.launcher slurm: srun, then this module again on each node with --on-node (node_command).
3. The stage script (`stages/<name>.py`) loads its params with config.params.load_params. That stops a stage whose
   params.yaml is not the one validate checked (logs/params_digest). It hands the stage only the keys its dvc.yaml
   entry declares. Then the script does its one job.
"""
