"""Budget planning: which (compression ratio, threads, temperature, token limit) to give a task, from a calibration profile.

A profile (measured by ``thinkpool calibrate``, stored as JSON beside the model: ``calibration-<task>.json``) is
measured on one (model, task family) and holds, per difficulty bin and ratio, the vote accuracy of n sampled threads (n = 1, 2, 4, ...) at each calibrated temperature, the
accuracy of one greedy thread (``greedy`` entries), and the mean tokens per thread. The planner picks, among
the configurations whose KV reservation fits the task's budget, the most accurate one; among those within
``tolerance`` of it, the one with the fewest threads (so the fewest tokens), then the lowest ratio, then
greedy, then the profile's first temperature, then the most accurate. "Within" widens with the profile's
noise: a profile measured on 16 problems per bin cannot tell 0.94 from 1.00, and the planner must not trade
one greedy thread for sixteen sampled ones on such a difference. A greedy thread often beats a vote of a few
sampled ones (sampling trades each thread's accuracy for diversity), so "one greedy thread" is a plan like
any other. Expected accuracy per added thread also ranks tasks competing for the same workers.

Difficulty is a *signal* the profile names and bins on. ``k``: a difficulty the task family reads off the prompt
(the chain task's number of assignments). ``greedy_confidence``: what any task has, the lowest log-probability
among the tokens of a first greedy thread at ``signal_cr`` (a wrong chain of thought usually turns on one
near-tie); the controller runs that thread first and plans the rest from its bin. Its bins are quantiles of the
calibration problems' signal, so each holds about the same number of problems.

Temperature is planned with the thread count because the best one depends on it: hot threads are each less
accurate but err more differently, which only a large vote can use (on 140 hard chain problems, the 8x
model's threads were right 43.5% of the time at 1.0 and 50.6% at 0.8, yet 41 of them voted 72.9% where 39
at 0.8 voted 68.6%; vanilla's 4 voted best at 0.5-0.8).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, BaseModel, Field, PrivateAttr

Signal = Literal["k", "greedy_confidence"]
SIGNALS: tuple[str, ...] = ("k", "greedy_confidence")


class ProfileEntry(BaseModel):
    # The difficulty bin: low <= signal <= high (profiles written before signals existed name them k_min, k_max).
    low: float = Field(validation_alias=AliasChoices("low", "k_min"))
    high: float = Field(validation_alias=AliasChoices("high", "k_max"))
    cr: float
    threads: int = Field(ge=1)
    greedy: bool = False  # one greedy thread (then threads == 1), not a vote of sampled ones
    accuracy: float = Field(ge=0, le=1)
    tokens_per_thread: float = Field(gt=0)
    temperature: float | None = Field(None, gt=0)  # of the sampled threads (None: the profile's ``temperature``)


class CalibrationProfile(BaseModel):
    model: str
    task: str = "chain"  # the task family it was measured on
    signal: Signal = "k"  # what its bins are bins of (see the module docstring)
    signal_cr: float = 1.0  # greedy_confidence: the ratio of the greedy thread the signal is read from
    max_new_tokens: int
    temperature: float  # the first calibrated temperature, and that of entries that name none
    top_p: float = 1.0  # nucleus of the sampled threads (profiles measured before it was recorded: 1.0)
    problems: int | None = Field(None, ge=1)  # fresh problems per bin behind each entry (None: not recorded)
    window: int = 16
    entries: list[ProfileEntry]

    _path: Path | None = PrivateAttr(None)  # the file it was loaded from (reports name it)

    @classmethod
    def load(cls, path: str | Path) -> "CalibrationProfile":
        profile = cls.model_validate(json.loads(Path(path).read_text()))
        profile._path = Path(path)
        return profile

    @property
    def path(self) -> Path | None:
        return self._path

    def save(self, path: str | Path) -> Path:
        Path(path).write_text(self.model_dump_json(indent=1) + "\n")
        return Path(path)

    @classmethod
    def for_model(cls, model_dir: str | Path) -> dict[str, "CalibrationProfile"]:
        """The profiles kept beside a model (``calibration-<task>.json``), by task family."""
        found = {}
        for path in sorted(Path(model_dir).glob("calibration-*.json")):
            profile = cls.load(path)
            found[profile.task] = profile
        return found

    def bins(self) -> list[tuple[float, float]]:
        return sorted({(e.low, e.high) for e in self.entries})

    def bin_of(self, difficulty: float) -> tuple[float, float]:
        """The bin holding ``difficulty`` (past either end: the nearest bin)."""
        bins = self.bins()
        for low, high in bins:
            if low <= difficulty <= high:
                return low, high
        return bins[0] if difficulty < bins[0][0] else bins[-1]

    def entries_for(self, difficulty: float | None) -> list[ProfileEntry]:
        """The entries of ``difficulty``'s bin. ``None`` (a signal not read yet) is not a bin: a caller that has no
        difficulty plans the first greedy thread with :meth:`pooled_greedy_accuracy` instead."""
        if difficulty is None:
            raise ValueError(f"a {self.signal} profile needs the task's difficulty signal to plan")
        low, high = self.bin_of(difficulty)
        return [e for e in self.entries if (e.low, e.high) == (low, high)]

    def pooled_greedy_accuracy(self, cr: float) -> float:
        """One greedy thread's accuracy at ``cr`` over every bin (equal weights: quantile bins hold equal shares)."""
        known = [e.accuracy for e in self.entries if e.greedy and e.cr == cr]
        return sum(known) / len(known) if known else 0.0

    def temperature_of(self, entry: ProfileEntry) -> float:
        return self.temperature if entry.temperature is None else entry.temperature

    def temperatures(self) -> list[float]:
        """The temperatures the profile measured sampled votes at, the default first."""
        others = {self.temperature_of(e) for e in self.entries if not e.greedy} - {self.temperature}
        return [self.temperature, *sorted(others)]

    def nearest_temperature(self, temperature: float | None) -> float:
        """The measured temperature whose entries stand for threads sampled at ``temperature`` (None: the default)."""
        if temperature is None:
            return self.temperature
        return min(self.temperatures(), key=lambda t: (abs(t - temperature), t))

    def standard_error(self, accuracy: float) -> float:
        """How far an entry's accuracy may be off, measured on ``problems`` problems (0 when unrecorded). The
        rate is smoothed (one success and one failure added), so 16 of 16 is not taken for certainty."""
        if not self.problems:
            return 0.0
        rate = (accuracy * self.problems + 1) / (self.problems + 2)
        return math.sqrt(rate * (1 - rate) / self.problems)

    def accuracy(self, k: float | None, cr: float, threads: int, temperature: float | None = None) -> float:
        """Expected vote accuracy of ``threads`` threads at ``cr`` and ``temperature`` (default: the profile's),
        from the nearest measured count at or below."""
        temperature = self.nearest_temperature(temperature)
        known = [e for e in self.entries_for(k) if e.cr == cr and e.threads <= threads and not e.greedy
                 and self.temperature_of(e) == temperature]
        return max(known, key=lambda e: e.threads).accuracy if known else 0.0

    def greedy_accuracy(self, k: float | None, cr: float) -> float | None:
        """Expected accuracy of one greedy thread at ``cr`` (None when the profile did not measure it)."""
        known = [e.accuracy for e in self.entries_for(k) if e.cr == cr and e.greedy]
        return known[0] if known else None

    def accuracy_with_greedy(self, k: float | None, cr: float, threads: int, temperature: float | None = None) -> float:
        """Expected accuracy of a greedy thread followed by ``threads - 1`` sampled ones (the controller's
        rounds): the better of the greedy thread alone and the sampled vote."""
        greedy = self.greedy_accuracy(k, cr)
        sampled = self.accuracy(k, cr, threads - 1, temperature) if threads > 1 else 0.0
        return max(greedy if greedy is not None else self.accuracy(k, cr, 1, temperature), sampled)


@dataclass(frozen=True)
class Plan:
    cr: float
    threads: int
    greedy: bool
    temperature: float  # of the sampled threads (a greedy plan: the profile's, for any threads added later)
    max_new_tokens: int
    expected_accuracy: float
    expected_tokens: float


def plan(profile: CalibrationProfile, k: float, kv_budget_bytes: int, group_bytes, ratios: list[float],
         max_threads: int = 64, tolerance: float = 0.01, temperature: float | None = None) -> Plan:
    """The configuration to run a task of difficulty ``k`` (the profile's signal) with; ``group_bytes(cr, n)`` is what n threads reserve.
    A ``temperature`` fixed by the caller plans on the votes measured nearest it; otherwise the plan picks one.

    Raises ``ValueError`` when not even one thread fits the budget."""
    fixed = None if temperature is None else profile.nearest_temperature(temperature)
    options = []
    for entry in profile.entries_for(k):
        if entry.cr not in ratios or entry.threads > max_threads:
            continue
        if fixed is not None and not entry.greedy and profile.temperature_of(entry) != fixed:
            continue
        if group_bytes(entry.cr, entry.threads) > kv_budget_bytes:
            continue
        options.append(entry)
    if not options:
        cheapest = min(group_bytes(cr, 1) for cr in ratios)
        raise ValueError(f"kv_budget: {kv_budget_bytes} bytes cannot hold one thread (the smallest needs {cheapest} bytes)")
    best = max(options, key=lambda e: e.accuracy)

    def as_good(entry: ProfileEntry) -> bool:  # indistinguishable from the best, given the profile's noise
        noise = math.hypot(profile.standard_error(best.accuracy), profile.standard_error(entry.accuracy))
        return entry.accuracy >= best.accuracy - max(tolerance, noise)

    # Fewest threads first (a thread costs about the same tokens at any ratio), then the lowest ratio: among
    # options the profile cannot tell apart, compression only adds risk once the threads fit; then a greedy
    # thread over one sampled thread; then the profile's default temperature over another.
    chosen = min(filter(as_good, options), key=lambda e: (e.threads, e.cr, not e.greedy,
                                                          profile.temperature_of(e) != profile.temperature, -e.accuracy))
    if temperature is None:
        temperature = profile.temperature if chosen.greedy else profile.temperature_of(chosen)
    return Plan(chosen.cr, chosen.threads, chosen.greedy, temperature, profile.max_new_tokens, chosen.accuracy,
                chosen.threads * chosen.tokens_per_thread)
