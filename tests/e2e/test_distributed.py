"""Data-parallel evaluation through accelerate with two CPU processes (DDP over gloo). Two-process training is
checked where a test trains that way anyway: tests/unit/train/test_live_metrics.py (the ranks' shares, rank 0
alone writing), tests/e2e/test_resume.py (resumed after a kill) and tests/e2e/test_slurm.py (over two nodes)."""
import json

import pytest

from conftest import run, set_params

pytestmark = pytest.mark.e2e  # every test here runs the pipeline, DVC or an MLflow server


def test_two_process_evaluation_writes_what_one_process_wrote(pipeline_copy):
    """evaluate launched with cpu_ddp: each process decodes every other batch (the default's 51 prompts make three
    batches) and its share of the held-out loss; rank 0 gathers them and writes the single process's results, alone."""
    copy = pipeline_copy
    outputs = ["metrics/eval.json", "reports/generations.jsonl", "plots/compliance/finetuned.csv"]
    one_process = {path: (copy / path).read_text() for path in outputs}
    set_params(copy, **{"eval.accelerate_config": "cpu_ddp"})
    output = run(["accelerate", "launch", "--config_file", "configs/accelerate/cpu_ddp.yaml", "-m", "stages.evaluate"],
                 copy)
    assert json.loads((copy / "logs/evaluate.json").read_text())["processes"] == 2, output[-3000:]
    assert output.count('"speed": {') == 1, output[-3000:]  # rank 0 alone writes and prints the results
    # Greedy decoding gives the same texts; each process runs one thread (accelerate sets OMP_NUM_THREADS=1), so
    # the held-out loss's float sums may round otherwise in the last bits.
    assert {path: (copy / path).read_text() for path in outputs[1:]} == {path: one_process[path] for path in outputs[1:]}
    two, one = (json.loads(text) for text in ((copy / outputs[0]).read_text(), one_process[outputs[0]]))
    assert two["test"].pop("loss") == pytest.approx(one["test"].pop("loss"), rel=1e-6)
    assert two["test"].pop("perplexity") == pytest.approx(one["test"].pop("perplexity"), rel=1e-6)
    assert two == one
