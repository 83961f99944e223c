"""Side-by-side timings of the training paths, printed as one JSON object.

    .venv/bin/python research/bench_training.py [--repeats 3] [--tokens 6000] [--k 18]

- precision: a forward and backward pass of the shipped model over ``--tokens`` tokens of chain-task examples
  of difficulty ``--k`` (18: hard ones; a batch holds whole examples, at least one), in fp32 and under bf16
  autocast (which ``training/precision.py`` enables only where the CPU computes bf16 natively);
- attention: DMS training attention (forward and backward, one layer) over one batch of that shape, in the
  dtype training's autocast gives it: through the fused CPU kernel (``dms_runtime/evicting_attention.py``, what
  ``_train_attention`` runs on the CPU), through SDPA with the eviction bias as a float mask (what it runs on
  CUDA), and written out (``_explicit_attention``);
- the shipped model with DMS gates in training mode, forward and backward over the batch, with the fused kernel
  and with the float-mask path.
Each pair alternates runs, so that the noise of a shared machine falls on both; compare the ratios.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from dms_runtime import attention as dms_attention
from dms_runtime.attach import attach_dms
from dms_runtime.attention import _bias_mask_attention, _explicit_attention, eviction_bias, shifted_decisions, straight_through_alpha
from training.chain_data import difficulty_batch
from dms_runtime.config import DMSConfig
from dms_runtime.evicting_attention import evicting_attention
from dms_runtime.gates import build_gates
from dms_runtime.loading import load_model
from training.precision import cpu_has_native_bf16, uses_bf16


def timed(step) -> float:
    began = time.perf_counter()
    step()
    return time.perf_counter() - began


def alternate(steps: dict, repeats: int) -> dict[str, float]:
    for step in steps.values():  # warm-up
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            times[name].append(timed(step))
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=6000)
    parser.add_argument("--k", type=int, default=18, help="difficulty of the batch's examples")
    args = parser.parse_args()
    model, tokenizer = load_model()
    batch = difficulty_batch(tokenizer, random.Random(3), args.k, args.k, args.tokens)

    def model_step(bf16: bool):
        def step():
            model.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = model(input_ids=batch.input_ids, use_cache=False).logits
            torch.log_softmax(logits.float(), -1).mean().backward()
        return step

    precision = alternate({"fp32": model_step(False), "bf16_autocast": model_step(True)}, args.repeats)

    config = model.config
    rows, length = batch.input_ids.shape
    kv_heads, heads, dim = config.num_key_value_heads, config.num_attention_heads, config.head_dim
    dtype = torch.bfloat16 if uses_bf16("cpu") else torch.float32  # what attention gets under training's autocast
    query, key, value = (torch.randn(rows, h, length, dim, dtype=dtype, requires_grad=True) for h in (heads, kv_heads, kv_heads))
    logits = torch.randn(rows, length, kv_heads, requires_grad=True)
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None, None]

    def alpha():
        return straight_through_alpha(shifted_decisions(logits), 0.1)

    def fused():
        evicting_attention(query, key, value, alpha(), causal, 32, None).sum().backward()

    def bias_mask():
        _bias_mask_attention(query, key, value, alpha(), causal, 32, None).sum().backward()

    def explicit():
        _explicit_attention(query, key, value, causal, None, eviction_bias(alpha(), length, 32))[0].sum().backward()

    attention = alternate({"fused": fused, "bias_mask": bias_mask, "explicit": explicit}, args.repeats)

    # The whole model in DMS training mode, forward and backward: the fused kernel against the float-mask path.
    handle = attach_dms(model, build_gates(model, DMSConfig(window=32)), DMSConfig(window=32))
    handle.set_mode("train")
    training_step = model_step(uses_bf16("cpu"))  # what retrofit's autocast does on this CPU

    def dms_model_step(kernel):
        def step():
            dms_attention.evicting_attention = kernel  # the CPU's choice in _train_attention, swapped for one step
            try:
                training_step()
            finally:
                dms_attention.evicting_attention = evicting_attention
        return step

    dms_model = alternate({"fused": dms_model_step(evicting_attention), "bias_mask": dms_model_step(_bias_mask_attention)},
                          args.repeats)
    print(json.dumps({
        "cpu_native_bf16": cpu_has_native_bf16(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "batch": {"rows": rows, "length": length, "tokens": int(batch.lengths.sum())}, "repeats": args.repeats,
        "precision_s": {name: round(value, 3) for name, value in precision.items()},
        "bf16_over_fp32": round(precision["bf16_autocast"] / precision["fp32"], 2),
        "attention_s": {name: round(value, 3) for name, value in attention.items()},
        "attention_dtype": str(dtype).removeprefix("torch."),
        "bias_mask_over_fused": round(attention["bias_mask"] / attention["fused"], 2),
        "explicit_over_fused": round(attention["explicit"] / attention["fused"], 2),
        "dms_model_train_s": {name: round(value, 3) for name, value in dms_model.items()},
        "dms_model_bias_mask_over_fused": round(dms_model["bias_mask"] / dms_model["fused"], 2),
    }, indent=1))


if __name__ == "__main__":
    main()
