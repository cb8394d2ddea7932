"""Command-line tools beside the pipeline: recipes (a recipe over params.yaml) and experiments (the experiment
table)."""
