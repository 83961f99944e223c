"""PNG plots of evaluation results (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _finish(figure, axes, title: str, path: str | Path, **legend) -> Path:
    """The parts every accuracy plot shares: axis range, grid, title, legend (``legend``: where, if not "best");
    saved as PNG."""
    axes.set_ylabel("accuracy (%)")
    axes.set_ylim(0, 102)
    axes.grid(alpha=0.3)
    axes.set_title(title)
    axes.legend(**legend)
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


def plot_accuracy_vs_tokens(runs: list[dict], path: str | Path, title: str = "accuracy against generated tokens") -> Path:
    """One labelled point per run: fixed configurations as circles, greedy as a diamond, the controller as a star."""
    figure, axes = plt.subplots(figsize=(7, 4.5))
    fixed = [r for r in runs if r["method"] not in ("controller", "greedy")]
    axes.scatter([r["tokens_generated"] for r in fixed], [100 * r["accuracy"] for r in fixed], label="fixed (ratio x threads)")
    for run in runs:
        below = run["method"] == "greedy"  # often on the controller's point: label it underneath
        axes.annotate(run["method"], (run["tokens_generated"], 100 * run["accuracy"]), fontsize=8,
                      textcoords="offset points", xytext=(4, -12 if below else 4))
    for run in runs:
        if run["method"] == "greedy":
            axes.scatter([run["tokens_generated"]], [100 * run["accuracy"]], marker="D", color="tab:gray", label="one greedy thread")
        if run["method"] == "controller":
            axes.scatter([run["tokens_generated"]], [100 * run["accuracy"]], marker="*", s=220, color="tab:red", label="controller")
    axes.set_xscale("log")
    axes.set_xlabel("tokens generated (all threads, all problems)")
    return _finish(figure, axes, title, path)


def plot_throughput(report: dict, path: str | Path) -> Path:
    """Concurrent threads and tokens/s per method at one KV budget (two bar panels)."""
    runs = report["runs"]
    labels = [r["method"] if r["method"] != "engine" else f"engine {r['cr']:g}x" for r in runs]
    figure, (threads, speed) = plt.subplots(1, 2, figsize=(10, 4))
    threads.bar(labels, [r["threads"] for r in runs], color="tab:blue")
    threads.set_ylabel("concurrent threads")
    speed.bar(labels, [r["tokens_per_s"] for r in runs], color="tab:green")
    speed.set_ylabel("tokens / s")
    for axes in (threads, speed):
        axes.tick_params(axis="x", rotation=30)
        axes.grid(alpha=0.3, axis="y")
    figure.suptitle(f"one KV pool of {report['kv_budget_bytes'] / 1e6:.1f} MB, {report['max_new_tokens']} new tokens per thread")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return Path(path)


def plot_vote_curves(runs: list[dict], path: str | Path, title: str = "majority vote against threads per problem") -> Path:
    """One line per labelled run (vote accuracy of n of its threads), and a marker where the run itself voted."""
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        ns = [int(n) for n in run["curve"]]
        (line,) = axes.plot(ns, [100 * v for v in run["curve"].values()], label=f"{run['label']} ({run['n']} problems)")
        axes.scatter([run["threads"]], [100 * run["accuracy"]], color=line.get_color(), marker="D", zorder=3)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("threads voting per problem (diamond: the run's own vote)")
    return _finish(figure, axes, title, path)


def plot_paired_gain(report: dict, path: str | Path, title: str = "paired accuracy per draw of problems") -> Path:
    """Two bars per draw (and pooled): A's and B's accuracy, with A's gain and its 95% interval written above."""
    groups = [*report["draws"], {"label": "pooled", **report["pooled"]}]
    figure, axes = plt.subplots(figsize=(7.5, 4.5))
    xs = range(len(groups))
    axes.bar([x - 0.2 for x in xs], [100 * g["a"] for g in groups], width=0.4, label=report["a"])
    axes.bar([x + 0.2 for x in xs], [100 * g["b"] for g in groups], width=0.4, label=report["b"])
    for x, g in zip(xs, groups):
        low, high = g["gain_95"]
        axes.annotate(f"{100 * g['gain']:+.1f}\n[{100 * low:+.1f}, {100 * high:+.1f}]", (x, 100 * max(g["a"], g["b"]) + 2),
                      ha="center", fontsize=8)
    axes.set_xticks(list(xs), [f"{g['label']}\n({g['n']})" for g in groups])
    # The gains sit above the bars, where "best" would put the legend; the bars' feet hide nothing.
    return _finish(figure, axes, title, path, loc="lower center", ncol=2, framealpha=0.95)
