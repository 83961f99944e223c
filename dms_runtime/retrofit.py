"""Retrofit training (``thinkpool retrofit``): teach eviction gates to drop KV entries the model won't miss.

The student is the base model with gates attached in DMS training mode; the teacher is the same base
model with DMS off (adapter-only training, the default, shares weights; full fine-tuning keeps a frozen
copy). The loss is the forward KL from teacher to student on the chain-of-thought tokens plus the
one-sided compression loss ``max(0, CR_target - CR_realized) / CR_target``, where CR_realized is the
eval metric itself: per example, tokens processed / tokens held at its end, averaged over heads and
examples. The target rises linearly and pauses at every ratio in ``stages``, where a snapshot adapter is
saved (one schedule gives the 2x, 4x and 8x adapters). Resumable from a state file.
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
from dms_runtime.chain_data import packed_batch
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
    rows: int = Field(6, gt=0)
    row_len: int = Field(1200, ge=256)
    k_min: int = Field(1, ge=1)
    k_max: int = Field(20, le=24)
    lr: float = Field(3e-4, gt=0)
    temperature: float = Field(0.1, gt=0)
    compression_weight: float = Field(1.0, ge=0)
    full_finetune: bool = False
    seed: int = 0
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


def target_ratio(step: int, config: RetrofitConfig) -> tuple[float, int]:
    """The target compression at ``step`` and the index of its stage (linear ramp, then hold)."""
    stage_len = config.ramp_steps + config.hold_steps
    stage = min(step // stage_len, len(config.stages) - 1)
    start = 1.0 if stage == 0 else config.stages[stage - 1]
    progress = min(1.0, (step - stage * stage_len) / config.ramp_steps)
    return start + (config.stages[stage] - start) * progress, stage


def realized_ratio(alphas: list[torch.Tensor], segments, window: int) -> torch.Tensor:
    """Mean over examples of (tokens / tokens held at the example's end), averaged over layers and heads.

    Held = every token still inside the window at the end, plus every older token not evicted."""
    per_example = []
    stacked = torch.stack([a.float() for a in alphas])  # [layers, R, decisions, L]
    for row, row_segments in enumerate(segments):
        cumulative = torch.nn.functional.pad(stacked[:, row].cumsum(-1), (1, 0))  # [layers, decisions, L+1]
        for start, end, _ in row_segments:
            last_evictable = max(start, end - 1 - window)  # tokens j < end-1-w have left the window
            evicted = cumulative[..., last_evictable] - cumulative[..., start]
            held = (end - start) - evicted
            per_example.append(((end - start) / held.clamp(min=1.0)).mean())
    return torch.stack(per_example).mean()


def retrofit(config: RetrofitConfig, steps: int | None = None, quiet: bool = False) -> list[Path]:
    """Train (or resume) and save one adapter per stage; returns the adapter paths written."""
    torch.manual_seed(config.seed)
    model, tokenizer = load_model(config.model)
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
        state = torch.load(state_path, weights_only=False)
        gates.load_state_dict(state["gates"])
        optimizer.load_state_dict(state["optimizer"])
        if config.full_finetune:
            model.load_state_dict(state["model"])
        start = state["step"]
    end = min(config.total_steps, start + steps) if steps is not None else config.total_steps
    written: list[Path] = []
    bar = tqdm(range(start, end), initial=start, total=config.total_steps, desc="retrofit", disable=quiet)
    began = time.perf_counter()
    for step in bar:
        target, stage = target_ratio(step, config)
        batch = packed_batch(tokenizer, random.Random(config.seed * 1_000_003 + step), config.k_min, config.k_max, config.rows, config.row_len)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), handle.mode("off"):
            teacher_logits = teacher(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
        handle.set_mode("train")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            student_logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
        mask = batch.loss_mask
        teacher_logp = torch.log_softmax(teacher_logits[mask].float(), dim=-1)
        student_logp = torch.log_softmax(student_logits[mask].float(), dim=-1)
        kl = (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1).mean()
        ratio = realized_ratio(handle.alphas(), batch.segments, dms.window)
        compression = torch.relu(target - ratio) / target
        loss = kl + config.compression_weight * compression
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        handle.set_mode("infer")
        bar.set_postfix(kl=f"{kl.item():.4f}", target=f"{target:.2f}", realized=f"{ratio.item():.2f}",
                        s_per_step=f"{(time.perf_counter() - began) / (step - start + 1):.1f}")
        stage_end = (stage + 1) * (config.ramp_steps + config.hold_steps)
        if step + 1 == stage_end:
            path = save_adapter(
                adapter_path(out_dir, config.stages[stage]), gates, dms, model, config.stages[stage],
                extra={"train_steps": step + 1, "train_realized_cr": round(ratio.item(), 3), "train_kl": round(kl.item(), 5)},
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
