"""Retrofit training (``thinkpool retrofit``): teach eviction gates to drop KV entries the model won't miss.

The student is the base model with gates attached in DMS training mode; the teacher is the same base
model with DMS off (adapter-only training, the default, shares weights; full fine-tuning keeps a frozen
copy). The loss is the forward KL from teacher to student on the chain-of-thought tokens plus the
one-sided compression loss ``max(0, f_target - f)``, where ``f`` is the fraction of evicted tokens among
those that have left the window. ``f_target`` is derived from the compression ratio the adapter is named
after: the eviction fraction at which the *realized* ratio (tokens processed / tokens held at a thread's
end, the eval metric, window included) averages the target over the training problems' lengths. The
target ratio rises linearly and pauses at every ratio in ``stages``, where a snapshot adapter is saved
(one schedule gives the 2x, 4x and 8x adapters). Resumable from a state file.
"""

from __future__ import annotations

import copy
import random
import time
from pathlib import Path

import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator
from tqdm import tqdm

from dms_runtime.adapters import adapter_path, save_adapter
from dms_runtime.attach import attach_dms
from dms_runtime.chain_data import difficulty_batch, sample_lengths
from dms_runtime.config import DMSConfig
from dms_runtime.gates import build_gates
from dms_runtime.loading import load_model


class RetrofitConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = "checkpoints/chain-qwen3"
    output: str | None = None  # where adapters go; default: beside the base model
    parametrization: str = "adapter"
    per_head: bool = True
    window: int = Field(16, ge=0)
    logit_scale: float = 100.0
    init_offset: float = -5.0
    stages: list[float] = [2.0, 4.0, 8.0]
    ramp_steps: int = Field(150, gt=0)
    hold_steps: int = Field(100, ge=0)
    tokens_per_batch: int = Field(6000, gt=0)
    k_min: int = Field(1, ge=1)
    k_max: int = Field(20, le=24)
    lr: float = Field(3e-4, gt=0)
    temperature: float = Field(0.1, gt=0)
    compression_weight: float = Field(1.0, ge=0)
    full_finetune: bool = False
    seed: int = 0
    device: str = "auto"  # auto = cuda when available (weights in bf16 there), else cpu
    checkpoint_every: int = Field(25, gt=0)

    @field_validator("stages")
    @classmethod
    def _increasing(cls, stages: list[float]) -> list[float]:
        if not stages or any(b <= a for a, b in zip([1.0] + stages, stages)) or stages[0] <= 1:
            raise ValueError("stages must be increasing compression ratios above 1, e.g. [2, 4, 8]")
        return stages

    @classmethod
    def from_yaml(cls, path: str | Path) -> "RetrofitConfig":
        return cls.model_validate(yaml.safe_load(Path(path).read_text()) or {})

    @property
    def dms(self) -> DMSConfig:
        return DMSConfig(self.parametrization, self.per_head, self.window, self.logit_scale, self.init_offset)  # type: ignore[arg-type]

    @property
    def total_steps(self) -> int:
        return len(self.stages) * (self.ramp_steps + self.hold_steps)


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def target_ratio(step: int, config: RetrofitConfig) -> tuple[float, int]:
    """The target compression at ``step`` and the index of its stage (linear ramp, then hold)."""
    stage_len = config.ramp_steps + config.hold_steps
    stage = min(step // stage_len, len(config.stages) - 1)
    start = 1.0 if stage == 0 else config.stages[stage - 1]
    progress = min(1.0, (step - stage * stage_len) / config.ramp_steps)
    return start + (config.stages[stage] - start) * progress, stage


def held_tokens(length: int, window: int, evicted_fraction: float) -> float:
    """Tokens a thread of ``length`` holds at its end: the last window + 1, plus what older tokens were kept."""
    inside = min(length, window + 1)
    return inside + (length - inside) * (1.0 - evicted_fraction)


def eviction_target(ratio: float, window: int, lengths: list[int]) -> float:
    """The eviction fraction at which the mean realized ratio over ``lengths`` equals ``ratio`` (capped at 0.995)."""
    def mean_ratio(fraction: float) -> float:
        return sum(n / held_tokens(n, window, fraction) for n in lengths) / len(lengths)

    if ratio <= 1.0:
        return 0.0
    low, high = 0.0, 0.995
    if mean_ratio(high) < ratio:
        return high
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if mean_ratio(middle) < ratio else (low, middle)
    return high


def evicted_fraction(alphas: list[torch.Tensor], lengths: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fraction of evicted tokens among those that left the window, and the batch's mean realized ratio."""
    stacked = torch.stack([a.float() for a in alphas])  # [layers, n, decisions, L]
    positions = torch.arange(stacked.shape[-1])
    left_window = positions[None, :] < (lengths[:, None] - 1 - window)  # [n, L]
    evicted = (stacked * left_window[None, :, None, :]).sum(-1)  # [layers, n, decisions]
    eligible = left_window.sum(-1).clamp(min=1)  # [n]
    fraction = evicted.sum() / (eligible.sum() * stacked.shape[0] * stacked.shape[2])
    ratio = (lengths[None, :, None] / (lengths[None, :, None] - evicted).clamp(min=1)).mean()
    return fraction, ratio


def retrofit(config: RetrofitConfig, steps: int | None = None, quiet: bool = False) -> list[Path]:
    """Train (or resume) and save one adapter per stage; returns the adapter paths written."""
    torch.manual_seed(config.seed)
    device = resolve_device(config.device)
    model, tokenizer = load_model(config.model, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    out_dir = Path(config.output or config.model)
    out_dir.mkdir(parents=True, exist_ok=True)
    teacher = copy.deepcopy(model) if config.full_finetune else model
    for parameter in teacher.parameters():
        parameter.requires_grad_(False)
    dms = config.dms
    gates = build_gates(model, dms)
    handle = attach_dms(model, gates, dms)
    for module in handle.modules:
        module.dms.temperature = config.temperature
    trainable = list(gates.parameters())
    if config.full_finetune:
        for parameter in model.parameters():
            parameter.requires_grad_(True)
        trainable += list(model.parameters())
    optimizer = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=0.0, betas=(0.9, 0.98))
    state_path = out_dir / f"retrofit_state-{dms.parametrization}-w{dms.window}.pt"
    start = 0
    if state_path.exists():
        state = torch.load(state_path, weights_only=False, map_location=device)
        gates.load_state_dict(state["gates"])
        optimizer.load_state_dict(state["optimizer"])
        if config.full_finetune:
            model.load_state_dict(state["model"])
        start = state["step"]
    end = min(config.total_steps, start + steps) if steps is not None else config.total_steps
    lengths = sample_lengths(tokenizer, config.k_min, config.k_max)
    written: list[Path] = []
    bar = tqdm(range(start, end), initial=start, total=config.total_steps, desc="retrofit", disable=quiet)
    began = time.perf_counter()
    for step in bar:
        target, stage = target_ratio(step, config)
        fraction_target = eviction_target(target, dms.window, lengths)
        batch = difficulty_batch(tokenizer, random.Random(config.seed * 1_000_003 + step), config.k_min, config.k_max,
                                 config.tokens_per_batch)
        input_ids = batch.input_ids.to(device)
        with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16), handle.mode("off"):
            teacher_logits = teacher(input_ids=input_ids, use_cache=False).logits
        handle.set_mode("train")
        with torch.autocast(device, dtype=torch.bfloat16):
            student_logits = model(input_ids=input_ids, use_cache=False).logits
        mask = batch.loss_mask.to(device)
        teacher_logp = torch.log_softmax(teacher_logits[mask].float(), dim=-1)
        student_logp = torch.log_softmax(student_logits[mask].float(), dim=-1)
        kl = (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1).mean()
        fraction, ratio = evicted_fraction([a.cpu() for a in handle.alphas()], batch.lengths, dms.window)
        compression = torch.relu(fraction_target - fraction)
        loss = kl + config.compression_weight * compression
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        handle.set_mode("infer")
        bar.set_postfix(kl=f"{kl.item():.4f}", k=batch.k, target=f"{target:.2f}", evict=f"{fraction.item():.3f}/{fraction_target:.3f}",
                        realized=f"{ratio.item():.2f}",
                        s_per_step=f"{(time.perf_counter() - began) / (step - start + 1):.1f}")
        stage_end = (stage + 1) * (config.ramp_steps + config.hold_steps)
        if step + 1 == stage_end:
            path = save_adapter(
                adapter_path(out_dir, config.stages[stage]), gates, dms, model, config.stages[stage],
                extra={"train_steps": step + 1, "eviction_target": round(fraction_target, 4), "train_kl": round(kl.item(), 5)},
            )
            if config.full_finetune:
                model.save_pretrained(out_dir)
                tokenizer.save_pretrained(out_dir)
            written.append(path)
        if (step + 1) % config.checkpoint_every == 0 or step + 1 == end:
            state = {"gates": gates.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1}
            if config.full_finetune:
                state["model"] = model.state_dict()
            torch.save(state, state_path)
    handle.detach()
    return written
