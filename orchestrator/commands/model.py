"""``thinkpool info | generate | train | retrofit | kv-growth``: the model, its training and its adapters' measurements."""

from __future__ import annotations

import json
import sys
from pathlib import Path



def describe_model(path: Path) -> dict:
    """What a model directory is, from its config, tokenizer and adapter files and safetensors headers only (no
    weights load): architecture, KV geometry as this machine would serve it, the ratios and windows its gates
    offer, what admission reserves per ratio (its measured KV growth, or nominal), its task family, context length,
    sampling defaults and whether its tokenizer has a chat template."""
    import torch
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from dms_runtime.adapters import adapter_path, read_adapter_metadata
    from dms_runtime.loading import KVGeometry, load_dtype
    from dms_runtime.model_dir import (context_length, eos_token_ids, generation_defaults, has_chat_template,
                                       has_tokenizer, parameter_count, read_config, stored_dtype)
    from dms_runtime.nvidia_layout import read_dms_config
    from tasks.families import default_family
    from workers.worker import available_ratios

    config = read_config(path)
    nvidia = read_dms_config(path)
    ratios = available_ratios(path)
    if nvidia is not None:
        windows = {cr: nvidia.window_size for cr in ratios}
    else:
        windows = {cr: read_adapter_metadata(adapter_path(path, cr))["dms_config"].get("window") for cr in ratios}
    architectures = config.get("architectures") or [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type"))]
    heads = config["num_attention_heads"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = load_dtype(path, device)
    geometry = KVGeometry(config["num_hidden_layers"], config.get("num_key_value_heads") or heads,
                          config.get("head_dim") or config["hidden_size"] // heads, dtype.itemsize)
    return {
        "model": str(path),
        "architecture": architectures[0],
        "model_type": config.get("model_type"),
        "parameters": parameter_count(path),
        "stored_dtype": stored_dtype(config),
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
        "hidden_size": config["hidden_size"],
        "num_attention_heads": heads,
        "vocab_size": config.get("vocab_size"),
        "max_position_embeddings": context_length(config),
        **geometry.as_dict(),
        "layout": "nvidia" if nvidia is not None else "thinkpool",
        "ratios": [1.0] + ratios,
        "windows": {f"{cr:g}": w for cr, w in windows.items()},
        "kv_growth": stored_growth(path, ratios, nvidia is not None),
        "nvidia_dms": None if nvidia is None else nvidia.config_fields(),
        "task": default_family(path),
        "tokenizer": has_tokenizer(path),
        "chat_template": has_chat_template(path),
        "eos_token_ids": eos_token_ids(path),
        "generation": generation_defaults(path),
    }


def stored_growth(path: Path, ratios: list[float], nvidia: bool) -> dict[str, dict]:
    """Per ratio, the KV growth admission reserves by as stored: ``measured`` (an adapter's metadata, or an NVIDIA
    directory's growth file with ``measured_on``, the weights' fingerprint, which a worker checks when it loads them)
    or ``nominal`` (1/cr)."""
    from dms_runtime.adapters import adapter_path
    from dms_runtime.kv_growth import KVGrowth, read_growth_file, read_kv_growth

    stored = read_growth_file(path) if nvidia else None
    report = {}
    for cr in ratios:
        if nvidia:
            entry = stored[1].get(cr) if stored is not None else None
            growth = None if entry is None else KVGrowth.from_dict(entry)
            extra = {} if entry is None else {"measured_on": stored[0]}
        else:
            growth, extra = read_kv_growth(adapter_path(path, cr)), {}
        source = "nominal" if growth is None else "measured"
        report[f"{cr:g}"] = {"reserve": source, **(growth or KVGrowth.nominal(cr)).as_dict(), **extra}
    return report


def cmd_info(args, parser) -> int:
    """``thinkpool info``: the model directory described from its files; no weights are loaded."""
    from dms_runtime.loading import default_model_path

    path = Path(args.model or default_model_path())
    if not (path / "config.json").is_file():
        parser.error(f"argument --model: no model at {path}: expected a Hugging Face checkpoint directory with "
                     "config.json")
    try:
        info = describe_model(path)
    except (ValueError, KeyError) as error:
        parser.error(f"argument --model: {path}: {error}")
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


# the default recipe, by whether --problems is given
RETROFIT_RECIPES = {False: Path("configs/retrofit_chain.yaml"), True: Path("configs/retrofit_byo.yaml")}


def cmd_retrofit(args, parser) -> int:
    from pydantic import ValidationError

    from tasks.families import default_family
    from tasks.jsonl import ProblemFileError
    from training.completions import read_problem_file
    from training.retrofit import RetrofitConfig, retrofit
    from training.yaml_config import ConfigFileError

    overrides = {
        "model": str(args.model) if args.model else None,
        "output": str(args.output) if args.output else None,
        "problems": str(args.problems) if args.problems else None,
        "task": args.task,
        "max_new_tokens": args.max_new_tokens,
        "ratios": args.ratios,
        "window": args.window,
        "parametrization": args.parametrization,
        "layout": args.layout,
        "per_head": False if args.per_layer else None,
        "full_finetune": True if args.full_finetune else None,
    }
    overrides = {k: v for k, v in overrides.items() if v is not None}
    try:
        config = RetrofitConfig.from_yaml(args.config or RETROFIT_RECIPES[args.problems is not None], **overrides)
    except ConfigFileError as error:
        parser.error(f"argument --config: {error}")
    except ValidationError as error:
        parser.error(config_error(error, overrides))
    if not (Path(config.model) / "config.json").is_file():
        parser.error(f"argument --model: no model at {config.model}")
    if config.problems is not None:  # checked here, before any model loads
        try:
            read_problem_file(config.problems, config.task or default_family(config.model))
        except ProblemFileError as error:
            parser.error(f"argument --problems: {error}")
    if args.thresholds_only and config.parametrization == "nvidia_separate":
        parser.error("argument --thresholds-only: NVIDIA's separate gates have no decision threshold to fit")
    if args.thresholds_only:
        from training.thresholds import DEFAULT_PROBLEMS

        return fit_adapter_thresholds(config, parser, problems=config.threshold_problems or DEFAULT_PROBLEMS)
    written = retrofit(config, steps=args.steps)
    for path in written:
        print(f"adapter: {path}")
    if written and config.layout == "nvidia":
        for ratio in config.ratios:
            print(f"nvidia layout: {config.output_dir / f'nvidia-{ratio:g}x'}")
    if written and config.threshold_problems:
        return fit_adapter_thresholds(config, parser, config.threshold_problems)
    return 0


def config_error(error, given: dict) -> str:
    """The first problem of a retrofit config as a usage error: ``argument --OPTION: field: message`` when the command
    line set the field, else ``argument --config: field: message``."""
    first = error.errors()[0]
    message = str(first["msg"]).removeprefix("Value error, ")
    field = str(first["loc"][0]) if first["loc"] else message.partition(":")[0]
    if first["loc"]:
        message = f"{field}: {message}"
    if field not in given:
        return f"argument --config: {message}"
    option = "--per-layer" if field == "per_head" else f"--{field.replace('_', '-')}"
    return f"argument {option}: {message.removeprefix(f'{field}: ')}"


def fit_adapter_thresholds(config, parser, problems: int) -> int:
    """Set each trained adapter's threshold so that it realizes its ratio (see training.thresholds)."""
    from dms_runtime.adapters import adapter_path
    from tasks.families import default_family
    from training.completions import calibration_sequences, read_problem_file, sample_completions
    from training.thresholds import describe, fit_thresholds, fit_thresholds_on_text

    model_dir = config.output_dir if config.full_finetune else Path(config.model)
    missing = [str(adapter_path(config.output_dir, r)) for r in config.ratios if not adapter_path(config.output_dir, r).is_file()]
    if missing:
        parser.error(f"argument --thresholds-only: no trained adapter at {', '.join(missing)}")
    if config.problems is None:
        fits = fit_thresholds(model_dir, config.output_dir, config.ratios, config.k_min, config.k_max, problems,
                              config.threshold_seed)
    else:  # the model's own completions of the user's prompts, as training read them (sampled now if not cached)
        completions = sample_completions(config.model, config.problems, config.output_dir, config.task,
                                         samples=config.completions_per_problem,
                                         max_new_tokens=config.max_new_tokens, seed=config.seed)
        fits = fit_thresholds_on_text(model_dir, config.output_dir, config.ratios,
                                      calibration_sequences(completions, problems), config.seed)
    print(describe(fits))
    if config.kv_growth_problems and Path(model_dir).resolve() == Path(config.output_dir).resolve():
        from training import measure_kv_growth as kv_growth

        task = config.task or default_family(config.model)
        prompts = None if config.problems is None else read_problem_file(config.problems, task)  # the user's, as trained
        fits = kv_growth.measure_kv_growth(model_dir, config.ratios, n=config.kv_growth_problems, problems=prompts,
                                           task=task)
        kv_growth.store(model_dir, fits)
        print(kv_growth.describe(fits))
    return 0


def cmd_kv_growth(args, parser) -> int:
    """``thinkpool kv-growth``: measure each ratio's KV growth on a problem file or fresh chain problems and store it
    with the gates (a thinkpool adapter's metadata, or an NVIDIA-layout directory's growth file)."""
    from orchestrator.commands.common import read_problems_or_exit
    from tasks.families import default_family
    from training import measure_kv_growth as kv_growth
    from workers.worker import available_ratios

    if not (args.model / "config.json").is_file():
        parser.error(f"argument --model: no model at {args.model}")
    try:
        served = available_ratios(args.model)
        task = args.task or default_family(args.model)
    except ValueError as error:
        parser.error(f"argument --model: {args.model}: {error}")
    missing = [f"{cr:g}x" for cr in args.cr or [] if cr not in served]
    if missing or not served:
        parser.error(f"argument --cr: no DMS gates for {', '.join(missing) or 'any ratio'} in {args.model} "
                     f"(it has {', '.join(f'{cr:g}x' for cr in served) or 'none'})")
    problems = None
    if args.problems is not None:
        if args.k is not None:
            parser.error("argument --k: the difficulties of generated chain problems; not with --problems")
        problems = read_problems_or_exit(args, parser, task, limit=args.n, prompts_only=True)
    elif task != "chain":
        parser.error(f"argument --problems: the {task} task needs a problem file to measure on (only chain problems "
                     "are generated)")
    try:
        fits = kv_growth.measure_kv_growth(args.model, args.cr, args.n, args.threads, args.k, args.seed,
                                           args.temperature, args.max_new_tokens, args.quantile, problems=problems,
                                           task=task, min_past_window=args.min_past_window)
    except kv_growth.TooShortError as error:  # nothing is written
        parser.error(f"argument --max-new-tokens: {error}")
    if not args.dry_run:
        for path in kv_growth.store(args.model, fits):
            print(f"stored: {path}", file=sys.stderr)
    print(kv_growth.describe(fits))
    return 0
