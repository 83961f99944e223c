"""PNG plots of evaluation results (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_accuracy_by_k(reports: dict[str, dict], path: str | Path, title: str = "accuracy by difficulty") -> Path:
    """One line per labelled report: accuracy against k (the number of derived assignments)."""
    figure, axes = plt.subplots(figsize=(7, 4.2))
    for label, report in reports.items():
        ks = [int(k) for k in report["accuracy_by_k"]]
        axes.plot(ks, [100 * v for v in report["accuracy_by_k"].values()], marker="o", label=label)
    axes.set_xlabel("k (derived assignments)")
    axes.set_ylabel("accuracy (%)")
    axes.set_ylim(0, 102)
    axes.grid(alpha=0.3)
    axes.set_title(title)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return Path(path)
