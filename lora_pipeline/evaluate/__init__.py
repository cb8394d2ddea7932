"""The evaluation: generation, the held-out loss, scoring answers and languages, MGSM, the eval checks, the report
plots."""
