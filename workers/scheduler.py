"""Admission control: which waiting threads may start, and which running ones give way when memory runs short.

A thread is admitted only when the pool can hold what every admitted thread can grow to (:mod:`workers.kv_budget`:
the window, then the fractions of prompt and generated tokens its ratio keeps; measured per adapter, else
``1/cr``). The threads of one task share one prefill of its prompt at each ratio, held by the engine for the
task's life (:class:`~workers.engine.HeldPrompt`): the prompt is reserved once, when it is first admitted, and
stays reserved until the task closes; each thread reserves its own tokens. Admission is first come, first
served; a preempted thread goes back to the front of the queue and resumes from its task's held prompt. When a
step would need more slots than are free (threads keeping more than their ratio's growth), the most recently
admitted threads are preempted until it fits.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from workers.kv_budget import KVBudgetModel, own_tokens_per_head, prompt_tokens_per_head
from workers.thread import Status, Thread

PromptKey = tuple[str, float]  # (task id, ratio): one held prompt


class Scheduler:
    def __init__(self, capacity_slots: int, slots_per_token: int, budget_model: KVBudgetModel, max_running: int):
        self.capacity = capacity_slots
        self.slots_per_token = slots_per_token  # layers x KV heads
        self.budget_model = budget_model
        self.max_running = max_running
        self.waiting: deque[Thread] = deque()
        self.running: list[Thread] = []  # admitted threads (the engine keeps their batch-row order)
        self.held: dict[PromptKey, int] = {}  # the held prompts and the slots each reserves

    def prompt_reservation(self, prompt_tokens: int, cr: float) -> int:
        """Slots a held prompt of ``prompt_tokens`` tokens reserves at ``cr``."""
        model = self.budget_model
        return self.slots_per_token * prompt_tokens_per_head(prompt_tokens, model.window(cr), model.growth(cr))

    def own_reservation(self, thread: Thread) -> int:
        """Slots ``thread``'s own tokens may grow to."""
        model = self.budget_model
        return self.slots_per_token * own_tokens_per_head(thread.params.max_new_tokens, model.window(thread.cr),
                                                          model.growth(thread.cr))

    def reservation(self, thread: Thread) -> int:
        """Slots ``thread`` may grow to on its own, its prompt included."""
        return self.prompt_reservation(len(thread.prompt_ids), thread.cr) + self.own_reservation(thread)

    def reserved(self) -> int:
        return sum(self.held.values()) + sum(self.own_reservation(t) for t in self.running)

    def hold(self, key: PromptKey, prompt_tokens: int) -> None:
        """A task's prompt at ratio ``key[1]`` is now held by the engine."""
        self.held[key] = self.prompt_reservation(prompt_tokens, key[1])

    def release(self, task_id: str) -> None:
        """The task's held prompts are gone."""
        for key in [k for k in self.held if k[0] == task_id]:
            del self.held[key]

    def add(self, threads: list[Thread]) -> None:
        self.waiting.extend(threads)

    def next_admission(self) -> list[Thread]:
        """The next threads to start, all of one task and ratio (empty when the head of the queue must wait).

        A resumed thread starts alone; fresh threads of one task and ratio start together, sharing the prefill
        of their prompt (or its held copy)."""
        room = self.capacity - self.reserved()
        slots_left = self.max_running - len(self.running)
        group: list[Thread] = []
        for thread in self.waiting:
            key = (thread.task_id, thread.cr)
            if group and (thread.tokens or group[0].tokens or key != (group[0].task_id, group[0].cr)):
                break
            cost = self.own_reservation(thread)
            if not group and key not in self.held:
                cost += self.prompt_reservation(len(thread.prompt_ids), thread.cr)
            if slots_left <= 0 or cost > room:
                break
            group.append(thread)
            room -= cost
            slots_left -= 1
            if thread.tokens:  # a resumed thread replays its own tokens
                break
        for thread in group:
            self.waiting.popleft()
            thread.status = Status.RUNNING
        self.running.extend(group)
        return group

    def unadmit(self, group: list[Thread]) -> None:
        """Put threads admitted this step back at the front of the queue, in their order."""
        for thread in reversed(group):
            self.running.remove(thread)
            thread.status = Status.WAITING
            self.waiting.appendleft(thread)

    def pick_victim(self) -> Thread | None:
        """The running thread to preempt next: the most recently admitted; never the last one running."""
        if len(self.running) < 2:
            return None
        return max(self.running, key=lambda t: t.seq)

    def preempt(self, thread: Thread) -> None:
        self.running.remove(thread)
        thread.status = Status.WAITING
        thread.preemptions += 1
        self.waiting.appendleft(thread)

    def finish(self, threads: list[Thread]) -> None:
        for thread in threads:
            self.running.remove(thread)
            thread.status = Status.FINISHED

    def drop(self, match: Callable[[Thread], bool]) -> tuple[list[Thread], list[Thread]]:
        """Remove the threads ``match`` picks (a request's, a task's): returns (were waiting, were running)."""
        waiting = [t for t in self.waiting if match(t)]
        running = [t for t in self.running if match(t)]
        self.waiting = deque(t for t in self.waiting if not match(t))
        for thread in running:
            self.running.remove(thread)
        for thread in waiting + running:
            thread.status = Status.FINISHED
            thread.finish_reason = "cancelled"
        return waiting, running
