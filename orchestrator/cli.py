"""The ``thinkpool`` command line. Bad input exits with code 2 and a message naming the option and the limit."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from dms_runtime.kv_growth import MIN_PAST_WINDOW
from orchestrator.arguments import bounded, byte_size, fixed_config, k_range, sample_count
from orchestrator.settings import get_settings
from policies.planner import SIGNALS
from policies.voting import VOTES
from tasks.families import FAMILIES


def build_parser() -> argparse.ArgumentParser:
    settings = get_settings()
    max_samples = settings.limits.max_samples
    parser = argparse.ArgumentParser(prog="thinkpool", description="Reasoning threads inside a fixed KV budget.")
    commands = parser.add_subparsers(dest="command", required=True)

    def add_model(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", type=Path, default=None, help="model directory (default: the shipped model)")

    def add_sampling(p: argparse.ArgumentParser, allow_fit: bool = False, allow_auto: bool = False) -> None:
        if allow_auto:
            p.add_argument("--samples", type=sample_count(max_samples, word="auto"), default=1,
                           help="threads (1 = greedy) or auto: the controller chooses ratio and threads")
        elif allow_fit:
            p.add_argument("--samples", type=sample_count(max_samples), default=1,
                           help="threads per problem (1 = greedy; fit = as many as the KV pool holds at once)")
        else:
            p.add_argument("--samples", type=bounded(int, 1, max_samples), default=1, help="threads per problem (1 = greedy)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--temperature", type=bounded(float, 0.01, 5.0), default=settings.sampling.temperature)
        p.add_argument("--top-p", type=bounded(float, 0.01, 1.0), default=settings.sampling.top_p)
        p.add_argument("--max-new-tokens", type=bounded(int, 1, 8192), default=settings.sampling.max_new_tokens)

    solve = commands.add_parser("solve", help="solve one problem on the embedded default")
    solve.add_argument("prompt", help="the problem: a chain problem ('a=1;b=2;c=a+b;?c') or free text, by its task")
    add_sampling(solve, allow_auto=True)
    add_model(solve)
    solve.add_argument("--cr", type=bounded(float, 1, 64), default=1.0, help="DMS compression ratio (1 = vanilla)")
    solve.add_argument("--workers", type=bounded(int, 0, 64), default=1, help="Ray worker actors (0: in this process)")
    solve.add_argument("--json", action="store_true", help="print one JSON object")
    solve.add_argument("--task", choices=["chain", "math", "regex"], default=None,
                       help="task family (default: the model's, from its directory's thinkpool.json)")
    solve.add_argument("--answer-pattern", default=None, help="the regex task's answer pattern")

    evaluate = commands.add_parser("eval", help="evaluate a problem file")
    evaluate.add_argument("--problems", type=Path, required=True, help="JSONL file of {id, prompt, answer}")
    evaluate.add_argument("--limit", type=bounded(int, 1), default=None)
    add_sampling(evaluate, allow_fit=True)
    add_model(evaluate)
    evaluate.add_argument("--batch-size", type=bounded(int, 1, 4096), default=settings.generation.batch_size,
                          help="threads per batch in the reference loop (--press runs)")
    evaluate.add_argument("--kv-budget", type=byte_size, default=None,
                          help="KV pool size in bytes (e.g. 12MB); problems then run one at a time, each with the whole pool")
    evaluate.add_argument("--reserve", choices=["measured", "nominal"], default="measured",
                          help="per-thread KV reservation: each adapter's measured growth, or 1/cr (an A/B)")
    evaluate.add_argument("--workers", type=bounded(int, 0, 64), default=1,
                          help="Ray worker actors (0: one engine in this process, no Ray)")
    evaluate.add_argument("--cr", type=bounded(float, 1, 64), nargs="+", default=None,
                          help="DMS compression ratio(s): the adapter dms-<CR>x beside the model; 1 = vanilla")
    evaluate.add_argument("--press", nargs="+", default=None, metavar="NAME",
                          help="training-free baseline(s): window streaming tova h2o knorm snapkv")
    evaluate.add_argument("--compression", type=bounded(float, 1, 64), default=None,
                          help="the ratio every --press is held to")
    evaluate.add_argument("--controller", choices=["auto"], default=None,
                          help="let the controller choose ratio and threads per problem (needs --kv-budget)")
    evaluate.add_argument("--profile", type=Path, default=None,
                          help="the controller's calibration profile (default: the model's calibration-<task>.json)")
    evaluate.add_argument("--max-threads", type=bounded(int, 1, max_samples), default=32,
                          help="the controller's thread budget per problem")
    evaluate.add_argument("--vote", choices=VOTES, default="majority",
                          help="how sampled threads' answers become one: majority (ties to the surer threads) or "
                               "confidence (the surer half, weighted by confidence)")
    evaluate.add_argument("--json", action="store_true", help="print one JSON summary object")
    evaluate.add_argument("--plot", type=Path, default=None, help="draw accuracy by k to this PNG")
    evaluate.add_argument("--output", type=Path, default=None, help="write per-problem results (JSONL)")

    bench = commands.add_parser("bench", help="benchmarks that print JSON").add_subparsers(dest="bench", required=True)
    throughput = bench.add_parser("throughput", help="threads and tokens/s that one KV budget buys, per method")
    throughput.add_argument("--kv-budget", type=byte_size, required=True, help="the pool size, e.g. 12MB")
    throughput.add_argument("--max-new-tokens", type=bounded(int, 16, 8192), default=settings.sampling.max_new_tokens)
    throughput.add_argument("--prompts", type=bounded(int, 1, 64), default=4, help="hard problems (k 16-20) the threads share")
    throughput.add_argument("--cr", type=bounded(float, 1, 64), nargs="+", default=None,
                            help="engine ratios to run (default: 1 and every adapter beside the model)")
    throughput.add_argument("--seed", type=int, default=0)
    throughput.add_argument("--json", action="store_true")
    throughput.add_argument("--plot", type=Path, default=None, help="draw threads and tokens/s per method to this PNG")
    add_model(throughput)
    overhead = bench.add_parser("overhead", help="what the path around the engine costs for one multi-thread solve")
    overhead.add_argument("--samples", type=bounded(int, 1, 256), default=16)
    overhead.add_argument("--max-new-tokens", type=bounded(int, 16, 8192), default=settings.sampling.max_new_tokens)
    overhead.add_argument("--repeats", type=bounded(int, 1, 100), default=3)
    overhead.add_argument("--workers", type=bounded(int, 0, 64), default=1, help="Ray worker actors (0: in this process)")
    overhead.add_argument("--url", default=None, help="measure through this running server (REST + its workers)")
    overhead.add_argument("--stream-tokens", action="store_true",
                          help="each repeat also with the threads' tokens streamed as they decode; compare")
    overhead.add_argument("--json", action="store_true")
    add_model(overhead)
    versus = bench.add_parser("controller", help="the controller against fixed (ratio, threads) configurations, same problems and pool")
    versus.add_argument("--problems", type=Path, required=True, help="JSONL file of {id, prompt, answer}")
    versus.add_argument("--limit", type=bounded(int, 1), default=None)
    versus.add_argument("--kv-budget", type=byte_size, required=True,
                        help="the KV pool: one problem's threads may hold all of it, tasks running at once share it")
    versus.add_argument("--concurrency", type=bounded(int, 1, 256), default=1,
                        help="tasks running at once on the one pool, for every configuration (default: 1 at a time)")
    versus.add_argument("--fixed", type=fixed_config, nargs="+", default=[(1.0, 4), (4.0, 8), (8.0, 16), (8.0, 32)],
                        help="fixed configurations CRxTHREADS (default: 1x4 4x8 8x16 8x32)")
    versus.add_argument("--profile", type=Path, default=None,
                        help="the controller's calibration profile (default: the model's calibration-<task>.json)")
    versus.add_argument("--max-threads", type=bounded(int, 1, max_samples), default=32, help="the controller's threads per problem")
    versus.add_argument("--seed", type=int, default=0)
    versus.add_argument("--temperature", type=bounded(float, 0.01, 5.0), default=settings.sampling.temperature)
    versus.add_argument("--max-new-tokens", type=bounded(int, 16, 8192), default=settings.sampling.max_new_tokens)
    versus.add_argument("--workers", type=bounded(int, 0, 64), default=0, help="Ray worker actors (0: in this process)")
    versus.add_argument("--json", action="store_true")
    versus.add_argument("--plot", type=Path, default=None, help="draw accuracy against generated tokens to this PNG")
    add_model(versus)
    load = bench.add_parser("load", help="drive a running server: latency percentiles, errors, lost requests, pool peak")
    load.add_argument("--url", required=True)
    load.add_argument("--concurrency", type=bounded(int, 1, 4096), default=32)
    load.add_argument("--requests", type=bounded(int, 1, 1_000_000), default=200)
    load.add_argument("--samples", type=bounded(int, 1, 256), default=2)
    load.add_argument("--api-key", default=os.environ.get("THINKPOOL_API_KEY"))
    load.add_argument("--json", action="store_true")
    # The GPU benchmark parses its own options (``python -m evaluation.gpu_bench`` runs where this CLI cannot, with no
    # pydantic): every word after ``gpu`` goes to it untouched (no prefix character is an option here), --help too.
    gpu = bench.add_parser("gpu", add_help=False, prefix_chars="\0",
                           help="the prepared GPU benchmark: HF generate, the engine at CR 1 and DMS-8x, a retrofit step "
                                "(thinkpool bench gpu --help)")
    gpu.add_argument("options", nargs=argparse.REMAINDER)

    serve = commands.add_parser("serve", help="the REST service (FastAPI): /v1/solve, jobs, OpenAI chat and completions")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=bounded(int, 1, 65535), default=8000)
    serve.add_argument("--workers", type=bounded(int, 0, 64), default=1, help="Ray worker actors (0: in this process)")
    serve.add_argument("--kv-budget", type=byte_size, default=None, help="each worker's KV pool size")
    serve.add_argument("--allow-anonymous", action="store_true",
                       help="serve on a non-loopback --host without THINKPOOL_API_KEYS (anyone who reaches it may use it)")
    add_model(serve)

    from orchestrator.batch import add_arguments as add_batch_arguments

    add_batch_arguments(commands.add_parser("batch", help="solve a problem file on the workers (or a Ray cluster), one result line each"))

    calibrate = commands.add_parser("calibrate", help="measure the planner's profile (accuracy and tokens by difficulty, ratio, threads)")
    calibrate.add_argument("--problems", type=Path, default=None,
                           help="JSONL file of {id, prompt, answer[, task]} to measure on (binned by the greedy thread's "
                                "confidence); default: fresh chain problems per k bin")
    calibrate.add_argument("--task", choices=FAMILIES, default=None, help="task family of rows that name none (default: the model's)")
    calibrate.add_argument("--limit", type=bounded(int, 1), default=None, help="the file's first N problems")
    calibrate.add_argument("--signal", choices=SIGNALS, default=None,
                           help="what the bins are bins of: k (generated chain problems) or greedy_confidence (any task; "
                                "the default with --problems)")
    calibrate.add_argument("--quantile-bins", type=bounded(int, 1, 16), default=4,
                           help="greedy_confidence: bins of equal numbers of problems")
    calibrate.add_argument("--bins", type=k_range, nargs="+", default=[(1, 5), (6, 10), (11, 15), (16, 20)],
                           help="k: the difficulty bins of generated chain problems")
    calibrate.add_argument("--per-bin", type=bounded(int, 1, 1000), default=8, help="k: fresh problems per bin")
    calibrate.add_argument("--cr", type=bounded(float, 1, 64), nargs="+", default=None, help="ratios (default: 1 and every adapter)")
    calibrate.add_argument("--threads", type=bounded(int, 1, max_samples), default=16, help="sampled threads per problem")
    calibrate.add_argument("--max-new-tokens", type=bounded(int, 16, 8192), default=settings.sampling.max_new_tokens)
    calibrate.add_argument("--temperature", type=bounded(float, 0.01, 5.0), nargs="+", default=[settings.sampling.temperature],
                           help="sampled threads' temperatures (the controller plans among them; the first is the default)")
    calibrate.add_argument("--top-p", type=bounded(float, 0.01, 1.0), default=settings.sampling.top_p)
    calibrate.add_argument("--seed", type=int, default=777)
    calibrate.add_argument("--workers", type=bounded(int, 0, 64), default=1)
    calibrate.add_argument("--output", type=Path, default=None,
                           help="where to write the profile (default: calibration-<task>.json beside the model)")
    add_model(calibrate)

    info = commands.add_parser("info", help="the model served by default and its KV geometry")
    add_model(info)
    info.add_argument("--json", action="store_true")

    generate = commands.add_parser("generate", help="write a seeded problem file")
    generate.add_argument("--n", type=bounded(int, 1, 1_000_000), required=True)
    generate.add_argument("--k", type=k_range, default=(1, 20), help="difficulty K or KMIN-KMAX (default 1-20)")
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--reach", type=bounded(int, 0, 25), default=0,
                          help="first operands come from at least this many assignments back (far-back reads)")
    generate.add_argument("--output", type=Path, required=True)

    train = commands.add_parser("train", help="train the base model from a config (resumable)")
    train.add_argument("--config", type=Path, default=Path("configs/train_base.yaml"))
    train.add_argument("--steps", type=bounded(int, 1), default=None, help="stop after this many steps")
    retrofit = commands.add_parser("retrofit", help="train DMS adapters for a model (resumable)")
    retrofit.add_argument("--config", type=Path, default=None,
                          help="the recipe (default: configs/retrofit_byo.yaml with --problems, "
                               "else configs/retrofit_chain.yaml)")
    retrofit.add_argument("--model", type=Path, default=None, help="base model directory (overrides the config)")
    retrofit.add_argument("--problems", type=Path, default=None,
                          help="JSONL file of {id, prompt}: distil on the model's own sampled completions of these "
                               "prompts (cached in the output directory) instead of generated chain problems")
    retrofit.add_argument("--task", choices=FAMILIES, default=None,
                          help="task family of --problems rows that name none (default: the model's)")
    retrofit.add_argument("--max-new-tokens", type=bounded(int, 1, 131072), default=None,
                          help="the longest completion sampled per prompt (with --problems)")
    retrofit.add_argument("--output", type=Path, default=None,
                          help="where adapters go (default: beside the model; with --full-finetune: MODEL-dms)")
    retrofit.add_argument("--ratios", type=bounded(float, 1.01, 64), nargs="+", default=None,
                          help="compression ratios to snapshot, e.g. 2 4 8")
    retrofit.add_argument("--window", type=bounded(int, 0, 1_000_000), default=None)
    retrofit.add_argument("--parametrization", choices=["adapter", "query_neuron", "nvidia_separate"], default=None,
                          help="nvidia_separate: NVIDIA's separate gates (reading the layer input before its norm)")
    retrofit.add_argument("--layout", choices=["thinkpool", "nvidia"], default=None,
                          help="nvidia: also export every ratio as a model directory in NVIDIA's DMS layout, "
                               "OUTPUT/nvidia-<CR>x (needs --parametrization nvidia_separate)")
    retrofit.add_argument("--per-layer", action="store_true", help="one decision per layer instead of per KV head")
    retrofit.add_argument("--full-finetune", action="store_true", help="train all weights, not only the gates")
    retrofit.add_argument("--steps", type=bounded(int, 1), default=None, help="stop after this many steps")
    retrofit.add_argument("--thresholds-only", action="store_true",
                          help="do not train: fit the thresholds of the adapters already in the output directory")

    growth = commands.add_parser("kv-growth", help="measure what each ratio's DMS gates keep of a thread; store it as its reservation")
    growth.add_argument("--model", type=Path, required=True,
                        help="model directory: its dms-<cr>x adapters, or its own gates in NVIDIA's DMS layout")
    growth.add_argument("--cr", type=bounded(float, 1.01, 64), nargs="+", default=None, help="ratios (default: every one)")
    growth.add_argument("--problems", type=Path, default=None,
                        help="JSONL file of {prompt[, task, id]} to measure on (default: fresh chain problems)")
    growth.add_argument("--task", choices=FAMILIES, default=None, help="task family of rows that name none (default: the model's)")
    growth.add_argument("--n", type=bounded(int, 1, 1000), default=16, help="problems per ratio (a file's first N)")
    growth.add_argument("--k", type=k_range, default=None,
                        help="difficulties of the generated chain problems (default: each adapter's threshold-fit range)")
    growth.add_argument("--threads", type=bounded(int, 1, 64), default=8, help="sampled threads per problem")
    growth.add_argument("--temperature", type=bounded(float, 0.01, 5.0), default=settings.sampling.temperature)
    growth.add_argument("--max-new-tokens", type=bounded(int, 16, 8192), default=settings.sampling.max_new_tokens,
                        help="per thread, at most what the model's context leaves")
    growth.add_argument("--min-past-window", type=bounded(int, 1, 8192), default=MIN_PAST_WINDOW,
                        help="a thread counts once this many of its own tokens left the window (lower it for a model "
                             "whose threads are short)")
    growth.add_argument("--quantile", type=bounded(float, 0.5, 1.0), default=0.95, help="over threads, of the kept fractions")
    growth.add_argument("--seed", type=int, default=9101)
    growth.add_argument("--dry-run", action="store_true", help="print the measurement; store nothing")
    return parser


COMMANDS = {  # command -> (module, function); imported only when used
    "solve": ("orchestrator.commands.solve", "cmd_solve"), "eval": ("orchestrator.commands.evaluate", "cmd_eval"),
    "bench": ("orchestrator.commands.bench", "cmd_bench"), "serve": ("orchestrator.commands.serve", "cmd_serve"),
    "batch": ("orchestrator.batch", "cmd_batch"), "calibrate": ("orchestrator.commands.calibrate", "cmd_calibrate"),
    "info": ("orchestrator.commands.model", "cmd_info"), "generate": ("orchestrator.commands.model", "cmd_generate"),
    "train": ("orchestrator.commands.model", "cmd_train"), "retrofit": ("orchestrator.commands.model", "cmd_retrofit"),
    "kv-growth": ("orchestrator.commands.model", "cmd_kv_growth"),
}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    module, function = COMMANDS[args.command]
    return getattr(importlib.import_module(module), function)(args, parser)


if __name__ == "__main__":
    sys.exit(main())
