"""Training: the SFT trainer and its callbacks, the SFT arguments the train stage sets, the live MLflow run."""
