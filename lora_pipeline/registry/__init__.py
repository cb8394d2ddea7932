"""register's work: the gate, logging to MLflow and its model registry, the served model, MLflow names."""
