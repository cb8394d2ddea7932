"""The evaluation picture: training loss per step, and reasoning-language compliance before vs after."""
from __future__ import annotations

import csv
from pathlib import Path


def plot_report(loss_log: Path, results: dict, out: Path) -> None:
    """Two panels: loss per step from the train stage's log; compliance per language per evaluated model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    if loss_log.is_file():
        with open(loss_log) as f:
            rows = [r for r in csv.DictReader(f) if r["loss"]]
        left.plot([int(r["step"]) for r in rows], [float(r["loss"]) for r in rows], marker=".")
    left.set(title="Training loss", xlabel="step", ylabel="loss")
    left.grid(alpha=0.3)

    languages = list(next(iter(results.values()))["compliance"])
    width = 0.8 / len(results)
    for i, (name, metrics) in enumerate(sorted(results.items())):
        xs = [j + (i - (len(results) - 1) / 2) * width for j in range(len(languages))]
        right.bar(xs, [metrics["compliance"][lang] for lang in languages], width, label=name)
    right.set_xticks(range(len(languages)), languages)
    right.set(title="Reasoning in the asked language", ylabel="rate", ylim=(0, 1.05))
    right.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
