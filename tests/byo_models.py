"""Tiny model directories as people have them, built in the tests (nothing downloaded): a Qwen3 or Llama with a
byte-level BPE tokenizer trained here, a Qwen-style chat template with ``enable_thinking``, a
``generation_config.json`` listing two EOS ids and sampling defaults, weights in bf16 or fp16, optionally sharded
or in NVIDIA's DMS layout.

The model is trained for a moment to answer two math problems word for word (thinking, ``\\boxed{}``, then
``<|im_end|>``), as the math and the regex family put them, so a greedy thread's answer and its stop are known.
The tokenizer's own EOS is ``<|endoftext|>``: only ``generation_config.json`` says that ``<|im_end|>`` ends a
thread too, as in Qwen3's.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from dms_runtime.nvidia_gates import NvidiaDMSConfig, build_gates
from dms_runtime.nvidia_layout import export_nvidia_layout
from tasks.families import get_family

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
# "#1" in the thinking: the chain task's stop rule would cut the thread there.
ANSWERS = {
    "What is 1/2 + 1/4?": "<think>\nStep #1: a half is two quarters.\n</think>\n\nThe answer is \\boxed{\\frac{3}{4}}.",
    "What is 2 + 2?": "<think>\nTwo and two.\n</think>\n\nSo it is \\boxed{4}.",
}
CONTEXT = 256
GENERATION = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}  # Qwen3's, as its file has them


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    corpus = [f"{problem} {answer}" for problem, answer in ANSWERS.items()] * 20
    core.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny(kind: str, vocab: int):
    common = {"vocab_size": vocab, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "max_position_embeddings": CONTEXT,
              "pad_token_id": 0, "bos_token_id": None, "eos_token_id": 0}
    torch.manual_seed(0)
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**common))
    return LlamaForCausalLM(LlamaConfig(**common))


@functools.cache
def trained_state(kind: str) -> dict[str, torch.Tensor]:
    """A tiny model's weights after it has learnt ``ANSWERS`` by heart (about a second on a CPU)."""
    tokenizer = bpe_tokenizer()
    model = tiny(kind, len(tokenizer))
    families = [get_family("math"), get_family("regex", answer_pattern="x")]  # with the math instruction and without
    rows = [(family.encode(problem, tokenizer), tokenizer(answer + "<|im_end|>", add_special_tokens=False)["input_ids"])
            for problem, answer in ANSWERS.items() for family in families]
    length = max(len(prompt) + len(target) for prompt, target in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    labels = torch.full((len(rows), length), -100)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for row, (prompt, target) in enumerate(rows):
        end = len(prompt) + len(target)
        ids[row, :end] = torch.tensor(prompt + target)
        labels[row, len(prompt):end] = torch.tensor(target)
        mask[row, :end] = 1
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(400):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 0.005:
            break
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def write_model_dir(path: Path, kind: str = "qwen3", dtype: torch.dtype = torch.bfloat16, shards: bool = False,
                    nvidia: NvidiaDMSConfig | None = None, tokenizer: bool = True) -> Path:
    """A model directory as people have it (see the module docstring); ``nvidia``: in NVIDIA's DMS layout, with
    separate gates drawn at random (about half their decisions evict) or the repurposed query channel."""
    path = Path(path)
    tok = bpe_tokenizer()
    model = tiny(kind, len(tok))
    model.load_state_dict(trained_state(kind))
    model = model.to(dtype).eval()
    if nvidia is None:
        model.save_pretrained(path, max_shard_size="100KB" if shards else "10GB")
    else:
        gates = None
        if nvidia.separate_alpha:
            gates = build_gates(model, nvidia)
            generator = torch.Generator().manual_seed(5)
            for gate in gates:
                gate.weight.data.copy_(0.05 * torch.randn(gate.weight.shape, generator=generator))
        export_nvidia_layout(model, path, nvidia, gates)
    eos = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "do_sample": True, **GENERATION}))
    if tokenizer:
        tok.save_pretrained(path)
    return path


def nvidia_config(**changes) -> NvidiaDMSConfig:
    """Separate per-head gates, a window of 16 over NVIDIA's block of 8, served as 8x."""
    settings = {"alpha_scale": 100.0, "initial_alpha_offset": 5.0, "window_size": 16, "block_size": 8, "cr": 8.0,
                "separate_alpha": True, "alpha_per": "head"} | changes
    return NvidiaDMSConfig(**settings)
