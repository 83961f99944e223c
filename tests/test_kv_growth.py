"""Measuring what the shipped DMS adapters keep of a thread, and reserving memory by it."""

import json
import shutil

from dms_runtime.adapters import adapter_path
from dms_runtime.kv_growth import KVGrowth, read_kv_growth
from dms_runtime.loading import REPO_ROOT, SHIPPED_MODEL
from tasks.chain import generate_suite
from tasks.prompt import format_prompt
from tests.test_cli import thinkpool
from workers.kv_budget import KVBudgetModel
from workers.thread import SamplingParams
from workers.worker import WorkerConfig, available_ratios, build_engine

EQUAL_MEMORY = 13_500_000  # the equal-memory budget: about four vanilla threads of 1000 tokens


def test_every_shipped_adapter_carries_its_measured_growth():
    ratios = available_ratios(SHIPPED_MODEL)
    assert ratios
    for cr in ratios:
        growth = read_kv_growth(adapter_path(SHIPPED_MODEL, cr))
        assert growth is not None, f"{cr:g}x was never measured (thinkpool kv-growth)"
        assert 0 < growth.generated < 1 and 0 < growth.prompt <= 1
        lengths = [p for p, _ in growth.generated_curve]
        assert len(lengths) >= 4 and lengths == sorted(lengths), f"{cr:g}x has no growth curve"


def test_kv_growth_measures_stores_and_lets_the_pool_hold_more_threads(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(SHIPPED_MODEL, model)
    done = thinkpool("kv-growth", "--model", str(model), "--cr", "8", "--n", "2", "--threads", "4", "--k", "14-15",
                     "--seed", "5")
    assert done.returncode == 0, done.stderr
    fit = json.loads(done.stdout.strip().splitlines()[-1])
    assert fit["cr"] == 8 and fit["threads"] == 8 and fit["k"] == [14, 15]
    # Trained gates keep most of the prompt (the values asked for later) and much less than 1/8 of the scratch.
    assert fit["prompt"] > 1 / 8 > 1.3 * fit["generated"]
    # ... but more of a thread's first tokens (its input registers) than of the rest: the curve falls.
    curve = [fraction for _, fraction in fit["generated_curve"]]
    assert len(curve) >= 4 and curve[0] > 2 * curve[-1] and curve[0] > fit["generated"]
    stored = read_kv_growth(adapter_path(model, 8))
    assert (stored.prompt, stored.generated) == (fit["prompt"], fit["generated"])
    assert [list(point) for point in stored.generated_curve] == fit["generated_curve"]

    engine = build_engine(WorkerConfig(model=str(model), kv_budget_bytes=EQUAL_MEMORY, device="cpu"))
    try:
        prompt = format_prompt(generate_suite(1, 18, 18, seed=3)[0]["prompt"])
        params = SamplingParams(temperature=0.8, max_new_tokens=1000)
        nominal = KVBudgetModel.nominal(engine.budget_model.kv_bytes_per_token, [8.0], engine.adapters.window(8))
        prompt_tokens = len(engine.tokenizer(prompt)["input_ids"])
        assert engine.fit(engine.encode(prompt), params, 8) > 1.2 * nominal.threads_that_fit(EQUAL_MEMORY, 8, prompt_tokens, 1000)
        assert engine.fit(engine.encode(prompt), params, 1) == 4  # vanilla threads keep everything: the measurement changes nothing
        # What a worker reports is what its admission counts: a planner elsewhere fits the same threads.
        reported = KVBudgetModel.from_dict(json.loads(json.dumps(engine.budget_model.as_dict())))
        assert reported.threads_that_fit(EQUAL_MEMORY, 8, prompt_tokens, 1000) == engine.fit(engine.encode(prompt), params, 8)
        # A short token limit is reserved at what threads of that length kept, more than the long-run fraction.
        short = SamplingParams(temperature=0.8, max_new_tokens=150)
        flat = KVBudgetModel(reported.kv_bytes_per_token, reported.windows, {8.0: KVGrowth(stored.prompt, stored.generated)})
        assert engine.fit(engine.encode(prompt), short, 8) < flat.threads_that_fit(EQUAL_MEMORY, 8, prompt_tokens, 150)
    finally:
        engine.close()
    nominal_engine = build_engine(WorkerConfig(model=str(model), kv_budget_bytes=EQUAL_MEMORY, device="cpu", reserve="nominal"))
    try:  # the A/B switch: the same adapters reserved at 1/cr
        assert nominal_engine.fit(engine.encode(prompt), params, 8) == nominal.threads_that_fit(EQUAL_MEMORY, 8, prompt_tokens, 1000)
        # ... and it reports the growth it reserves at, so a planner elsewhere counts 1/cr too.
        assert nominal_engine.budget_model.as_dict()["growth"][8.0] == KVGrowth.nominal(8).as_dict()
    finally:
        nominal_engine.close()
