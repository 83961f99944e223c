"""``thinkpool bench throughput | overhead | controller | load | gpu``."""

from __future__ import annotations

import asyncio
import json
import os
import sys

from orchestrator.commands.common import check_adapters, read_problems_or_exit
from workers.factory import make_pool


def cmd_bench(args, parser) -> int:
    if args.bench == "gpu":
        from evaluation.gpu_bench import main as gpu_bench

        return gpu_bench(args.options, prog="thinkpool bench gpu")
    if args.bench == "overhead":
        return cmd_bench_overhead(args, parser)
    if args.bench == "controller":
        return cmd_bench_controller(args, parser)
    if args.bench == "load":
        from evaluation.benchmarks import bench_load

        report = asyncio.run(bench_load(args.url, args.concurrency, args.requests, args.samples, args.api_key))
        print(json.dumps(report) if args.json else
              f"{report['ok']}/{report['requests']} ok, lost {report['lost']}, 5xx {report['server_errors']}, "
              f"p50 {report['latency_s']['p50']}s p95 {report['latency_s']['p95']}s p99 {report['latency_s']['p99']}s, "
              f"pool peak {report['pool_peak_bytes']} of {report['pool_bytes']} bytes")
        return 0
    from dms_runtime.loading import default_model_path
    from evaluation.benchmarks import bench_throughput
    from evaluation.plots import plot_throughput

    model_dir = args.model or default_model_path()
    check_adapters(args.cr or [], model_dir, parser, "--cr")
    report = bench_throughput(model_dir, args.kv_budget, args.max_new_tokens, args.prompts, args.seed, ratios=args.cr,
                              progress=lambda line: print(line, file=sys.stderr))
    if not any(run["threads"] for run in report["runs"][1:]):
        parser.error(f"argument --kv-budget: {args.kv_budget} bytes cannot hold one thread of {args.max_new_tokens} tokens")
    if args.plot:
        plot_throughput(report, args.plot)
    if args.json:
        print(json.dumps(report))
    else:
        for run in report["runs"]:
            print(f"{run['method']:>11} {run['cr']:>4g}x  threads={run['threads']:>4}  tokens/s={run['tokens_per_s']:8.1f}  "
                  f"kv_peak_bytes={run['kv_peak_bytes']}")
    return 0


def cmd_bench_overhead(args, parser) -> int:
    from dms_runtime.loading import default_model_path
    from evaluation.benchmarks import bench_overhead, bench_rest_overhead, hard_prompts

    prompt = hard_prompts(1)[0]
    if args.url:
        report = bench_rest_overhead(args.url, prompt, args.samples, args.max_new_tokens, args.repeats,
                                     os.environ.get("THINKPOOL_API_KEY"))
    else:
        pool = make_pool(args.model or default_model_path(), None, args.workers)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model or default_model_path(), local_files_only=True)
        report = bench_overhead(pool, tokenizer(prompt)["input_ids"], args.samples, args.max_new_tokens, args.repeats,
                                args.stream_tokens)
        pool.shutdown()
        report["path"] = "ray" if args.workers else "in-process"
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{report['path']}: wall {report['wall_s']}s, engine busy {report['engine_busy_s']}s, "
              f"overhead {100 * report['overhead_fraction']:.1f}%")
    return 0


def cmd_bench_controller(args, parser) -> int:
    """Every fixed configuration and a greedy reference, then the controller, on the same problems and pool, each
    as solve requests through the service: one at a time (each with the whole pool) or ``--concurrency`` at once
    (sharing it), reported with the engine-seconds each took."""
    from dms_runtime.loading import default_model_path
    from evaluation.benchmarks import compare_to_fixed
    from orchestrator.commands.evaluate import make_service
    from orchestrator.controller_eval import controller_request, evaluate_through_service, fixed_request
    from evaluation.plots import plot_accuracy_vs_tokens

    problems = read_problems_or_exit(args, parser)
    model_dir = args.model or default_model_path()
    check_adapters([cr for cr, _ in args.fixed], model_dir, parser, "--fixed")
    pool = make_pool(model_dir, args.kv_budget, args.workers)
    service = make_service(args, parser, problems, model_dir, pool)
    kv_budget = service.info["kv_budget_bytes"]  # --kv-budget rounded down to whole KV slots: what a request may ask

    def fixed(cr: float, threads: int) -> tuple:
        config = {"cr": cr, "threads": threads, "decoding": "greedy" if threads == 1 else "sampled+majority",
                  "temperature": None if threads == 1 else args.temperature, "seed": args.seed}
        return lambda p: fixed_request(p, cr, threads, args.temperature, args.max_new_tokens, args.seed), config

    # The fixed configurations vote sampled threads; one greedy thread per problem runs beside them as a
    # reference (the controller opens with one), compared separately.
    configurations = [(f"{cr:g}x{n}", *fixed(cr, n)) for cr, n in args.fixed] + [("greedy", *fixed(1.0, 1))]
    # temperature: the one fixed for every task, or null when each task's plan chose (see temperatures_chosen).
    planned = {"max_threads": args.max_threads, "seed": args.seed,
               "temperature": service.controller.temperature if service.controller else None}
    configurations.append(("controller", lambda p: controller_request(p, kv_budget, args.max_threads, args.seed),
                           planned))
    runs = []
    try:
        for method, request_for, config in configurations:
            report = asyncio.run(evaluate_through_service(problems, service, request_for, method, args.concurrency, pool,
                                                          progress=lambda line: print(line, file=sys.stderr)))
            report.pop("problems")
            runs.append({**report, "kv_budget_bytes": kv_budget, "config": config})
    finally:
        pool.shutdown()
    fixed_runs, greedy, controller_run = runs[:-2], runs[-2], runs[-1]
    result = {"problems": str(args.problems), "n": len(problems), "kv_budget_bytes": kv_budget,
              "concurrency": args.concurrency, "runs": runs,
              "comparison": compare_to_fixed(fixed_runs, controller_run),
              "versus_greedy": {"accuracy_gain": round(controller_run["accuracy"] - greedy["accuracy"], 4),
                                "token_ratio": round(controller_run["tokens_generated"] / max(1, greedy["tokens_generated"]), 4)}}
    if args.plot:
        plot_accuracy_vs_tokens(runs, args.plot, title=f"{args.problems.name}: accuracy against generated tokens")
    if args.json:
        print(json.dumps(result))
    else:
        for run in runs:
            print(f"{run['method']:>10}  accuracy={run['accuracy']:.3f}  tokens={run['tokens_generated']}  "
                  f"engine_s={run['engine_busy_s']}")
        print(json.dumps(result["comparison"]))
    return 0
