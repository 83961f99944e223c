"""The engine's tokens/s on the CPU, this checkout against another (e.g. the commit before a change), side by side.

Each run is ``thinkpool bench throughput``'s engine part (``evaluation.benchmarks.bench_engine``: as many threads of
four hard problems as the pool holds at once, at each ratio) in a fresh process whose ``PYTHONPATH`` is one checkout;
runs alternate between the two checkouts, so the machine's load falls on both alike. Prints JSON with every run and
the ratio of medians (this checkout over the other), per ratio.

    git worktree add /tmp/base-engine <base commit>; git worktree add /tmp/new-engine <new commit>
    .venv/bin/python research/bench_engine_cpu.py --base /tmp/base-engine --new /tmp/new-engine --runs 3 \\
        --out docs/results/engine_cpu_side_by_side.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHILD = """
import json, sys, torch
from evaluation.benchmarks import bench_engine, hard_prompts
from workers.thread import SamplingParams
from workers.worker import WorkerConfig, build_engine
model, budget, tokens, prompts, ratios, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \\
    [float(r) for r in sys.argv[5].split(",")], int(sys.argv[6])
torch.set_num_threads(threads)
engine = build_engine(WorkerConfig(model=model, kv_budget_bytes=budget))
texts = hard_prompts(prompts)
runs = [bench_engine(engine, texts, cr, SamplingParams(0.8, 1.0, tokens, 0)) for cr in ratios]
print(json.dumps(runs))
"""


def one_run(checkout: Path, args) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    done = subprocess.run([sys.executable, "-c", CHILD, str(args.model), str(args.kv_budget), str(args.max_new_tokens),
                           str(args.prompts), ",".join(f"{r:g}" for r in args.cr), str(args.threads)],
                          cwd=checkout, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"run in {checkout} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", type=Path, required=True,
                   help="the other checkout (e.g. a git worktree of the base commit)")
    p.add_argument("--new", type=Path, default=ROOT,
                   help="this change's checkout (default: this one; a worktree of a commit keeps the runs from edits)")
    p.add_argument("--model", type=Path, default=ROOT / "checkpoints" / "chain-qwen3")
    p.add_argument("--kv-budget", type=int, default=13_500_000, help="bytes (thinkpool bench throughput's 13.5MB)")
    p.add_argument("--max-new-tokens", type=int, default=1000)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--cr", type=float, nargs="+", default=[1.0, 8.0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    checkouts = {"base": args.base.resolve(), "new": args.new.resolve()}
    runs: dict[str, list[list[dict]]] = {"base": [], "new": []}
    for index in range(args.runs):
        for name in (("base", "new") if index % 2 == 0 else ("new", "base")):
            runs[name].append(one_run(checkouts[name], args))
            print(f"run {index + 1} {name}: " + ", ".join(f"{r['cr']:g}x {r['tokens_per_s']:.0f} tok/s"
                                                        for r in runs[name][-1]), file=sys.stderr)
    summary = {}
    for position, cr in enumerate(args.cr):
        rates = {name: [run[position]["tokens_per_s"] for run in runs[name]] for name in runs}
        medians = {name: statistics.median(values) for name, values in rates.items()}
        summary[f"{cr:g}x"] = {"base_tokens_per_s": [round(v, 1) for v in rates["base"]],
                               "new_tokens_per_s": [round(v, 1) for v in rates["new"]],
                               "base_median": round(medians["base"], 1), "new_median": round(medians["new"], 1),
                               "new_over_base": round(medians["new"] / medians["base"], 3),
                               "threads": [run[position]["threads"] for run in runs["new"]]}
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=args.new, capture_output=True, text=True).stdout.strip()
    base = subprocess.run(["git", "rev-parse", "HEAD"], cwd=args.base, capture_output=True, text=True).stdout.strip()
    report = {"command": "python research/bench_engine_cpu.py " + " ".join(sys.argv[1:]), "new_commit": git,
              "base_commit": base, "model": str(args.model.relative_to(ROOT) if args.model.is_relative_to(ROOT)
                                                    else args.model),
              "kv_budget_bytes": args.kv_budget, "max_new_tokens": args.max_new_tokens, "prompts": args.prompts,
              "torch_threads": args.threads, "summary": summary, "runs": runs}
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
