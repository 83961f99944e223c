"""PNG plots of evaluation results (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _finish(figure, axes, title: str, path: str | Path) -> Path:
    """The parts every accuracy plot shares: axis range, grid, title, legend; saved as PNG."""
    axes.set_ylabel("accuracy (%)")
    axes.set_ylim(0, 102)
    axes.grid(alpha=0.3)
    axes.set_title(title)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return Path(path)


def plot_accuracy_by_k(reports: dict[str, dict], path: str | Path, title: str = "accuracy by difficulty") -> Path:
    """One line per labelled report: accuracy against k (the number of derived assignments)."""
    figure, axes = plt.subplots(figsize=(7, 4.2))
    for label, report in reports.items():
        ks = [int(k) for k in report["accuracy_by_k"]]
        axes.plot(ks, [100 * v for v in report["accuracy_by_k"].values()], marker="o", label=label)
    axes.set_xlabel("k (derived assignments)")
    return _finish(figure, axes, title, path)


def plot_pareto(runs: list[dict], path: str | Path, title: str = "accuracy against KV compression") -> Path:
    """Accuracy against realized compression, one marker per run, grouped by method family."""
    figure, axes = plt.subplots(figsize=(7, 4.5))
    families: dict[str, list[dict]] = {}
    for run in runs:
        families.setdefault(run["method"].split("-")[0], []).append(run)
    for family, members in families.items():
        members = sorted(members, key=lambda r: r["realized_cr"])
        axes.plot([r["realized_cr"] for r in members], [100 * r["accuracy"] for r in members], marker="o", label=family)
        for run in members:
            axes.annotate(run["method"], (run["realized_cr"], 100 * run["accuracy"]), fontsize=7,
                          textcoords="offset points", xytext=(3, 3))
    axes.set_xscale("log", base=2)
    axes.set_xlabel("realized compression (tokens processed / tokens held per head)")
    return _finish(figure, axes, title, path)
