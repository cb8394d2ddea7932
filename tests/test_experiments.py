"""The curated experiment table: the params that differ, the decision metrics, sorted by the gate, 120 columns."""
from lora_pipeline.experiments import WIDTH, experiment_rows, table


def rev(name, r, overall, loss):
    return {"rev": f"{name}0000000", "name": name, "data": {
        "params": {"params.yaml": {"data": {"lora": {"r": r, "lora_alpha": 16}, "train": {"sft": {"seed": 42}}}}},
        "metrics": {"metrics/eval.json": {"data": {"test": {"loss": loss}, "final_language_rate": 0.5,
                                                    "compliance": {"de": overall, "en": 1.0, "overall": overall}}},
                    "metrics/merge.json": {"data": {"relative_logit_diff": 1e-7}}}}}


SHOWN = [{**rev("workspace", 8, 0.86, 0.38), "experiments": None},
         {**rev("main", 8, 0.86, 0.38), "experiments": [{"name": "r16", "revs": [rev("r16", 16, 0.9, 0.35)]},
                                                        {"name": "r4", "revs": [rev("r4", 4, 0.5, 0.5)]}]}]


def test_rows_are_sorted_by_the_gate_and_show_only_params_that_differ():
    text = table(experiment_rows(SHOWN), "eval.compliance.overall", True)
    lines = text.splitlines()
    names = [line.split()[0] for line in lines[2:6]]
    assert names[0] == "r16" and names[-1] == "r4", text
    assert "r=16" in lines[2] and "lora_alpha" not in text and "seed" not in text
    assert all(len(line) <= WIDTH for line in lines), text
    assert lines[0].split()[-7:] == ["loss", "comp", "de", "en", "final", "mgsm", "merge"]


def test_lower_is_better_gate_puts_the_smallest_loss_first():
    text = table(experiment_rows(SHOWN), "eval.test.loss", False)
    assert text.splitlines()[2].startswith("r16") and text.splitlines()[5].startswith("r4")
