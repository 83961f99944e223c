"""``thinkpool eval``: a problem file through the workers (or the reference loop for kvpress baselines, or the controller)."""

from __future__ import annotations

import asyncio
import json
import sys

from orchestrator.commands.common import load_model_or_exit, read_problems_or_exit
from workers.factory import make_pool


def eval_methods(args, parser, model_dir) -> list:
    """The KV methods an eval run compares, checked before any work starts."""
    from evaluation.kv_methods import KVMethod, check_available

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


def cmd_eval(args, parser) -> int:
    from evaluation.scoring import EvalOptions, evaluate, evaluate_on_pool
    from evaluation.plots import plot_accuracy_by_k, plot_pareto
    from tasks.jsonl import write_jsonl
    from evaluation.kv_methods import kv_policy

    from dms_runtime.loading import default_model_path
    from tasks.families import default_family

    model_dir = args.model or default_model_path()
    task = default_family(model_dir)
    problems = read_problems_or_exit(args, parser, task, need_answers=True)
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
        vote=args.vote,
    )
    if args.controller:
        return eval_controller(args, parser, problems, model_dir, options)
    runs, records = [], []
    engine_methods = [m for m in methods if m.kind in ("vanilla", "dms")]
    if engine_methods:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        pool = make_pool(model_dir, args.kv_budget, args.workers, args.reserve)
        check_budget(parser, pool, tokenizer, problems, options, engine_methods)
        for method in engine_methods:
            report = asyncio.run(evaluate_on_pool(problems, pool, tokenizer, options, method.ratio if method.kind == "dms" else 1.0,
                                                  method.label, fit=fit, sequential=args.kv_budget is not None,
                                                  default_task=task))
            records += [{"method": method.label, **r} for r in report.pop("problems")]
            runs.append(report)
        pool.shutdown()
    reference = [m for m in methods if m.kind not in ("vanilla", "dms")]
    if reference and any(p.get("task", task) != "chain" for p in problems):
        parser.error("argument --press: the training-free presses run chain problems only")
    if reference:
        model, tokenizer, name = load_model_or_exit(args, parser)
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
            if report["realized_cr"] != 1.0:  # what a thread of each length kept (tokens generated)
                for band, row in report["realized_cr_by_length"].items():
                    print(f"  {band:>9} tokens  realized_cr={row['realized_cr']:.2f}  (threads={row['threads']})")
    return 0


def make_service(args, parser, problems: list[dict], model_dir, pool, vote: str = "majority"):
    """The solve service whose controller ``eval --controller`` and ``bench controller`` score (its threads combined
    by ``vote``), checked before any work: the profile exists and the pool (``--kv-budget`` rounded down to whole KV
    slots, what each request asks for) holds a thread of the longest problem."""
    from transformers import AutoTokenizer

    from orchestrator.schemas import SolveRequest
    from orchestrator.service import SolveService

    if args.profile is not None and not args.profile.is_file():
        pool.shutdown()
        parser.error(f"argument --profile: no calibration profile at {args.profile} (run thinkpool calibrate)")
    try:
        service = SolveService(pool, AutoTokenizer.from_pretrained(model_dir, local_files_only=True),
                               [args.profile] if args.profile is not None else None, vote=vote)
        longest = max(problems, key=lambda p: len(p["prompt"]))
        service.check(SolveRequest(prompt=longest["prompt"], task=longest.get("task"),
                                   answer_pattern=longest.get("answer_pattern"), samples="auto", mode="controller",
                                   kv_budget=service.info["kv_budget_bytes"], max_threads=args.max_threads))
    except ValueError as error:
        pool.shutdown()
        field, _, message = str(error).partition(": ")
        option = {"mode": "profile", "profile": "profile"}.get(field, field)  # no profile for the task: --profile
        parser.error(f"argument --{option.replace('_', '-')}: {message}")
    return service


async def run_controller(problems: list[dict], service, kv_budget: int, max_threads: int, seed: int) -> dict:
    """The controller's report on ``problems``, with the controller's settings."""
    from orchestrator.controller_eval import evaluate_with_controller

    report = await evaluate_with_controller(problems, service, kv_budget, max_threads, seed,
                                            progress=lambda line: print(line, file=sys.stderr))
    # temperature: the one fixed for every task, or null when each task's plan chose (see temperatures_chosen).
    fixed = service.controller.temperature if service.controller else None
    config = {"max_threads": max_threads, "temperature": fixed, "seed": seed}
    return {**report, "kv_budget_bytes": kv_budget, "config": config}


def eval_controller(args, parser, problems: list[dict], model_dir, options) -> int:
    """``eval --controller auto``: every problem through the solve service's controller, one at a time, each
    with the whole pool."""
    if args.kv_budget is None:
        parser.error("argument --controller: needs --kv-budget (the memory each problem's threads may hold)")
    pool = make_pool(model_dir, args.kv_budget, args.workers)
    service = make_service(args, parser, problems, model_dir, pool, options.vote)
    report = asyncio.run(run_controller(problems, service, service.info["kv_budget_bytes"], args.max_threads,
                                        options.seed))
    pool.shutdown()
    records = report.pop("problems")
    profiles = sorted({str(c.profile.path) for c in service.controllers.values() if c.profile.path is not None})
    report["config"] = {"model": str(model_dir), "profile": ", ".join(profiles), "vote": options.vote, **report["config"]}
    if args.output:
        from tasks.jsonl import write_jsonl

        write_jsonl(args.output, records)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"controller: n={report['n']} accuracy={report['accuracy']:.3f} tokens={report['tokens_generated']} "
              f"threads/problem={report['samples_per_problem']:.1f} ratios={report['ratios_chosen']}")
    return 0


def check_budget(parser, pool, tokenizer, problems: list[dict], options, methods) -> None:
    """Refuse, before any work, a KV budget that cannot hold one thread of the longest problem."""
    from tasks.prompt import format_prompt
    from workers.thread import SamplingParams

    longest = max((tokenizer(format_prompt(p["prompt"]))["input_ids"] for p in problems), key=len)
    params = SamplingParams(max_new_tokens=options.max_new_tokens)
    for method in methods:
        cr = method.ratio if method.kind == "dms" else 1.0
        if asyncio.run(pool.fit(longest, params, cr)) < 1:
            pool.shutdown()
            parser.error(f"argument --kv-budget: {pool.info()['kv_budget_bytes']} bytes cannot hold one thread "
                         f"({options.max_new_tokens} new tokens at {cr:g}x) of the longest problem")
