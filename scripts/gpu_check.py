"""GPU check: the engine with DMS against vanilla at equal KV memory, on a Qwen3-8B-shaped model.

Random weights in the real shapes (like vLLM's dummy load format: nothing is downloaded), bf16 on one GPU.
DMS gates are random too, offset so that about ``1 - 1/cr`` of the tokens leaving the window are evicted:
this measures what eviction does to memory and speed, not accuracy. Prints one JSON object:
``{"kv_budget_bytes", "runs": [{"method", "cr", "threads", "tokens_per_s", "kv_peak_bytes"}]}``.

    python scripts/gpu_check.py --kv-budget-gb 4 --max-new-tokens 512     # on a GPU machine
    python scripts/gpu_check.py --tiny --device cpu                       # a smoke run anywhere
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dms_runtime.config import DMSConfig  # noqa: E402
from dms_runtime.gate_bank import AdapterSet  # noqa: E402
from dms_runtime.gates import build_gates  # noqa: E402
from tasks.chain_tokenizer import build_tokenizer  # noqa: E402
from evaluation.benchmarks import bench_engine  # noqa: E402
from workers.engine import Engine  # noqa: E402
from workers.thread import SamplingParams, StopRule  # noqa: E402

QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=51, max_position_embeddings=4096)


def random_gates(model, cr: float, window: int) -> tuple:
    """Gates whose logits evict about ``1 - 1/cr`` of the tokens (the offset is set from the logits' spread)."""
    config = DMSConfig(window=window, init_offset=0.0)
    gates = build_gates(model, config).to(next(model.parameters()).device)
    probe = torch.randn(4096, model.config.hidden_size, device=gates[0].weight.device)
    for gate in gates:
        gate.weight.data.normal_(0, 0.01 / model.config.hidden_size**0.5)
    spread = statistics.pstdev(gates[0](probe[None]).flatten().tolist())
    offset = spread * torch.distributions.Normal(0, 1).icdf(torch.tensor(1 - 1 / cr)).item()
    return gates, DMSConfig(window=window, init_offset=offset)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-budget-gb", type=float, default=4.0)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--ratios", type=float, nargs="+", default=[1, 8])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (smoke test)")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(args.device):
        model = Qwen3ForCausalLM(Qwen3Config(**(TINY if args.tiny else QWEN3_8B))).to(dtype).eval()
    adapters = {cr: random_gates(model, cr, args.window) for cr in args.ratios if cr != 1}
    tokenizer = build_tokenizer()  # only its pad/eos ids are used: prompts are random token ids below
    engine = Engine(model, tokenizer, AdapterSet(model, adapters), int(args.kv_budget_gb * 2**30), max_running=1024)
    engine.stop = StopRule(eos=-1)  # random weights: run every thread to its token limit
    prompt_ids = torch.randint(10, model.config.vocab_size, (args.prompt_tokens,)).tolist()
    engine.tokenizer = _IdsTokenizer(tokenizer, prompt_ids)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)
    runs = []
    for cr in args.ratios:
        print(f"engine at {cr:g}x ...", file=sys.stderr)
        run = bench_engine(engine, ["prompt"], cr, params)
        runs.append({k: run[k] for k in ("method", "cr", "threads", "tokens_per_s", "kv_peak_bytes", "tokens", "elapsed_s")})
    print(json.dumps({"model": "qwen3-8b-shaped (random)" if not args.tiny else "tiny", "device": args.device,
                      "kv_budget_bytes": engine.pool.budget_bytes, "window": args.window, "runs": runs}))


class _IdsTokenizer:
    """The chain tokenizer, except that the benchmark's prompt text maps to fixed random token ids."""

    def __init__(self, tokenizer, prompt_ids: list[int]):
        self._tokenizer, self._ids = tokenizer, prompt_ids

    def __call__(self, text: str, **kwargs):
        return {"input_ids": list(self._ids)}

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def decode(self, ids, **kwargs) -> str:
        return ""


if __name__ == "__main__":
    main()
