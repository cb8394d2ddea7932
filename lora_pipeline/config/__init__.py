"""The pipeline's settings and what every stage shares: the params.yaml schema, the DVC files as DVC reads them, what
the stages write, the CPU numerics, quieter libraries, validate's disk cache."""
