"""DESIGN's KV budget model: what threads may grow to, the unit of admission control, ``--samples fit`` and the
controller's plans.

Per head, a thread holds the tokens inside its window, then the fractions its ratio keeps of the rest: of the
prompt, which the threads of one task share (its slots exist once, held for the task's life), and of its own
generated tokens. The
fractions are the adapter's measured KV growth (:mod:`dms_runtime.kv_growth`), else ``1/cr``. Multiply by
``kv_bytes_per_token`` (all layers and KV heads) for bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dms_runtime.kv_growth import KVGrowth


def prompt_tokens_per_head(prompt: int, window: int, growth: KVGrowth) -> int:
    """Prompt tokens per head a task's held prompt keeps: the last ``window + 1`` (the decision on them is not
    final while the prompt's own row is where it stopped), and the fraction its ratio keeps of the rest. Every
    thread of the task reads its prompt from these slots and only ever drops some, so they are counted once."""
    inside = min(prompt, window + 1)
    return inside + math.ceil(growth.prompt * (prompt - inside))


def own_tokens_per_head(limit: int, window: int, growth: KVGrowth) -> int:
    """Tokens per head one thread's own ``limit`` generated tokens may hold: the window, then what its ratio keeps
    of the rest (at that length: the first tokens are kept more)."""
    inside = min(limit, window + 1)
    return inside + math.ceil(growth.kept_generated(limit - inside))


def group_tokens_per_head(prompt: int, limits: list[int], window: int, growth: KVGrowth) -> int:
    """Tokens per head that threads sharing one prefill of a ``prompt``-token prompt may grow to together, thread
    i generating up to ``limits[i]`` tokens (DESIGN's budget model, at ``growth``)."""
    if not limits:
        return 0
    return prompt_tokens_per_head(prompt, window, growth) + sum(own_tokens_per_head(l, window, growth) for l in limits)


def threads_that_fit(capacity_tokens: int, prompt: int, limit: int, window: int, growth: KVGrowth) -> int:
    """How many threads sharing one prefill fit at once in ``capacity_tokens`` tokens per head (KV bytes over
    ``kv_bytes_per_token``): the prompt once, then each thread's own tokens."""
    room = capacity_tokens - prompt_tokens_per_head(prompt, window, growth)
    return max(0, room // own_tokens_per_head(limit, window, growth))


@dataclass(frozen=True)
class KVBudgetModel:
    """One worker's budget model: its KV geometry and each ratio's window and growth. Workers report it in their
    ``info``, so that whoever plans threads counts memory as the engine's admission does."""

    kv_bytes_per_token: int
    windows: dict[float, int] = field(default_factory=dict)
    growths: dict[float, KVGrowth] = field(default_factory=dict)

    @classmethod
    def nominal(cls, kv_bytes_per_token: int, ratios: list[float], window: int) -> "KVBudgetModel":
        """DESIGN's ``1/cr`` model with one window for every ratio (for planning without a worker at hand)."""
        return cls(kv_bytes_per_token, {cr: window for cr in ratios if cr > 1})

    def window(self, cr: float) -> int:
        return 0 if cr <= 1 else self.windows[cr]

    def growth(self, cr: float) -> KVGrowth:
        """The growth admission reserves at: the measured one, else DESIGN's ``1/cr``."""
        return self.growths.get(cr) or KVGrowth.nominal(cr)

    def group_bytes(self, cr: float, prompt: int, limit: int, threads: int = 1) -> int:
        """KV bytes ``threads`` threads sharing one prefill may grow to."""
        return self.kv_bytes_per_token * group_tokens_per_head(prompt, [limit] * threads, self.window(cr), self.growth(cr))

    def prompt_bytes(self, cr: float, prompt: int) -> int:
        """KV bytes a task's held prompt reserves at ``cr`` (once, for the task's life)."""
        return self.kv_bytes_per_token * prompt_tokens_per_head(prompt, self.window(cr), self.growth(cr))

    def thread_bytes(self, cr: float, limit: int, threads: int = 1) -> int:
        """KV bytes ``threads`` threads' own tokens may grow to, their shared prompt aside."""
        return self.kv_bytes_per_token * threads * own_tokens_per_head(limit, self.window(cr), self.growth(cr))

    def threads_that_fit(self, budget_bytes: int, cr: float, prompt: int, limit: int) -> int:
        return threads_that_fit(budget_bytes // self.kv_bytes_per_token, prompt, limit, self.window(cr), self.growth(cr))

    def as_dict(self) -> dict:
        return {"kv_bytes_per_token": self.kv_bytes_per_token, "windows": dict(self.windows),
                "growth": {cr: self.growth(cr).as_dict() for cr in self.windows}}

    @classmethod
    def from_dict(cls, data: dict) -> "KVBudgetModel":
        return cls(int(data["kv_bytes_per_token"]), {float(cr): int(w) for cr, w in data["windows"].items()},
                   {float(cr): KVGrowth.from_dict(g) for cr, g in data["growth"].items()})
