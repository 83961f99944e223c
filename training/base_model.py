"""Train the small base reasoning model on the chain task (``thinkpool train``).

Seeded and resumable: the data of step ``s`` is a pure function of (seed, s), and model, optimizer
and step are saved every ``checkpoint_every`` steps, so a stopped run continues where it left off and
ends with the same weights. Progress shows the loss and the teacher-forced exact-match rate (the
share of sequences whose every completion token is the argmax: a close proxy of greedy accuracy).
"""

from __future__ import annotations

import copy
import math
import random
import time
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from tqdm import tqdm
from transformers import Qwen3Config, Qwen3ForCausalLM

from training.chain_data import IGNORE, difficulty_batch
from training.precision import autocast
from tasks.chain_tokenizer import build_tokenizer
from training.yaml_config import load_yaml_config


class ModelShape(BaseModel):
    model_config = ConfigDict(extra="forbid")
    hidden_size: int = Field(192, gt=0)
    num_hidden_layers: int = Field(6, gt=0)
    num_attention_heads: int = Field(6, gt=0)
    num_key_value_heads: int = Field(2, gt=0)
    head_dim: int = Field(32, gt=0)
    intermediate_size: int = Field(576, gt=0)
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048


class DataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    k_min: int = Field(1, ge=1)
    k_max: int = Field(22, le=24)
    # Write each + or * line's operands in either order (tasks.cot.render_cot): many valid paths to one answer.
    any_order: bool = False
    # With any_order, - lines too: read from the right as k=j~b for k=b-j (tasks.cot.reversed_line).
    reversed_minus: bool = False


class OptimConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    steps: int = Field(3200, gt=0)
    tokens_per_batch: int = Field(12000, gt=0)
    lr: float = Field(2e-3, gt=0)
    min_lr_ratio: float = Field(0.05, ge=0, le=1)
    warmup_steps: int = Field(150, ge=0)
    weight_decay: float = Field(0.05, ge=0)
    grad_clip: float = Field(1.0, gt=0)


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    output_dir: str = "checkpoints/chain-qwen3-base"
    seed: int = 0
    model: ModelShape = ModelShape()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    checkpoint_every: int = Field(100, gt=0)
    # Stop the schedule early and export at this step: the shipped model is the step whose accuracy
    # profile fits (see README), not necessarily the end of the cosine schedule.
    export_at_step: int | None = Field(None, gt=0)
    snapshot_every: int | None = Field(None, gt=0)  # keep a copy of the train state every N steps
    device: str = "auto"  # auto = cuda when available, else cpu
    # Start from this checkpoint's weights (a fine-tune) rather than from random ones.
    init_from: str | None = None

    @field_validator("init_from")
    @classmethod
    def _a_checkpoint(cls, path: str | None) -> str | None:
        if path is not None and not (Path(path) / "config.json").is_file():
            raise ValueError(f"no checkpoint at {path} (a directory with config.json and model weights)")
        return path

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> TrainConfig:
        """The config at ``path`` (its ``base`` chain resolved, see :mod:`training.yaml_config`), then ``overrides``."""
        return cls.model_validate(load_yaml_config(path) | overrides)


def build_model(shape: ModelShape, tokenizer) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate_size,
        rope_theta=shape.rope_theta,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen3ForCausalLM(config)


def grow_vocabulary(weights: dict[str, torch.Tensor], model: Qwen3ForCausalLM) -> None:
    """Let a fine-tune start from a checkpoint whose tokenizer had fewer characters: its embedding rows are kept,
    the new characters' rows keep ``model``'s fresh initialization."""
    fresh = model.state_dict()
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in weights and weights[name].shape[0] < fresh[name].shape[0]:
            grown = fresh[name].clone()
            grown[: weights[name].shape[0]] = weights[name]
            weights[name] = grown


def make_batch(config: TrainConfig, tokenizer, step: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Step ``step``'s batch: problems of one difficulty (so little padding), prompt tokens masked."""
    batch = difficulty_batch(tokenizer, random.Random(config.seed * 1_000_003 + step), config.data.k_min,
                             config.data.k_max, config.optim.tokens_per_batch, config.data.any_order,
                             config.data.reversed_minus)
    return batch.input_ids, batch.labels, batch.k


def lr_at(step: int, optim: OptimConfig) -> float:
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    progress = (step - optim.warmup_steps) / max(1, optim.steps - optim.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return optim.lr * (optim.min_lr_ratio + (1 - optim.min_lr_ratio) * cosine)


def train(config: TrainConfig, steps: int | None = None, quiet: bool = False) -> Path:
    """Train (or resume) and export a ``save_pretrained`` checkpoint with its tokenizer; return its path."""
    torch.manual_seed(config.seed)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    state_path = out / "train_state.pt"
    tokenizer = build_tokenizer(config.data.reversed_minus)
    device = "cuda" if config.device == "auto" and torch.cuda.is_available() else ("cpu" if config.device == "auto" else config.device)
    model = build_model(config.model, tokenizer).to(device)
    if config.init_from:
        start_weights = Qwen3ForCausalLM.from_pretrained(config.init_from, dtype=torch.float32).state_dict()
        grow_vocabulary(start_weights, model)
        model.load_state_dict(start_weights)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.optim.lr,
        betas=(0.9, 0.98),
    )
    start = 0
    if state_path.exists():
        state = torch.load(state_path, weights_only=False, map_location=device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    final = min(config.optim.steps, config.export_at_step or config.optim.steps)
    end = min(final, start + steps) if steps is not None else final
    model.train()
    bar = tqdm(range(start, end), initial=start, total=config.optim.steps, desc="train", disable=quiet)
    seen, began = 0, time.perf_counter()
    for step in bar:
        input_ids, labels, k = make_batch(config, tokenizer, step)
        input_ids, labels = input_ids.to(device), labels.to(device)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config.optim)
        with autocast(input_ids.device):  # bf16 only where the hardware has it (training/precision.py)
            logits = model(input_ids=input_ids).logits[:, :-1].float()
        targets = labels[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.optim.grad_clip)
        optimizer.step()
        with torch.no_grad():
            mask = targets != IGNORE
            exact = ((logits.argmax(-1) == targets) | ~mask).all(dim=1).float().mean().item()
        seen += int(mask.sum())
        bar.set_postfix(loss=f"{loss.item():.4f}", k=k, exact=f"{exact:.2f}", tok_s=f"{seen / (time.perf_counter() - began):.0f}")
        if (step + 1) % config.checkpoint_every == 0 or step + 1 == end:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1}, state_path)
        if config.snapshot_every and (step + 1) % config.snapshot_every == 0:
            torch.save({"model": model.state_dict(), "step": step + 1}, out / f"snapshot-{step + 1}.pt")
    if end == final:
        model.config.reversed_minus = config.data.reversed_minus  # the chain of thought's forms, for tools
        export(model, tokenizer, out)
    return out


def export(model: Qwen3ForCausalLM, tokenizer, out: Path) -> None:
    """Save weights in float16 (half the bytes; thinkpool loads them back as float32) and the tokenizer."""
    model = copy.deepcopy(model).cpu().eval().to(torch.float16)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/train_base.yaml")
    parser.add_argument("--steps", type=int, default=None, help="stop after this many steps (resume later)")
    args = parser.parse_args()
    train(TrainConfig.from_yaml(args.config), steps=args.steps)
