"""``thinkpool info | generate | train | retrofit | kv-growth``: the model, its training and its adapters' measurements."""

from __future__ import annotations

import json
from pathlib import Path

from orchestrator.commands.common import load_model_or_exit


def cmd_info(args, parser) -> int:
    from dms_runtime.loading import kv_geometry

    model, _, name = load_model_or_exit(args, parser)
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

    from training.base_model import TrainConfig, train
    from training.yaml_config import ConfigFileError

    try:
        config = TrainConfig.from_yaml(args.config)
    except (ValidationError, ConfigFileError) as error:
        parser.error(f"argument --config: {error}")
    path = train(config, steps=args.steps)
    print(f"checkpoint: {path}")
    return 0


def cmd_retrofit(args, parser) -> int:
    from pydantic import ValidationError

    from training.retrofit import RetrofitConfig, retrofit
    from training.yaml_config import ConfigFileError

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
        config = RetrofitConfig.from_yaml(args.config, **{k: v for k, v in overrides.items() if v is not None})
    except (ValidationError, ConfigFileError) as error:
        parser.error(f"argument --config: {error}")
    if not (Path(config.model) / "config.json").is_file():
        parser.error(f"argument --model: no model at {config.model}")
    if args.thresholds_only:
        from training.thresholds import DEFAULT_PROBLEMS

        return fit_adapter_thresholds(config, parser, problems=config.threshold_problems or DEFAULT_PROBLEMS)
    written = retrofit(config, steps=args.steps)
    for path in written:
        print(f"adapter: {path}")
    if written and config.threshold_problems:
        return fit_adapter_thresholds(config, parser, config.threshold_problems)
    return 0


def fit_adapter_thresholds(config, parser, problems: int) -> int:
    """Set each trained adapter's threshold so that it realizes its ratio (see training.thresholds)."""
    from dms_runtime.adapters import adapter_path
    from training.thresholds import describe, fit_thresholds

    model_dir = config.output_dir if config.full_finetune else Path(config.model)
    missing = [str(adapter_path(config.output_dir, r)) for r in config.ratios if not adapter_path(config.output_dir, r).is_file()]
    if missing:
        parser.error(f"argument --thresholds-only: no trained adapter at {', '.join(missing)}")
    print(describe(fit_thresholds(model_dir, config.output_dir, config.ratios, config.k_min, config.k_max, problems, config.threshold_seed)))
    if config.kv_growth_problems and Path(model_dir).resolve() == Path(config.output_dir).resolve():
        from training import measure_kv_growth as kv_growth

        fits = kv_growth.measure_kv_growth(model_dir, config.ratios, problems=config.kv_growth_problems)
        kv_growth.store(model_dir, fits)
        print(kv_growth.describe(fits))
    return 0


def cmd_kv_growth(args, parser) -> int:
    from training import measure_kv_growth as kv_growth
    from workers.worker import available_ratios

    if not (args.model / "config.json").is_file():
        parser.error(f"argument --model: no model at {args.model}")
    served = available_ratios(args.model)
    missing = [f"{cr:g}x" for cr in args.cr or [] if cr not in served]
    if missing or not served:
        parser.error(f"argument --cr: no adapter for {', '.join(missing) or 'any ratio'} in {args.model} "
                     f"(it has {', '.join(f'{cr:g}x' for cr in served) or 'none'})")
    try:
        fits = kv_growth.measure_kv_growth(args.model, args.cr, args.problems, args.threads, args.k, args.seed,
                                           args.temperature, args.max_new_tokens, args.quantile)
    except ValueError as error:  # problems too short to measure: nothing is written
        parser.error(f"argument --k: {error}; measure on longer problems")
    if not args.dry_run:
        kv_growth.store(args.model, fits)
    print(kv_growth.describe(fits))
    return 0
