"""benchmarks/full_static_cache.py, the GPU check of gpt-oss's compiled decode step, on the tiny gpt-oss on the CPU:
each step runs and checks its logits against the first, and on the CPU every cache, step and attention computes
eager's bits; its profile covers decode steps only."""
import json
import re
import subprocess
import sys

from conftest import ROOT, run_env


def test_every_step_runs_and_on_the_cpu_matches_eager_to_the_bit(tmp_path):
    out = tmp_path / "static.jsonl"
    printed = subprocess.run([sys.executable, str(ROOT / "benchmarks/full_static_cache.py"), "--tiny", "--batch", "8",
                              "--new-tokens", "20", "--steps", "eager", "eager-halves", "window", "window-cudagraphs",
                              "repeat-kv-eager", "repeat-kv-window-cudagraphs", "--check-steps", "3", "--calls", "2",
                              "--profile", "3", "--layer-check", "--out", str(out)],
                             cwd=tmp_path, env=run_env(), check=True, capture_output=True, text=True).stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    checks = {row["step"]: row["logit_check"] for row in rows if "logit_check" in row}
    layers = {row["step"]: row["layer_check"] for row in rows if "layer_check" in row}
    timings = [row for row in rows if "call" in row]
    steps = ["eager", "eager-halves", "window", "window-cudagraphs", "repeat-kv-eager", "repeat-kv-window-cudagraphs"]
    assert list(checks) == steps
    for step in steps[1:]:
        assert [c["step"] for c in checks[step]] == [0, 1, 2], step
        assert all(c["max_rel"] == 0.0 and c["top1_equal"] == 1.0 for c in checks[step]), (step, checks[step])
    assert [row["call"] for row in timings if row["step"] == "window-cudagraphs"] == [1, 2]  # the first compiles
    # each layer's prefill outputs against eager's: both parts of both layers, float32 rounding at most (a static
    # cache sums over more, masked, keys), nothing at all where only the attention's matmul layout differs
    assert list(layers) == steps[1:]
    assert all([(c["layer"], c["part"]) for c in layers[step]] == [(0, "attention"), (0, "mlp"), (1, "attention"),
                                                                    (1, "mlp")] for step in layers), layers
    assert all(c["mean_rel"] < 1e-6 for step in layers for c in layers[step]), layers
    assert all(c["mean_rel"] == 0.0 for step in ("eager-halves", "repeat-kv-eager") for c in layers[step]), layers
    attentions = {row["step"]: row["attention"] for row in timings}
    assert attentions == {step: "eager" if step.startswith("repeat-kv-") else "grouped_sink_eager" for step in steps}
    assert all(row["tokens_equal_to_first"] == 1.0 and row["new_tokens"] == 8 * 20 for row in timings), timings
    # one table a step, of exactly the 3 decode steps asked for (one ProfilerStep each), the prefill left out
    tables = printed.split("profile of ")[1:]
    three_steps = r"ProfilerStep\*(\s+\S+){5}\s+3\s*$"
    assert len(tables) == len(steps) and all(re.search(three_steps, t, re.M) for t in tables), printed
