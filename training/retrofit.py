"""Retrofit training (``thinkpool retrofit``): teach eviction gates to drop KV entries the model won't miss.

Every ratio in ``ratios`` gets its own gates, and all are trained together on one shared model: each
batch row is assigned to one ratio (row ``r`` to ``ratios[r % n]``), and that row's attention uses that
ratio's gates. With full fine-tuning, one more group of rows runs without gates ("anchor" rows), so the
shared weights keep serving CR 1 as the teacher does. So one set of base weights serves every ratio, and the engine can mix ratios in one batch.
The student is the base model with gates attached in DMS training mode; the teacher is the frozen base
model (adapter-only training, the default, shares its weights; full fine-tuning keeps a frozen copy).
The loss is the forward KL from teacher to student on the chain-of-thought tokens plus, per ratio, the
one-sided compression loss ``max(0, f_target - f)`` (or, with ``compression_loss: two_sided``,
``|f_target - f|``, which also stops a ratio from overshooting its target), where ``f`` is the fraction of evicted tokens among
those that have left the window. ``f_target`` comes from the ratio the adapter is named after: the
eviction fraction at which the *realized* ratio (tokens processed / tokens held at a thread's end, the
eval metric, window included) averages the target over the training problems' lengths. Each target
rises linearly from 1 over ``ramp_steps``, then holds for ``hold_steps``. Resumable from a state file.

Before that, ``warmstart_steps`` steps teach each ratio's gates where to start: the frozen model runs in
probe mode, which reports for every key how much attention it still gets from queries beyond the
window; the keys getting the least (a quantile at the ratio's eviction target, pooled over layers and
heads) are labelled "evict", and the gates learn those labels (binary cross-entropy). Role labels
(``training.gate_labels.RoleLabels``) instead keep a long-lived set of tokens whole in as many (layer, head) pairs
as each ratio affords, planned once on calibration batches before the warm start: the chain task's long-lived
regions (``warmstart_labels: cot_roles``, chain-task models only) or, for any task, the kinds of token whose
eviction costs the frozen model most (``effect_roles``, ``training.effect_roles``). Measured on the
shipped model, evicting by that rule alone keeps the KL near zero at 2x, whereas gates trained from KL
alone through the straight-through estimator find it only slowly: its gradient reaches a gate only while
its logit is near the threshold.

The training text (``training.retrofit_data``) is generated chain problems with their reference chain of thought
(the shipped recipe), or, with ``problems``, the user's prompts with the frozen model's own sampled completions
(``training.completions``, cached in the output directory): then any model and task family can be retrofitted.

Adapter-only output goes beside the base model; full fine-tuning writes a new model directory (its
weights, tokenizer and adapters), since the adapters then belong to the fine-tuned weights. NVIDIA's separate gates
(``parametrization: nvidia_separate``) read the layer's input before its input norm, as NVIDIA's code does; with
``layout: nvidia`` every ratio is then also exported as a model directory in NVIDIA's DMS layout.
"""

from __future__ import annotations

import copy
import dataclasses
import shutil
import time
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from torch import nn
from tqdm import tqdm

from dms_runtime.adapters import adapter_path, load_gates, read_adapter_metadata, save_adapter
from dms_runtime.attach import attach_dms
from dms_runtime.attention import shifted_decisions
from training.base_model import export
from training.chain_data import Batch, long_lived_mask
from training.effect_roles import EffectRoles, plan_effect_roles
from training.completions import sample_completions
from training.retrofit_data import ChainText, TrainingText, training_text
from dms_runtime.config import DMSConfig
from dms_runtime.gates import build_gates
from training.gate_labels import RoleLabels, eligible_mask, far_attention_labels, left_window_mask, sampled_quantile
from dms_runtime.loading import load_model
from dms_runtime.nvidia_gates import export_block_size
from dms_runtime.nvidia_layout import export_nvidia_layout
from tasks.families import FAMILIES, default_family
from training.precision import autocast
from training.thresholds import DEFAULT_PROBLEMS
from training.yaml_config import load_yaml_config


class RetrofitConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = "checkpoints/chain-qwen3-base"
    output: str | None = None  # where adapters go; default: beside the base model
    # The training text: a problem file (JSONL of {id, prompt}) whose prompts the frozen model completes, by task
    # family (default: the model's); none: generated chain problems (k_min..k_max, any_order).
    problems: str | None = None
    task: str | None = None
    completions_per_problem: int = Field(1, ge=1)
    max_new_tokens: int = Field(2048, ge=1)  # per completion
    # nvidia_separate: NVIDIA's separate gates (reading the layer's input before its input norm), exportable in
    # NVIDIA's layout (``layout: nvidia``, its paged block nvidia_block_size; default: below the window).
    parametrization: Literal["adapter", "query_neuron", "nvidia_separate"] = "adapter"
    layout: Literal["thinkpool", "nvidia"] = "thinkpool"
    nvidia_block_size: int | None = Field(None, ge=1)
    per_head: bool = True
    window: int = Field(16, ge=0)
    logit_scale: float = 100.0
    init_offset: float = -5.0
    ratios: list[float] = [2.0, 4.0, 8.0]
    ramp_steps: int = Field(300, gt=0)
    hold_steps: int = Field(150, ge=0)
    tokens_per_batch: int = Field(6000, gt=0)
    k_min: int = Field(1, ge=1)
    k_max: int = Field(20, le=24)
    # The chain of thought the base model was trained on: with any_order (configs/train_anyorder.yaml) every
    # commutative line takes its operands in either order, and the distillation data must do the same.
    any_order: bool = False
    lr: float = Field(3e-4, gt=0)  # gates
    finetune_lr: float = Field(1e-4, gt=0)  # base weights, with full_finetune
    # The last lr_decay_steps steps take both learning rates linearly down to zero (constant before): at a
    # constant rate the distillation KL stops falling at the noise its own steps make.
    lr_decay_steps: int = Field(0, ge=0)
    temperature: float = Field(0.1, gt=0)
    compression_weight: float = Field(1.0, ge=0)
    # one_sided: the paper's loss; KL alone must keep the gates from evicting beyond the target.
    # two_sided: holds each ratio at its target (needed where the KL gradient through the gates is weak).
    compression_loss: Literal["one_sided", "two_sided"] = "one_sided"
    full_finetune: bool = False
    anchor_rows: bool = True  # full fine-tuning: some rows run without gates, so CR 1 stays the teacher's model
    warmstart_steps: int = Field(0, ge=0)  # gate warm start from far attention (see the module docstring)
    warmstart_lr: float = Field(1e-3, gt=0)
    # per_head: each head keeps what it reads; per_token: every head keeps what any head reads far later
    # (on the shipped model most heads attend diffusely, and per-head labels follow that noise).
    # cot_roles: tokens of the chain of thought's long-lived regions (prompt, registers) are kept whole in as
    # many (layer, head) pairs as each ratio allows, the rest by far attention (training.gate_labels.RoleLabels);
    # only for models trained on the chain task.
    # effect_roles: the same plan with a long-lived set any task has (training.effect_roles): the kinds of token
    # (clusters of one layer's hidden state) whose eviction costs the frozen model most per token, measured on
    # calibration batches of the training text before the warm start. Measured on the chain model it is worse than
    # per_head at 8x (docs/dms.md, "Kinds whose eviction costs most"): an option under study, not a default.
    warmstart_labels: Literal["per_head", "per_token", "cot_roles", "effect_roles"] = "per_head"
    effect_kinds: int = Field(64, ge=2)  # effect_roles: how many kinds of token
    effect_layer: int | None = Field(None, ge=0)  # effect_roles: whose hidden state tells the kinds (None: the middle layer)
    effect_mass: float = Field(0.8, gt=0, le=1)  # effect_roles: the share of the eviction cost the long-lived kinds carry
    effect_batches: int = Field(16, ge=1)  # effect_roles: calibration batches of four of a problem file's completions
    effect_cost: Literal["nll", "kl"] = "nll"  # effect_roles: what a kind's eviction is costed by (training.effect_roles)
    # After the warm start, train only the weights (full fine-tuning) under the warm-started gates' decisions:
    # measured on the shipped model, KL through the straight-through estimator moves the gates away from what
    # the warm start found faster than it improves them.
    freeze_gates: bool = False
    # Keep the warm start's objective during training, at this weight: its labels (from the frozen teacher,
    # run in probe mode) stay fixed while the weights move, so the gates' decisions cannot drift with the
    # hidden states they read; with full fine-tuning its gradient also reaches the weights, which learn to
    # make the labels readable at write time. Decisions are then deterministic (no gate noise).
    gate_supervision: float = Field(0.0, ge=0)
    # After training, fit each adapter's decision threshold so that it realizes its ratio (training.thresholds): on
    # this many greedy solves of fresh chain problems (seeded by threshold_seed) or, with a problem file, teacher-forced
    # on this many of its cached completions (any task, nothing generated); 0 keeps the trained threshold. Unset: the
    # teacher-forced fit on 64 completions where there is a problem file and a threshold to fit, else 0.
    threshold_problems: int | None = Field(None, ge=0)
    threshold_seed: int = 9001
    # Then measure what each adapter keeps of a thread on this many fresh problems (8 sampled threads each), the
    # reservation workers admit threads by (``thinkpool kv-growth``; adapters beside their model only); 0 skips.
    kv_growth_problems: int = Field(16, ge=0)
    # A finished run's output directory (its weights, with full fine-tuning, and every ratio's adapter): training
    # goes on from there, with a fresh optimizer, up to total_steps. A longer run without repeating its warm start.
    continue_from: str | None = None
    seed: int = 0
    device: str = "auto"  # auto = cuda when available (weights in bf16 there), else cpu
    checkpoint_every: int = Field(25, gt=0)

    @model_validator(mode="after")
    def _default_threshold_fit(self) -> RetrofitConfig:
        if self.threshold_problems is None:
            fits = self.problems is not None and self.parametrization != "nvidia_separate"
            self.threshold_problems = DEFAULT_PROBLEMS if fits else 0
        return self

    @model_validator(mode="after")
    def _text_fits_the_recipe(self) -> RetrofitConfig:
        if self.problems is None:
            if self.task is not None:
                raise ValueError("task: names the family of a problem file's rows; it needs problems")
            return self
        family = (self.task or default_family(self.model)) if self.warmstart_labels == "cot_roles" else None
        if family not in (None, "chain"):
            raise ValueError(f"warmstart_labels: cot_roles labels the roles of the chain task's chain of thought; "
                             f"completions of {family!r} rows have none: use effect_roles (found for any task), "
                             f"per_head or per_token")
        return self

    @model_validator(mode="after")
    def _nvidia_layout(self) -> RetrofitConfig:
        if self.layout == "nvidia" and self.parametrization != "nvidia_separate":
            raise ValueError(f"layout: nvidia exports NVIDIA's separate gates, which read the layer's input before its "
                             f"norm; it needs parametrization nvidia_separate, not {self.parametrization}")
        if self.parametrization != "nvidia_separate":
            return self
        if self.window < 2:
            raise ValueError(f"window: NVIDIA's layout needs a window larger than its paged block (at least 2), "
                             f"got {self.window}")
        if self.nvidia_block_size is not None and self.nvidia_block_size >= self.window:
            raise ValueError(f"nvidia_block_size: {self.nvidia_block_size} must be smaller than the window "
                             f"({self.window})")
        if self.threshold_problems:
            raise ValueError("threshold_problems: NVIDIA's layout has no decision threshold; with parametrization "
                             "nvidia_separate it must be 0")
        return self

    @model_validator(mode="after")
    def _something_to_train(self) -> RetrofitConfig:
        if self.freeze_gates and not self.full_finetune:
            raise ValueError("freeze_gates needs full_finetune: with frozen gates and frozen weights nothing trains")
        if self.gate_supervision and not self.warmstart_steps:
            raise ValueError("gate_supervision keeps the warm start's labels: it needs warmstart_steps > 0")
        if self.gate_supervision and self.freeze_gates:
            raise ValueError("gate_supervision trains the gates: it cannot be combined with freeze_gates")
        return self

    @field_validator("task")
    @classmethod
    def _known_task(cls, task: str | None) -> str | None:
        if task is not None and task not in FAMILIES:
            raise ValueError(f"unknown task family {task!r}; known: {', '.join(FAMILIES)}")
        return task

    @field_validator("ratios")
    @classmethod
    def _increasing(cls, ratios: list[float]) -> list[float]:
        if not ratios or any(b <= a for a, b in zip([1.0] + ratios, ratios)) or ratios[0] <= 1:
            raise ValueError("ratios must be increasing compression ratios above 1, e.g. [2, 4, 8]")
        return ratios

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> RetrofitConfig:
        """The config at ``path`` (its ``base`` chain resolved, see :mod:`training.yaml_config`), then ``overrides``."""
        return cls.model_validate(load_yaml_config(path) | overrides)

    @property
    def dms(self) -> DMSConfig:
        return DMSConfig(self.parametrization, self.per_head, self.window, self.logit_scale, self.init_offset)  # type: ignore[arg-type]

    @property
    def total_steps(self) -> int:
        return self.ramp_steps + self.hold_steps

    @property
    def block_size(self) -> int:
        """NVIDIA's paged block of the export (``nvidia_separate``): ``nvidia_block_size``, else below the window."""
        return self.nvidia_block_size or export_block_size(self.window)

    @property
    def output_dir(self) -> Path:
        """Adapter-only: beside the base model. Full fine-tuning, or NVIDIA's separate gates (which thinkpool's
        engine serves from their NVIDIA-layout export, not beside the model): ``<model>-dms``."""
        if self.output:
            return Path(self.output)
        apart = self.full_finetune or self.parametrization == "nvidia_separate"
        return Path(f"{self.model.rstrip('/')}-dms") if apart else Path(self.model)


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def chain_batch(config: RetrofitConfig, tokenizer, offset: int, k_min: int | None = None,
                k_max: int | None = None) -> Batch:
    """The chain batch of seed ``offset`` (see :class:`~training.retrofit_data.ChainText`)."""
    return ChainText.from_config(config, tokenizer).batch(offset, k_min, k_max)


def target_ratio(step: int, final: float, config: RetrofitConfig) -> float:
    """The target compression of an adapter named ``final`` at ``step``: a linear ramp from 1, then a hold.
    (After a gate warm start, training holds what the warm start labelled instead: see ``retrofit``.)"""
    return 1.0 + (final - 1.0) * min(1.0, step / config.ramp_steps)


def lr_scale(step: int, config: RetrofitConfig) -> float:
    """The learning rates' factor at ``step``: 1, then down to 0 over the last ``lr_decay_steps`` steps."""
    remaining = config.total_steps - step
    return min(1.0, remaining / config.lr_decay_steps) if config.lr_decay_steps else 1.0


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
    """Fraction of evicted tokens among those that left the window, and the rows' mean realized ratio."""
    stacked = torch.stack([a.float() for a in alphas])  # [layers, n, decisions, L]
    left_window = left_window_mask(lengths, stacked.shape[-1], window)  # [n, L]
    evicted = (stacked * left_window[None, :, None, :]).sum(-1)  # [layers, n, decisions]
    eligible = left_window.sum(-1).clamp(min=1)  # [n]
    fraction = evicted.sum() / (eligible.sum() * stacked.shape[0] * stacked.shape[2])
    ratio = (lengths[None, :, None] / (lengths[None, :, None] - evicted).clamp(min=1)).mean()
    return fraction, ratio


def ratio_logits(decisions: list[torch.Tensor], row_ratio: torch.Tensor, lengths: torch.Tensor, window: int, ratio: int) -> torch.Tensor:
    """The decision logits (every layer and head) of ratio ``ratio``'s rows, for the tokens that left the window."""
    stacked = torch.stack(decisions)  # [layers, B, kv, T]
    rows = (row_ratio == ratio).to(stacked.device)
    return stacked[eligible_mask(stacked, lengths, window) & rows[None, :, None, None]]


ROLE_LABELS = ("cot_roles", "effect_roles")  # the warm-start labels planned as RoleLabels


def long_lived_tokens(roles: RoleLabels, tokenizer, batch: Batch, hidden_states) -> torch.Tensor:
    """``[B, T]``: a batch's long-lived tokens for the role labels: the effect roles' kinds where they were planned
    (from the frozen model's ``hidden_states`` on the batch), else the chain task's long-lived regions."""
    if roles.kinds is not None:
        return roles.kinds.mask(hidden_states, batch)
    return long_lived_mask(tokenizer, batch)


def probe_pass(model, handle, row_gates: nn.ModuleList, batch, ratios: int,
               hidden: bool = False) -> tuple[torch.Tensor, list, list, tuple | None]:
    """The frozen model on ``batch`` in probe mode: each row's ratio index, per-layer far attention,
    per-layer gate decision logits ``[B, kv, T]`` (with gradients to the gates) and, if asked, its hidden states."""
    device = next(model.parameters()).device
    row_ratio = torch.arange(len(batch.input_ids)) % ratios
    for gates in row_gates:
        gates.row_ratio = row_ratio
    with handle.mode("probe"), autocast(device):
        with torch.no_grad():
            output = model(input_ids=batch.input_ids.to(device), use_cache=False, output_hidden_states=hidden)
        far = handle.far_attentions()
        decisions = [shifted_decisions(module.dms.logits.float()) for module in handle.modules]
    return row_ratio, far, decisions, output.hidden_states if hidden else None


def gate_label_loss(config: RetrofitConfig, batch, long_lived: torch.Tensor | None, far: list[torch.Tensor],
                    decisions: list[torch.Tensor], row_ratio: torch.Tensor, fractions: list[float],
                    roles: RoleLabels | None = None,
                    labelled: list[list[float]] | None = None) -> tuple[torch.Tensor, dict[str, str]]:
    """The warm start's objective on one batch: binary cross-entropy of every ratio's decision logits (its
    rows) against its labels (``roles``' from the batch's ``long_lived`` tokens when given, else far attention at
    ``fractions``), and each ratio's agreement with them. ``labelled`` accumulates, per ratio, the evicted and
    eligible counts of the labels."""
    scores = roles.scores(far, long_lived) if roles is not None else None
    loss = torch.zeros((), device=decisions[0].device)
    shown = {}
    for index, (final, fraction) in enumerate(zip(config.ratios, fractions)):
        rows = (row_ratio == index).to(far[0].device)
        if not bool(rows.any()):
            continue
        lengths = batch.lengths[rows.cpu()]
        if roles is not None:
            labels, weights, eligible = roles.labels(scores[:, rows], lengths, config.window, index)
        else:
            labels, weights, eligible = far_attention_labels([f[rows] for f in far], lengths, config.window, fraction,
                                                             per_token=config.warmstart_labels == "per_token")
        if labelled is not None:
            labelled[index][0] += labels[eligible].sum().item()
            labelled[index][1] += eligible.sum().item()
        logits = torch.stack([d[rows.to(d.device)] for d in decisions])
        loss = loss + nn.functional.binary_cross_entropy_with_logits(logits[eligible], labels[eligible], weights[eligible])
        shown[f"{final:g}x"] = f"{((logits[eligible] > 0).float() == labels[eligible]).float().mean().item():.2f}"
    return loss, shown


@torch.no_grad()
def restore_role_labels(saved: dict) -> RoleLabels:
    """Role labels as a retrofit's state file holds them, their effect roles with them."""
    return RoleLabels.from_state(saved, EffectRoles.from_state(saved["kinds"]) if saved.get("kinds") else None)


def calibration_batches(config: RetrofitConfig, text: TrainingText) -> list[Batch]:
    """Fresh batches the role labels are planned on: chain text one per difficulty (the eval's ratio weighs every
    problem, short or long, the same), a problem file's completions ``effect_batches`` of four, spread over every
    length (training's batches, each a run of one length, planned kinds that were less precise; docs/dms.md)."""
    if isinstance(text, ChainText):
        return [text.batch(15_485_863 * k, k, k) for k in range(config.k_min, config.k_max + 1)]
    return text.spread_batches(config.effect_batches)


def plan_role_labels(model, handle, row_gates: nn.ModuleList, config: RetrofitConfig, text: TrainingText,
                     tokenizer, quiet: bool = True) -> RoleLabels:
    """Role labels' long-lived set (the effect roles', planned first, or the chain task's regions), bands and
    thresholds from the frozen model's far attention on calibration batches."""
    batches = calibration_batches(config, text)
    kinds = None
    if config.warmstart_labels == "effect_roles":
        layer = config.effect_layer if config.effect_layer is not None else len(handle.modules) // 2
        kinds = plan_effect_roles(model, handle, batches, config.window, layer, config.effect_kinds, config.effect_mass,
                                  config.seed, config.effect_cost, quiet)
    probes = []
    for batch in batches:
        _, far, _, hidden = probe_pass(model, handle, row_gates, batch, len(config.ratios), hidden=kinds is not None)
        long_lived = kinds.mask(hidden, batch) if kinds is not None else long_lived_mask(tokenizer, batch)
        probes.append(([f.float().cpu() for f in far], long_lived.cpu(), batch.lengths))
    roles = RoleLabels.plan(probes, config.ratios, config.window)
    roles.kinds = kinds
    return roles


def warm_start(model, handle, row_gates: nn.ModuleList, config: RetrofitConfig, tokenizer, text: TrainingText,
               fractions: list[float], roles: RoleLabels | None, quiet: bool) -> list[float]:
    """Teach every ratio's gates its labels: ``roles``' when given, else what the frozen model attends to least
    from beyond the window, each at its eviction target (``fractions``); returns each ratio's eviction fraction as labelled (its target,
    or less where bands were kept whole)."""
    labelled = [[0.0, 0.0] for _ in config.ratios]  # evicted, eligible: over the whole warm start
    optimizer = torch.optim.AdamW(row_gates.parameters(), lr=config.warmstart_lr, weight_decay=0.0)
    bar = tqdm(range(config.warmstart_steps), desc="gate warm start", disable=quiet)
    for step in bar:
        batch = text.batch(7_919 * (step + 1))
        row_ratio, far, decisions, hidden = probe_pass(model, handle, row_gates, batch, len(config.ratios),
                                                       hidden=roles is not None and roles.kinds is not None)
        long_lived = long_lived_tokens(roles, tokenizer, batch, hidden) if roles is not None else None
        loss, shown = gate_label_loss(config, batch, long_lived, far, decisions, row_ratio, fractions, roles, labelled)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        bar.set_postfix(bce=f"{loss.item():.3f}", label_agreement=shown)
    labelled_fractions = [evicted / max(1.0, eligible) for evicted, eligible in labelled]
    calibrate_offsets(model, handle, row_gates, config, text, labelled_fractions)
    return labelled_fractions


@torch.no_grad()
def calibrate_offsets(model, handle, row_gates: nn.ModuleList, config: RetrofitConfig, text: TrainingText,
                      fractions: list[float], batches: int = 8) -> None:
    """Shift each ratio's logit offset so that, on fresh batches, it evicts exactly its target fraction of the
    tokens that left the window (the weighted labels of the warm start leave the gates on the keeping side)."""
    ratios = len(config.ratios)
    collected: list[list[torch.Tensor]] = [[] for _ in range(ratios)]
    for index in range(batches):
        batch = text.batch(-104_729 * (index + 1))
        row_ratio, _, decisions, _ = probe_pass(model, handle, row_gates, batch, ratios)
        for r in range(ratios):
            collected[r].append(ratio_logits(decisions, row_ratio, batch.lengths, config.window, r).detach().float().cpu())
    for r, fraction in enumerate(fractions):
        logits = torch.cat(collected[r])
        if logits.numel():
            gates = [layer.gates[r] for layer in row_gates]
            set_offsets([gates], [gates[0].config.init_offset - sampled_quantile(logits, 1.0 - fraction).item()])


def track_offsets(per_ratio: list[nn.ModuleList], decisions: list[torch.Tensor], row_ratio: torch.Tensor,
                  lengths: torch.Tensor, window: int, fractions: list[float], damping: float = 0.1) -> None:
    """Frozen gates: move each ratio's logit offset towards the one that would have evicted exactly its target
    fraction of this batch (its rows, under the current weights), so ratios stay on target as weights change.
    Slowly: a batch has one difficulty, and what a ratio evicts varies with it (the share of long-lived
    tokens does), so the offset follows the weights' drift over many batches rather than chasing each one."""
    for r, (gates, fraction) in enumerate(zip(per_ratio, fractions)):
        values = ratio_logits(decisions, row_ratio, lengths, window, r)
        if values.numel():
            shift = sampled_quantile(values, 1.0 - fraction).item()
            set_offsets([gates], [gates[0].config.init_offset - damping * shift])


def set_offsets(per_ratio: list[nn.ModuleList], offsets: list[float]) -> None:
    """Give every gate of ratio r the logit offset ``offsets[r]`` (the warm start's calibration, on resume)."""
    for gates, offset in zip(per_ratio, offsets):
        for gate in gates:
            gate.config = dataclasses.replace(gate.config, init_offset=offset)


class RowGates(nn.Module):
    """One layer's gates for every ratio; each batch row uses the gates of its ratio (``row_ratio``). Gates that read
    the layer's input before its norm (NVIDIA's separate gates) are each handed what the handle hands this module."""

    def __init__(self, gates: list[nn.Module]):
        super().__init__()
        self.gates = nn.ModuleList(gates)
        self.query_channels = gates[0].query_channels
        self.row_ratio = torch.zeros(0, dtype=torch.long)
        self.reads_layer_input = any(getattr(gate, "reads_layer_input", False) for gate in gates)
        self.layer_input: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.reads_layer_input:
            layer_input, self.layer_input = self.layer_input, None
            for gate in self.gates:
                gate.layer_input = layer_input
        logits = torch.stack([gate(hidden) for gate in self.gates])  # [ratios, rows, T, decisions]
        row_ratio = self.row_ratio.to(hidden.device)
        index = row_ratio.clamp(min=0)[None, :, None, None].expand(1, -1, *logits.shape[2:])
        chosen = logits.gather(0, index)[0]
        return chosen.masked_fill((row_ratio < 0)[:, None, None], -1e4)  # anchor rows (-1) keep every token


def retrofit(config: RetrofitConfig, steps: int | None = None, quiet: bool = False) -> list[Path]:
    """Train (or resume) the gates of every ratio together; returns the adapter paths written at the end."""
    torch.manual_seed(config.seed)
    device = resolve_device(config.device)
    out_dir = config.output_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    completions = None
    if config.problems is not None:  # sampled before training loads its model: the engine's copy is gone by then
        completions = sample_completions(config.model, config.problems, out_dir, config.task,
                                         samples=config.completions_per_problem,
                                         max_new_tokens=config.max_new_tokens, seed=config.seed, quiet=quiet)
    model, tokenizer = load_model(config.model, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    text = training_text(config, tokenizer, completions)
    teacher = copy.deepcopy(model) if config.full_finetune else model
    for parameter in teacher.parameters():
        parameter.requires_grad_(False)
    dms = config.dms
    per_ratio = [build_gates(model, dms) for _ in config.ratios]  # [ratio][layer]
    row_gates = nn.ModuleList(RowGates([gates[layer] for gates in per_ratio]) for layer in range(len(per_ratio[0])))
    handle = attach_dms(model, row_gates, dms)
    for module in handle.modules:
        module.dms.temperature = config.temperature
        # frozen or supervised gates: train under the decisions inference will make
        module.dms.noise = not (config.freeze_gates or config.gate_supervision)
    groups = [] if config.freeze_gates else [{"params": list(row_gates.parameters()), "lr": config.lr}]
    if config.full_finetune:
        for parameter in model.parameters():
            parameter.requires_grad_(True)
        groups.append({"params": list(model.parameters()), "lr": config.finetune_lr})
    trainable = [p for group in groups for p in group["params"]]
    base_lrs = [group["lr"] for group in groups]
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0, betas=(0.9, 0.98))
    supervised = config.gate_supervision > 0
    # The teacher also labels the gates each step (probe mode: vanilla outputs plus far attention).
    teacher_handle = (attach_dms(teacher, build_gates(teacher, dms), dms) if teacher is not model else handle) if supervised else None
    state_path = out_dir / f"retrofit_state-{dms.parametrization}-w{dms.window}.pt"
    start = 0
    warm_fractions: list[float] | None = None  # what the warm start labelled: training then holds it
    roles: RoleLabels | None = None  # fixed role labels (cot_roles), planned once before the warm start
    if state_path.exists():
        state = torch.load(state_path, weights_only=False, map_location=device)
        row_gates.load_state_dict(state["gates"])
        if "offsets" in state:
            set_offsets(per_ratio, state["offsets"])
        warm_fractions = state.get("fractions")
        roles = restore_role_labels(state["roles"]) if state.get("roles") else None
        optimizer.load_state_dict(state["optimizer"])
        if config.full_finetune:
            model.load_state_dict(state["model"])
        start = state["step"]
    elif config.continue_from:
        if config.warmstart_labels in ROLE_LABELS:  # planned on the base weights, as the run being continued did
            roles = plan_role_labels(model, handle, row_gates, config, text, tokenizer, quiet)
        start, warm_fractions, label_thresholds = continue_from_export(model, per_ratio, config)
        if roles is not None:
            roles.thresholds = label_thresholds  # what its labels were: the plan repeated on other hardware may round apart
    end = min(config.total_steps, start + steps) if steps is not None else config.total_steps
    lengths = text.lengths()
    label_fractions = [eviction_target(final, dms.window, lengths) for final in config.ratios]  # the labels' targets
    if config.warmstart_labels in ROLE_LABELS and roles is None:
        roles = plan_role_labels(model, handle, row_gates, config, text, tokenizer, quiet)
    if start == 0 and config.warmstart_steps:
        warm_fractions = warm_start(model, handle, row_gates, config, tokenizer, text, label_fractions, roles, quiet)
    if config.freeze_gates:
        row_gates.requires_grad_(False)
    ratios = len(config.ratios)
    anchors = config.full_finetune and config.anchor_rows
    teacher_hidden = supervised and roles is not None and roles.kinds is not None  # the effect roles read them
    bar = tqdm(range(start, end), initial=start, total=config.total_steps, desc="retrofit", disable=quiet)
    began = time.perf_counter()
    kl = torch.zeros(())
    for step in bar:
        targets = [target_ratio(step, final, config) for final in config.ratios]
        fraction_targets = warm_fractions or [eviction_target(t, dms.window, lengths) for t in targets]
        batch = text.batch(step)
        input_ids = batch.input_ids.to(device)
        groups = ratios + 1 if anchors else ratios
        row_ratio = torch.arange(len(input_ids)) % groups - (1 if anchors else 0)  # -1: an anchor row
        for gates in row_gates:
            gates.row_ratio = row_ratio
        with torch.no_grad(), autocast(device), \
                (teacher_handle.mode("probe") if supervised else handle.mode("off")):
            taught = teacher(input_ids=input_ids, use_cache=False, output_hidden_states=teacher_hidden)
            teacher_logits = taught.logits
            far = teacher_handle.far_attentions() if supervised else []
            long_lived = long_lived_tokens(roles, tokenizer, batch, taught.hidden_states) if supervised and roles else None
        handle.set_mode("train")
        with autocast(device):
            student_logits = model(input_ids=input_ids, use_cache=False).logits
        mask = batch.loss_mask.to(device)
        teacher_logp = torch.log_softmax(teacher_logits[mask].float(), dim=-1)
        student_logp = torch.log_softmax(student_logits[mask].float(), dim=-1)
        kl = (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1).mean()
        alphas = [a.cpu() for a in handle.alphas()]
        if config.freeze_gates:
            decisions = [shifted_decisions(module.dms.logits.detach().float()).cpu() for module in handle.modules]
            track_offsets(per_ratio, decisions, row_ratio, batch.lengths, dms.window, fraction_targets)
        shown = {}
        batch_targets = fraction_targets
        if supervised:
            # The labels already set each ratio's eviction for this batch (more for long chains, less for short
            # ones): the compression term holds the batch to them rather than to the pooled fraction.
            labelled = [[0.0, 0.0] for _ in config.ratios]
            decisions = [shifted_decisions(module.dms.logits.float()) for module in handle.modules]
            bce, shown["labels"] = gate_label_loss(config, batch, long_lived, far, decisions, row_ratio, label_fractions, roles,
                                                     labelled)
            batch_targets = [evicted / eligible if eligible else target for (evicted, eligible), target in zip(labelled, fraction_targets)]
        compression = torch.zeros(())
        for index, (final, fraction_target) in enumerate(zip(config.ratios, batch_targets)):
            rows = row_ratio == index
            if not bool(rows.any()):
                continue
            fraction, ratio = evicted_fraction([a[rows] for a in alphas], batch.lengths[rows], dms.window)
            shortfall = fraction_target - fraction
            compression = compression + (shortfall.abs() if config.compression_loss == "two_sided" else torch.relu(shortfall))
            shown[f"{final:g}x"] = f"{fraction.item():.2f}/{fraction_target:.2f}"
        loss = kl + config.compression_weight * compression
        if supervised:
            loss = loss + config.gate_supervision * bce
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        for group, base_lr in zip(optimizer.param_groups, base_lrs):
            group["lr"] = base_lr * lr_scale(step, config)
        optimizer.step()
        handle.set_mode("infer")
        bar.set_postfix(kl=f"{kl.item():.4f}", **({"k": batch.k} if batch.k is not None else {}), **shown,
                        s_per_step=f"{(time.perf_counter() - began) / (step - start + 1):.1f}")
        if (step + 1) % config.checkpoint_every == 0 or step + 1 == end:
            state = {"gates": row_gates.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1,
                     "offsets": [gates[0].config.init_offset for gates in per_ratio], "fractions": warm_fractions,
                     "roles": roles.state() if roles is not None else None}
            if config.full_finetune:
                state["model"] = model.state_dict()
            torch.save(state, state_path)
    written: list[Path] = []
    if end == config.total_steps:
        if config.full_finetune:
            export_weights(model, tokenizer, out_dir)
        # A resumed run with no steps left (finishing a stopped one) exports what its state held.
        held = fraction_targets if end > start else (warm_fractions or label_fractions)
        for index, (final, fraction_target, gates) in enumerate(zip(config.ratios, held, per_ratio)):
            role_labels = {} if roles is None else {"label_threshold": round(roles.thresholds[index], 4),
                                                    "long_lived_pairs": roles.kept_pairs(index)}
            written.append(save_adapter(
                adapter_path(out_dir, final), gates, gates[0].config, model, final,
                extra={"train_steps": config.total_steps, "eviction_target": round(fraction_target, 4),
                       "train_kl": round(kl.item(), 5) if end > start else None, "full_finetune": config.full_finetune,
                       "base_model": config.model, "ratios_trained_together": config.ratios, **role_labels,
                       **({"continued_from": config.continue_from} if config.continue_from else {}),
                       **({"lr_decay_steps": config.lr_decay_steps} if config.lr_decay_steps else {})},
            ))
    handle.detach()
    if teacher_handle is not None and teacher_handle is not handle:
        teacher_handle.detach()
    if written and config.layout == "nvidia":
        for final, gates in zip(config.ratios, per_ratio):
            export_nvidia(model, tokenizer, gates, final, config, out_dir / f"nvidia-{final:g}x")
    return written


def export_nvidia(model: nn.Module, tokenizer, gates: nn.ModuleList, ratio: float, config: RetrofitConfig,
                  out_dir: Path) -> Path:
    """One ratio's gates with the model in NVIDIA's DMS layout (``dms_cr`` the ratio, ``dms_window_size`` the
    window), with the tokenizer and the base model's generation and task settings, ready to serve or to hand to
    NVIDIA's code."""
    settings = dataclasses.replace(gates[0].dms, cr=float(ratio), window_size=config.window,
                                   block_size=config.block_size)
    export_nvidia_layout(model, out_dir, settings, gates, tokenizer)
    for name in ("generation_config.json", "thinkpool.json"):
        if (Path(config.model) / name).is_file():
            shutil.copyfile(Path(config.model) / name, out_dir / name)
    return out_dir


def continue_from_export(model: nn.Module, per_ratio: list[nn.ModuleList], config: RetrofitConfig
                         ) -> tuple[int, list[float], list[float]]:
    """Load the export of a finished run (``config.continue_from``) into the student: its weights (with full
    fine-tuning) and each ratio's gates and calibrated offset. Returns the step it ended at and, per ratio, the
    eviction fraction it held and its label threshold. Refuses an export trained with other settings."""
    source = Path(config.continue_from or "")
    if config.full_finetune:
        if not (source / "config.json").is_file():
            raise ValueError(f"continue_from: no fine-tuned model at {source}")
        trained, _ = load_model(source, device=str(next(model.parameters()).device))
        model.load_state_dict(trained.state_dict())
    steps, fractions, thresholds = set(), [], []
    for final, gates in zip(config.ratios, per_ratio):
        path = adapter_path(source, final)
        metadata = read_adapter_metadata(path)
        if [float(r) for r in metadata.get("ratios_trained_together", [])] != [float(r) for r in config.ratios]:
            raise ValueError(f"continue_from: {path} was trained with ratios {metadata.get('ratios_trained_together')}, "
                             f"this run trains {config.ratios}")
        loaded, settings = load_gates(model, path)  # refuses gates made for other weights
        for field in ("parametrization", "per_head", "window", "logit_scale"):
            if getattr(settings, field) != getattr(config.dms, field):
                raise ValueError(f"continue_from: {path} has {field}={getattr(settings, field)}, "
                                 f"this run {getattr(config.dms, field)}")
        gates.load_state_dict(loaded.state_dict())
        set_offsets([gates], [settings.init_offset])
        steps.add(int(metadata["train_steps"]))
        fractions.append(float(metadata["eviction_target"]))
        thresholds.append(float(metadata.get("label_threshold", 0.0)))
    if len(steps) != 1:
        raise ValueError(f"continue_from: {source}'s adapters were trained for different step counts ({sorted(steps)}); "
                         "they must come from one run")
    (start,) = steps
    if start >= config.total_steps:
        raise ValueError(f"continue_from: {source} already has {start} steps; total_steps is {config.total_steps}")
    return start, fractions, thresholds


def export_weights(model: nn.Module, tokenizer, out_dir: Path) -> None:
    """Save the fine-tuned weights (float16, as the base model ships) and round the live model to what was
    saved, so that the adapters' base fingerprint is the fingerprint of the weights that load."""
    export(model, tokenizer, out_dir)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.data = parameter.data.to(torch.float16).to(parameter.dtype)
