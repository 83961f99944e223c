"""Admission control: which waiting threads may start, and which running ones give way when memory runs short.

A thread is admitted only when the pool can hold what every admitted thread can grow to: its prompt plus its
token limit, for every layer and KV head, at its ratio's KV growth (:mod:`workers.kv_budget`: the window, then
the fractions of prompt and generated tokens the ratio keeps; measured per adapter, else ``1/cr``). Fresh
threads of the same problem and ratio that are admitted together share one prefill of their prompt, and its
slots (reference-counted in the pool): such a group reserves the prompt once. Admission is first come, first
served; a preempted thread goes back to the front of the queue (and, replaying its own tokens, shares nothing
when it resumes). When a step would need more slots than are free (threads keeping more than their ratio's
growth), the most recently admitted threads are preempted until it fits.
"""

from __future__ import annotations

from collections import deque

from workers.kv_budget import KVBudgetModel, group_tokens_per_head
from workers.thread import Status, Thread


class Scheduler:
    def __init__(self, capacity_slots: int, slots_per_token: int, budget_model: KVBudgetModel, max_running: int):
        self.capacity = capacity_slots
        self.slots_per_token = slots_per_token  # layers x KV heads
        self.budget_model = budget_model
        self.max_running = max_running
        self.waiting: deque[Thread] = deque()
        self.running: list[Thread] = []  # admitted threads (the engine keeps their batch-row order)
        self._admissions = 0  # numbers each admitted group (a resumed thread is a group of its own)

    def reservation(self, thread: Thread) -> int:
        """Slots ``thread`` may grow to on its own."""
        return self.group_reservation([thread])

    def group_reservation(self, threads: list[Thread]) -> int:
        """Slots threads that share one prefill (one problem, one ratio) may grow to together: the prompt once,
        and each thread's own tokens."""
        if not threads:
            return 0
        first = threads[0]
        model = self.budget_model
        tokens = group_tokens_per_head(len(first.prompt_ids), [t.params.max_new_tokens for t in threads],
                                       model.window(first.cr), model.growth(first.cr))
        return self.slots_per_token * tokens

    def reserved(self) -> int:
        groups: dict[int, list[Thread]] = {}
        for thread in self.running:
            groups.setdefault(thread.prefill_group, []).append(thread)
        return sum(self.group_reservation(group) for group in groups.values())

    def add(self, threads: list[Thread]) -> None:
        self.waiting.extend(threads)

    def next_admission(self) -> list[Thread]:
        """The next threads to start, all sharing one prefill (empty when the head of the queue must wait)."""
        room = self.capacity - self.reserved()
        slots_left = self.max_running - len(self.running)
        group: list[Thread] = []
        held = 0  # the group's reservation so far
        for thread in self.waiting:
            if group and (thread.tokens or group[0].tokens or (thread.problem_id, thread.cr) != (group[0].problem_id, group[0].cr)):
                break
            grown = self.group_reservation(group + [thread])
            if slots_left <= 0 or grown - held > room:
                break
            group.append(thread)
            room -= grown - held
            held = grown
            slots_left -= 1
            if thread.tokens:  # a resumed thread replays its own tokens: no sharing
                break
        if group:
            self._admissions += 1
        for thread in group:
            self.waiting.popleft()
            thread.status = Status.RUNNING
            thread.prefill_group = self._admissions
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

    def drop_problem(self, problem_id: str) -> tuple[list[Thread], list[Thread]]:
        """Remove a problem's threads: returns (were waiting, were running)."""
        waiting = [t for t in self.waiting if t.problem_id == problem_id]
        running = [t for t in self.running if t.problem_id == problem_id]
        self.waiting = deque(t for t in self.waiting if t.problem_id != problem_id)
        for thread in running:
            self.running.remove(thread)
        for thread in waiting + running:
            thread.status = Status.FINISHED
            thread.finish_reason = "cancelled"
        return waiting, running
