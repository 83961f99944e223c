"""What defines a set of DMS eviction gates: parametrization, granularity, window, logit scale."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

# nvidia_separate: NVIDIA's separate gates (``dms_runtime.nvidia_gates.SeparateGate``), which read the layer's input
# before its input norm; the one kind a retrofit can export in NVIDIA's layout.
Parametrization = Literal["adapter", "query_neuron", "nvidia_separate"]
PARAMETRIZATIONS = ("adapter", "query_neuron", "nvidia_separate")
# A batch row's gate index when it runs without gates (cr 1), and the logit such a row's gates give: never evict.
NO_GATE = -1
NEVER = -1e9


@dataclass(frozen=True)
class DMSConfig:
    """DMS gate settings; saved with every adapter so inference uses exactly what training used.

    ``window`` is w: a token marked for eviction stays visible to queries at most w positions later.
    The shipped model's default of 16 covers most within-line reads of its chain of thought (a line is
    37-52 tokens, and most facts read digits written a few tokens before), so mostly the registers
    and the operand copies that are read further on must be kept.
    """

    parametrization: Parametrization = "adapter"
    per_head: bool = True
    window: int = 16
    logit_scale: float = 100.0
    init_offset: float = -5.0
    threshold: float = 0.0  # evict where logit > threshold; raise it to evict less

    def __post_init__(self) -> None:
        if self.parametrization not in PARAMETRIZATIONS:
            raise ValueError(f"parametrization must be one of {', '.join(PARAMETRIZATIONS)}, "
                             f"got {self.parametrization!r}")
        if self.window < 0:
            raise ValueError(f"window must be >= 0, got {self.window}")

    def as_dict(self) -> dict:
        return asdict(self)
