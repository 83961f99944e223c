"""The ``thinkpool`` command line. Bad input exits with code 2 and a message naming the option and the limit."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

from orchestrator.settings import get_settings


def bounded(kind: Callable, low: float | None = None, high: float | None = None) -> Callable:
    """An argparse type that converts with ``kind`` and enforces ``low <= value <= high``."""

    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if (low is not None and value < low) or (high is not None and value > high):
            span = f"between {low} and {high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be {span}, got {text}")
        return value

    return convert


def k_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    try:
        k_min, k_max = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K or KMIN-KMAX, got {text!r}") from None
    if not 1 <= k_min <= k_max <= 24:
        raise argparse.ArgumentTypeError(f"k range must lie within 1-24 with KMIN <= KMAX, got {text!r}")
    return k_min, k_max


UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def byte_size(text: str) -> int:
    """Bytes: ``12000000``, ``12e6``, ``64MiB``, ``1.5GB``."""
    number = text.strip().lower().rstrip("bikmg")
    unit = text.strip().lower()[len(number):]
    try:
        value = int(float(number) * UNITS[unit])
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"expected bytes such as 12000000, 64MiB or 1.5GB, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return value


def sample_count(maximum: int) -> Callable:
    """``fit`` (as many threads as the KV pool holds) or a thread count in 1..maximum."""
    count = bounded(int, 1, maximum)

    def convert(text: str):
        return "fit" if text == "fit" else count(text)

    return convert


def build_parser() -> argparse.ArgumentParser:
    settings = get_settings()
    max_samples = settings.limits.max_samples
    parser = argparse.ArgumentParser(prog="thinkpool", description="Reasoning threads inside a fixed KV budget.")
    commands = parser.add_subparsers(dest="command", required=True)

    def add_model(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", type=Path, default=None, help="model directory (default: the shipped model)")

    def add_sampling(p: argparse.ArgumentParser, allow_fit: bool = False) -> None:
        if allow_fit:
            p.add_argument("--samples", type=sample_count(max_samples), default=1,
                           help="threads per problem (1 = greedy; fit = as many as the KV pool holds at once)")
        else:
            p.add_argument("--samples", type=bounded(int, 1, max_samples), default=1, help="threads per problem (1 = greedy)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--temperature", type=bounded(float, 0.01, 5.0), default=settings.sampling.temperature)
        p.add_argument("--top-p", type=bounded(float, 0.01, 1.0), default=settings.sampling.top_p)
        p.add_argument("--max-new-tokens", type=bounded(int, 1, 8192), default=settings.sampling.max_new_tokens)

    solve = commands.add_parser("solve", help="solve one problem on the embedded default")
    solve.add_argument("prompt", help="a chain problem, e.g. 'a=1;b=2;c=a+b;?c'")
    add_sampling(solve)
    add_model(solve)
    solve.add_argument("--cr", type=bounded(float, 1, 64), default=1.0, help="DMS compression ratio (1 = vanilla)")
    solve.add_argument("--workers", type=bounded(int, 0, 64), default=1, help="Ray worker actors (0: in this process)")
    solve.add_argument("--json", action="store_true", help="print one JSON object")

    evaluate = commands.add_parser("eval", help="evaluate a problem file")
    evaluate.add_argument("--problems", type=Path, required=True, help="JSONL file of {id, prompt, answer}")
    evaluate.add_argument("--limit", type=bounded(int, 1), default=None)
    add_sampling(evaluate, allow_fit=True)
    add_model(evaluate)
    evaluate.add_argument("--batch-size", type=bounded(int, 1, 4096), default=settings.generation.batch_size,
                          help="threads per batch in the reference loop (--press runs)")
    evaluate.add_argument("--kv-budget", type=byte_size, default=None,
                          help="KV pool size in bytes (e.g. 12MB); problems then run one at a time, each with the whole pool")
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
    evaluate.add_argument("--profile", type=Path, default=Path("configs/calibration_chain.json"),
                          help="the controller's calibration profile (thinkpool calibrate)")
    evaluate.add_argument("--max-threads", type=bounded(int, 1, max_samples), default=32,
                          help="the controller's thread budget per problem")
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
    overhead.add_argument("--json", action="store_true")
    add_model(overhead)
    load = bench.add_parser("load", help="drive a running server: latency percentiles, errors, lost requests, pool peak")
    load.add_argument("--url", required=True)
    load.add_argument("--concurrency", type=bounded(int, 1, 4096), default=32)
    load.add_argument("--requests", type=bounded(int, 1, 1_000_000), default=200)
    load.add_argument("--samples", type=bounded(int, 1, 256), default=2)
    load.add_argument("--api-key", default=os.environ.get("THINKPOOL_API_KEY"))
    load.add_argument("--json", action="store_true")

    serve = commands.add_parser("serve", help="the REST service (FastAPI): /v1/solve, jobs, completions, metrics")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=bounded(int, 1, 65535), default=8000)
    serve.add_argument("--workers", type=bounded(int, 0, 64), default=1, help="Ray worker actors (0: in this process)")
    serve.add_argument("--kv-budget", type=byte_size, default=None, help="each worker's KV pool size")
    add_model(serve)

    calibrate = commands.add_parser("calibrate", help="measure the planner's profile (accuracy and tokens by difficulty, ratio, threads)")
    calibrate.add_argument("--bins", type=k_range, nargs="+", default=[(1, 5), (6, 10), (11, 15), (16, 20)])
    calibrate.add_argument("--cr", type=bounded(float, 1, 64), nargs="+", default=None, help="ratios (default: 1 and every adapter)")
    calibrate.add_argument("--problems", type=bounded(int, 1, 1000), default=8, help="fresh problems per bin")
    calibrate.add_argument("--threads", type=bounded(int, 1, max_samples), default=16, help="sampled threads per problem")
    calibrate.add_argument("--max-new-tokens", type=bounded(int, 16, 8192), default=settings.sampling.max_new_tokens)
    calibrate.add_argument("--temperature", type=bounded(float, 0.01, 5.0), default=settings.sampling.temperature)
    calibrate.add_argument("--seed", type=int, default=777)
    calibrate.add_argument("--workers", type=bounded(int, 0, 64), default=1)
    calibrate.add_argument("--output", type=Path, default=Path("configs/calibration_chain.json"))
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
    retrofit.add_argument("--config", type=Path, default=Path("configs/retrofit_chain.yaml"))
    retrofit.add_argument("--model", type=Path, default=None, help="base model directory (overrides the config)")
    retrofit.add_argument("--output", type=Path, default=None,
                          help="where adapters go (default: beside the model; with --full-finetune: MODEL-dms)")
    retrofit.add_argument("--ratios", type=bounded(float, 1.01, 64), nargs="+", default=None,
                          help="compression ratios to snapshot, e.g. 2 4 8")
    retrofit.add_argument("--window", type=bounded(int, 0, 1_000_000), default=None)
    retrofit.add_argument("--parametrization", choices=["adapter", "query_neuron"], default=None)
    retrofit.add_argument("--per-layer", action="store_true", help="one decision per layer instead of per KV head")
    retrofit.add_argument("--full-finetune", action="store_true", help="train all weights, not only the gates")
    retrofit.add_argument("--steps", type=bounded(int, 1), default=None, help="stop after this many steps")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = {"solve": cmd_solve, "eval": cmd_eval, "info": cmd_info, "generate": cmd_generate, "train": cmd_train,
               "retrofit": cmd_retrofit, "bench": cmd_bench, "calibrate": cmd_calibrate, "serve": cmd_serve}
    return handler[args.command](args, parser)


def _load(args, parser):
    from dms_runtime.loading import ModelLoadError, default_model_path, load_model

    path = args.model or default_model_path()
    try:
        model, tokenizer = load_model(path)
    except ModelLoadError as error:
        parser.error(f"argument --model: {error}")
    return model, tokenizer, str(path)


def cmd_solve(args, parser) -> int:
    from dms_runtime.loading import default_model_path
    from policies.voting import majority_vote
    from tasks.chain import ProblemError, parse_problem
    from tasks.prompt import format_prompt
    from workers.thread import SamplingParams
    from workers.worker import ProblemRequest, available_ratios

    try:
        parse_problem(args.prompt)
    except ProblemError as error:
        parser.error(f"argument prompt: {error}")
    model_dir = args.model or default_model_path()
    if not (Path(model_dir) / "config.json").is_file():
        parser.error(f"argument --model: no model at {model_dir}: expected a Hugging Face checkpoint directory with config.json")
    if args.cr != 1 and args.cr not in available_ratios(model_dir):
        parser.error(f"argument --cr: no DMS adapter for {args.cr:g}x beside {model_dir}")
    started = time.perf_counter()
    pool = make_pool(model_dir, None, args.workers)
    params = SamplingParams(0.0 if args.samples == 1 else args.temperature, args.top_p, args.max_new_tokens, args.seed)
    threads = pool.solve(ProblemRequest("solve", format_prompt(args.prompt), tuple(range(args.samples)), params, args.cr))
    stats = [s for s in asyncio.run(pool.stats()) if s is not None]
    pool.shutdown()
    vote = majority_vote([t.answer for t in threads])
    report = {
        "prompt": args.prompt,
        "answer": vote.answer,
        "votes": vote.counts,
        "samples": args.samples,
        "cr": args.cr,
        "tokens": sum(t.tokens for t in threads),
        "realized_cr": sum(t.realized_cr for t in threads) / len(threads),
        "kv_peak_bytes": max(s.pool_peak_bytes for s in stats),
        "time_s": round(time.perf_counter() - started, 3),
    }
    if args.json:
        print(json.dumps(report))
    else:
        votes = ", ".join(f"{a}: {c}" for a, c in vote.counts.items()) or "no thread answered"
        print(f"answer: {vote.answer}\nvotes: {votes}\ntokens: {report['tokens']}  time: {report['time_s']}s")
    return 0


def eval_methods(args, parser, model_dir) -> list:
    """The KV methods an eval run compares, checked before any work starts."""
    from dms_runtime.adapters import AdapterError
    from workers.kv_methods import KVMethod, check_available

    if (args.press is None) != (args.compression is None):
        parser.error("argument --press: --press and --compression go together (--press NAME --compression X)")
    methods = [KVMethod.dms(cr) for cr in (args.cr or ([] if args.press else [1.0]))]
    try:
        methods += [KVMethod.baseline(name, args.compression) for name in args.press or []]
        for method in methods:
            check_available(method, model_dir)
    except ValueError as error:
        option = "--press" if "press" in str(error) else "--cr"
        parser.error(f"argument {option}: {error}")
    return methods


def make_pool(model_dir, kv_budget: int | None, workers: int):
    """The workers an eval or solve runs on: Ray actors, or (``workers == 0``) one engine in this process."""
    from workers.worker import WorkerConfig

    if kv_budget is None and os.environ.get("THINKPOOL_KV_BUDGET"):
        kv_budget = byte_size(os.environ["THINKPOOL_KV_BUDGET"])
    config = WorkerConfig(model=str(model_dir), kv_budget_bytes=kv_budget)
    if workers == 0:
        from workers.local import LocalPool

        return LocalPool(config)
    from workers.pool import WorkerPool

    return WorkerPool(config, num_workers=workers)


def cmd_eval(args, parser) -> int:
    from orchestrator.evaluate import EvalOptions, evaluate, evaluate_on_pool
    from orchestrator.plots import plot_accuracy_by_k, plot_pareto
    from tasks.jsonl import ProblemFileError, read_problems, write_jsonl
    from workers.kv_methods import kv_policy

    try:
        problems = read_problems(args.problems, args.limit)
    except ProblemFileError as error:
        parser.error(f"argument --problems: {error}")
    from dms_runtime.loading import default_model_path

    model_dir = args.model or default_model_path()
    methods = eval_methods(args, parser, model_dir)
    if args.press and (args.kv_budget or args.samples == "fit"):
        parser.error("argument --kv-budget: --kv-budget and --samples fit run on the engine; --press runs use the reference loop")
    fit = args.samples == "fit"
    options = EvalOptions(
        samples=1 if fit else args.samples,
        seed=args.seed,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
    )
    if args.controller:
        return eval_controller(args, parser, problems, model_dir, options)
    runs, records = [], []
    engine_methods = [m for m in methods if m.kind in ("vanilla", "dms")]
    if engine_methods:
        pool = make_pool(model_dir, args.kv_budget, args.workers)
        check_budget(parser, pool, problems, options, engine_methods)
        for method in engine_methods:
            report = asyncio.run(evaluate_on_pool(problems, pool, options, method.ratio if method.kind == "dms" else 1.0,
                                                  method.label, fit=fit, sequential=args.kv_budget is not None))
            records += [{"method": method.label, **r} for r in report.pop("problems")]
            runs.append(report)
        pool.shutdown()
    reference = [m for m in methods if m.kind not in ("vanilla", "dms")]
    if reference:
        model, tokenizer, name = _load(args, parser)
        for method in reference:
            with kv_policy(method, model, model_dir) as kv:
                report = evaluate(problems, model, tokenizer, options, name, progress=True, kv=kv, method=method.label)
            records += [{"method": method.label, **r} for r in report.pop("problems")]
            runs.append(report)
    if args.output:
        write_jsonl(args.output, records)
    if args.plot and len(runs) == 1:
        label = "greedy" if args.samples == 1 else f"vote@{args.samples}"
        plot_accuracy_by_k({label: runs[0]}, args.plot, title=f"{args.problems.name}: accuracy by difficulty")
    elif args.plot:
        plot_pareto(runs, args.plot, title=f"{args.problems.name}: accuracy against KV compression")
    if args.json:
        print(json.dumps(runs[0] if len(runs) == 1 else {"runs": runs}))
    else:
        for report in runs:
            print(f"{report['method']}: n={report['n']} accuracy={report['accuracy']:.3f} "
                  f"realized_cr={report['realized_cr']:.2f} tokens={report['tokens_generated']} "
                  f"tokens/s={report['tokens_per_s']:.0f} kv_peak_bytes={report['kv_peak_bytes']} "
                  f"samples/problem={report['samples_per_problem']:g}")
            for k, accuracy in report["accuracy_by_k"].items():
                print(f"  k={k:>2}  {accuracy:.3f}  (n={report['n_by_k'][k]})")
    return 0


def eval_controller(args, parser, problems: list[dict], model_dir, options) -> int:
    """``eval --controller auto``: every problem through the controller, one at a time, each with the whole pool."""
    from orchestrator.controller import Budget, Controller, check_budget as controller_budget
    from orchestrator.evaluate import summarize
    from policies.extraction import answers_match
    from policies.planner import CalibrationProfile
    from tasks.prompt import format_prompt
    from workers.worker import available_ratios

    if args.kv_budget is None:
        parser.error("argument --controller: needs --kv-budget (the memory each problem's threads may hold)")
    if not args.profile.is_file():
        parser.error(f"argument --profile: no calibration profile at {args.profile} (run thinkpool calibrate)")
    profile = CalibrationProfile.load(args.profile)
    ratios = sorted({1.0, *available_ratios(model_dir)} & {e.cr for e in profile.entries})
    pool = make_pool(model_dir, args.kv_budget, args.workers)
    info = pool.info()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    budget = Budget(kv_budget_bytes=args.kv_budget, max_threads=args.max_threads)
    longest = max((p["prompt"] for p in problems), key=len)
    try:
        controller_budget(profile, info["geometry"]["kv_bytes_per_token"], ratios, len(tokenizer(format_prompt(longest))["input_ids"]), budget)
    except ValueError as error:
        pool.shutdown()
        parser.error(f"argument --kv-budget: {error}")
    controller = Controller(pool, profile, tokenizer, info["geometry"]["kv_bytes_per_token"], ratios,
                            temperature=options.temperature)
    records, tokens = [], 0
    started = time.perf_counter()
    for index, problem in enumerate(problems):
        state = asyncio.run(controller.solve(f"eval-{index}-{problem['id']}", problem["prompt"], budget, seed=options.seed * 1_000_003 + index))
        threads = state["threads"]
        tokens += sum(t["tokens"] for t in threads)
        records.append({"id": problem["id"], "k": problem.get("k"), "expected": problem["answer"], "answer": state["answer"],
                        "correct": answers_match(state["answer"], problem["answer"]), "votes": state["votes"],
                        "thread_accuracy": sum(answers_match(t["answer"], problem["answer"]) for t in threads) / len(threads),
                        "threads": len(threads), "cr": state["cr"], "stop_reason": state["stop_reason"],
                        "tokens": sum(t["tokens"] for t in threads), "rounds": state["rounds"]})
        print(f"{problem['id']}: k={problem.get('k')} {state['cr']:g}x x{len(threads)} -> {state['answer']} "
              f"({'right' if records[-1]['correct'] else 'wrong'}, {state['stop_reason']})", file=sys.stderr)
    stats = [s for s in asyncio.run(pool.stats()) if s is not None]
    pool.shutdown()
    report = {
        "method": "controller",
        **summarize(records, tokens, time.perf_counter() - started),
        "kv_peak_bytes": max(s.pool_peak_bytes for s in stats),
        "kv_budget_bytes": args.kv_budget,
        "samples_per_problem": sum(r["threads"] for r in records) / len(records),
        "ratios_chosen": {f"{cr:g}": sum(r["cr"] == cr for r in records) for cr in sorted({r["cr"] for r in records})},
        "threads_chosen": {str(n): sum(r["threads"] == n for r in records) for n in sorted({r["threads"] for r in records})},
        "config": {"model": str(model_dir), "profile": str(args.profile), "max_threads": args.max_threads,
                   "temperature": options.temperature, "seed": options.seed},
    }
    if args.output:
        from tasks.jsonl import write_jsonl

        write_jsonl(args.output, records)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"controller: n={report['n']} accuracy={report['accuracy']:.3f} tokens={report['tokens_generated']} "
              f"threads/problem={report['samples_per_problem']:.1f} ratios={report['ratios_chosen']}")
    return 0


def service_factory(model_dir, kv_budget: int | None, workers: int):
    """Builds the SolveService when the API starts (workers load then, not when the module is imported)."""
    def build():
        from transformers import AutoTokenizer

        from orchestrator.service import SolveService

        pool = make_pool(model_dir, kv_budget, workers)
        return SolveService(pool, AutoTokenizer.from_pretrained(model_dir, local_files_only=True))

    return build


def cmd_serve(args, parser) -> int:
    import uvicorn

    from dms_runtime.loading import default_model_path
    from orchestrator.api import create_app

    model_dir = args.model or default_model_path()
    if not (Path(model_dir) / "config.json").is_file():
        parser.error(f"argument --model: no model at {model_dir}")
    uvicorn.run(create_app(service_factory(model_dir, args.kv_budget, args.workers)), host=args.host, port=args.port)
    return 0


def cmd_calibrate(args, parser) -> int:
    from dms_runtime.loading import default_model_path
    from orchestrator.calibrate import calibrate
    from workers.worker import available_ratios

    model_dir = args.model or default_model_path()
    ratios = args.cr or [1.0] + available_ratios(model_dir)
    missing = [cr for cr in ratios if cr != 1 and cr not in available_ratios(model_dir)]
    if missing:
        parser.error(f"argument --cr: no DMS adapter for {missing[0]:g}x beside {model_dir}")
    pool = make_pool(model_dir, None, args.workers)
    window = 16
    adapters = sorted(Path(model_dir).glob("dms-*x.json"))
    if adapters:
        window = json.loads(adapters[0].read_text())["dms_config"]["window"]
    profile = asyncio.run(calibrate(pool, args.bins, ratios, args.problems, args.threads, args.max_new_tokens,
                                    args.temperature, args.seed, str(model_dir), window,
                                    progress=lambda line: print(line, file=sys.stderr)))
    pool.shutdown()
    print(f"profile: {profile.save(args.output)}")
    return 0


def check_budget(parser, pool, problems: list[dict], options, methods) -> None:
    """Refuse, before any work, a KV budget that cannot hold one thread of the longest problem."""
    from tasks.prompt import format_prompt
    from workers.thread import SamplingParams

    longest = max((format_prompt(p["prompt"]) for p in problems), key=len)
    params = SamplingParams(max_new_tokens=options.max_new_tokens)
    for method in methods:
        cr = method.ratio if method.kind == "dms" else 1.0
        if asyncio.run(pool.fit(longest, params, cr)) < 1:
            pool.shutdown()
            parser.error(f"argument --kv-budget: {pool.info()['kv_budget_bytes']} bytes cannot hold one thread "
                         f"({options.max_new_tokens} new tokens at {cr:g}x) of the longest problem")


def cmd_bench(args, parser) -> int:
    if args.bench == "overhead":
        return cmd_bench_overhead(args, parser)
    if args.bench == "load":
        from orchestrator.bench import bench_load

        report = asyncio.run(bench_load(args.url, args.concurrency, args.requests, args.samples, args.api_key))
        print(json.dumps(report) if args.json else
              f"{report['ok']}/{report['requests']} ok, lost {report['lost']}, 5xx {report['server_errors']}, "
              f"p50 {report['latency_s']['p50']}s p95 {report['latency_s']['p95']}s p99 {report['latency_s']['p99']}s, "
              f"pool peak {report['pool_peak_bytes']} of {report['pool_bytes']} bytes")
        return 0
    from dms_runtime.loading import default_model_path
    from orchestrator.bench import bench_throughput
    from orchestrator.plots import plot_throughput
    from workers.worker import available_ratios

    model_dir = args.model or default_model_path()
    missing = [cr for cr in args.cr or [] if cr != 1 and cr not in available_ratios(model_dir)]
    if missing:
        parser.error(f"argument --cr: no DMS adapter for {missing[0]:g}x beside {model_dir}")
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
    from orchestrator.bench import bench_overhead, bench_rest_overhead, hard_prompts

    if args.url:
        report = bench_rest_overhead(args.url, hard_prompts(1)[0], args.samples, args.max_new_tokens, args.repeats,
                                     os.environ.get("THINKPOOL_API_KEY"))
        print(json.dumps(report) if args.json else f"rest: wall {report['wall_s']}s, engine busy {report['engine_busy_s']}s, "
              f"overhead {100 * report['overhead_fraction']:.1f}%")
        return 0
    pool = make_pool(args.model or default_model_path(), None, args.workers)
    report = bench_overhead(pool, hard_prompts(1)[0], args.samples, args.max_new_tokens, args.repeats)
    pool.shutdown()
    report["path"] = "ray" if args.workers else "in-process"
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{report['path']}: wall {report['wall_s']}s, engine busy {report['engine_busy_s']}s, "
              f"overhead {100 * report['overhead_fraction']:.1f}%")
    return 0


def cmd_info(args, parser) -> int:
    from dms_runtime.loading import kv_geometry

    model, _, name = _load(args, parser)
    config = model.config
    info = {
        "model": name,
        "architecture": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        **kv_geometry(model).as_dict(),
    }
    if args.json:
        print(json.dumps(info))
    else:
        for key, value in info.items():
            print(f"{key}: {value}")
    return 0


def cmd_generate(args, parser) -> int:
    from tasks.chain import generate_suite
    from tasks.jsonl import write_jsonl

    records = generate_suite(args.n, *args.k, seed=args.seed, reach=args.reach)
    write_jsonl(args.output, records)
    print(f"wrote {len(records)} problems (k {args.k[0]}-{args.k[1]}, seed {args.seed}) to {args.output}")
    return 0


def cmd_train(args, parser) -> int:
    from pydantic import ValidationError

    from dms_runtime.base_train import TrainConfig, train

    if not args.config.is_file():
        parser.error(f"argument --config: file not found: {args.config}")
    try:
        config = TrainConfig.from_yaml(args.config)
    except ValidationError as error:
        parser.error(f"argument --config: {error}")
    path = train(config, steps=args.steps)
    print(f"checkpoint: {path}")
    return 0


def cmd_retrofit(args, parser) -> int:
    from pydantic import ValidationError

    from dms_runtime.retrofit import RetrofitConfig, retrofit

    if not args.config.is_file():
        parser.error(f"argument --config: file not found: {args.config}")
    overrides = {
        "model": str(args.model) if args.model else None,
        "output": str(args.output) if args.output else None,
        "ratios": args.ratios,
        "window": args.window,
        "parametrization": args.parametrization,
        "per_head": False if args.per_layer else None,
        "full_finetune": True if args.full_finetune else None,
    }
    try:
        import yaml

        data = yaml.safe_load(args.config.read_text()) or {}
        config = RetrofitConfig.model_validate(data | {k: v for k, v in overrides.items() if v is not None})
    except ValidationError as error:
        parser.error(f"argument --config: {error}")
    if not (Path(config.model) / "config.json").is_file():
        parser.error(f"argument --model: no model at {config.model}")
    for path in retrofit(config, steps=args.steps):
        print(f"adapter: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
