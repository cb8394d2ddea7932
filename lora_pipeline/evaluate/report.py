"""The evaluation's plots: per-model compliance CSVs for `dvc plots`, and the same plots as PNGs for offline viewing."""
from __future__ import annotations

import csv
import io
from pathlib import Path

from lora_pipeline.config.outputs import write_text


def write_compliance(compliance: dict, path: Path) -> None:
    """One model's compliance per language as a CSV (language, compliance) for `dvc plots`, one file per model
    (plots/compliance/<model>.csv) so the plots tell base and fine-tuned apart; a header alone if not evaluated or
    not applicable."""
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(["language", "compliance"])
    writer.writerows(compliance.items() if isinstance(compliance, dict) else [])
    write_text(path, text.getvalue())


def _loss(ax, loss_log: Path) -> None:
    if loss_log.is_file():
        with open(loss_log) as f:
            rows = [r for r in csv.DictReader(f) if r["loss"]]
        ax.plot([int(r["step"]) for r in rows], [float(r["loss"]) for r in rows], marker=".")
    ax.set(title="Training loss", xlabel="step", ylabel="loss")
    ax.grid(alpha=0.3)


def _compliance(ax, results: dict) -> None:
    results = {name: metrics for name, metrics in results.items() if isinstance(metrics.get("compliance"), dict)}
    if not results:  # the rows ask for no reasoning language
        ax.text(0.5, 0.5, "not applicable:\nno held-out row asks\nfor a reasoning language", ha="center", va="center")
        ax.set(title="Reasoning in the asked language")
        return
    languages = list(next(iter(results.values()))["compliance"])
    width = 0.8 / len(results)
    for i, (name, metrics) in enumerate(sorted(results.items())):
        xs = [j + (i - (len(results) - 1) / 2) * width for j in range(len(languages))]
        ax.bar(xs, [metrics["compliance"][lang] for lang in languages], width, label=name)
    ax.set_xticks(range(len(languages)), languages)
    ax.set(title="Reasoning in the asked language", ylabel="rate", ylim=(0, 1.05))
    ax.legend()


def plot_report(loss_log: Path, results: dict, folder: Path) -> None:
    """reports/train_loss.png (loss per step), reports/compliance.png (compliance per language, one bar per
    evaluated model) and reports/report.png (both side by side)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def loss(ax):
        _loss(ax, loss_log)

    def compliance(ax):
        _compliance(ax, results)

    folder.mkdir(parents=True, exist_ok=True)
    for name, panels in [("train_loss", [loss]), ("compliance", [compliance]), ("report", [loss, compliance])]:
        fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
        for draw, ax in zip(panels, axes[0]):
            draw(ax)
        fig.tight_layout()
        tmp = folder / f".{name}.png.tmp"
        fig.savefig(tmp, dpi=100, format="png")
        tmp.replace(folder / f"{name}.png")
        plt.close(fig)
