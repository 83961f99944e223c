"""The controller: a LangGraph ``StateGraph`` that chooses, per task, the compression ratio, thread count and temperature.

    assess -> plan -> dispatch -> run_chunk (one per 4 threads, in parallel) -> aggregate -> decide
                          ^                                                                 |
                          +---------------------- escalate (more threads, a higher ratio) --+--> END

* ``assess`` reads the task's difficulty where the profile's signal is one the task family knows up front (the
  chain task's k); a ``greedy_confidence`` profile learns it from the task's first greedy thread instead;
* ``plan`` asks the planner for (ratio, threads, temperature, token limit) within the task's KV budget; the
  temperature holds for all the task's sampled threads (the profile measures votes at one temperature). With
  the difficulty still unknown, the plan is that first greedy thread at the profile's ``signal_cr``; after it,
  ``decide`` reads its confidence, finds its bin and plans the rest (a ``replan`` event);
* ``dispatch`` opens a round: the first is one greedy thread (``greedy_first``: the model's single most
  likely answer, usually more accurate than any one sampled thread), the next ``first_round`` sampled
  threads; later rounds double;
* ``run_chunk`` runs a few threads on the workers; each chunk is its own LangGraph task, so its results are
  saved as pending writes the moment it finishes: a controller killed mid-round and restarted from its
  checkpoint reruns only the chunks that had not finished. Every chunk of a task, in every round, is a request
  of one worker task (``task_id``): the prompt, tokenized once by the caller, is prefilled once per ratio and
  held on one worker until the task ends;
* ``aggregate`` votes over every thread so far (majority, or confidence-weighted);
* ``decide`` stops after the greedy thread when the plan is that thread alone (the profile expects no
  sampled vote to beat it) or when it is confident (no token it chose had log-probability below
  ``confident_logprob``: a wrong chain of thought usually turns on one near-tie); later, when the leading
  answer is settled (:mod:`policies.stopping`), when the planned threads have run and agree, or when the
  thread budget is spent; otherwise it escalates: more threads at the planned ratio, then (if the
  threads still disagree) the first higher ratio whose threads the profile expects to vote better than
  more threads at the current one (it fits more threads in the same memory), else more threads at the
  current ratio; but past the plan, only while the profile expects the next round to add ``min_gain``.

Thread seeds are (task seed, sample index), with sample indices running on across rounds, so a rerun
chunk is the same threads.

Many tasks at once: give every controller the same allocators (one
:class:`~orchestrator.allocator.ThreadAllocator` per worker, its capacity that worker's pool). A task holds
its prompt's bytes on its worker's allocator for its life, and each round's chunks wait there for their
threads' bytes, ranked by the accuracy the round is expected to add per byte it reserves, so the workers'
memory goes to the tasks where threads buy the most.

Plan, rounds, escalations and each finished thread are told to ``on_event`` as they happen (live progress).
"""

from __future__ import annotations

import operator
import os
from dataclasses import asdict, dataclass
from typing import Annotated, Any, Callable, TypedDict

from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send

from orchestrator.allocator import ThreadAllocator
from policies.planner import CalibrationProfile, plan
from policies.stopping import settled
from policies.voting import vote_by
from tasks.families import get_family
from workers.kv_budget import KVBudgetModel
from workers.thread import SamplingParams
from workers.worker import ProblemRequest

CHUNK = 4  # threads per run_chunk task: the unit of work that survives a controller crash


@dataclass(frozen=True)
class Budget:
    """A task's limits: KV memory its threads may hold at once, and threads in total."""

    kv_budget_bytes: int
    max_threads: int = 64


EventListener = Callable[[str, dict], None]  # (event name, data)
TokenListener = Callable[[Any], None]  # hears a task's TokenProgress batches and ThreadResults as they come


class SolveState(TypedDict, total=False):
    task_id: str
    prompt: str
    prompt_ids: list[int]
    task_family: str  # how threads stop, what their answers are, which answers are equal (tasks/families.py)
    answer_pattern: str | None
    stop_strings: list[str]
    k: float | None  # the difficulty on the profile's signal (None until a greedy_confidence task's first thread)
    prompt_tokens: int
    seed: int
    kv_budget_bytes: int
    max_threads: int
    cr: float
    target_threads: int
    max_new_tokens: int
    temperature: float  # of the task's sampled threads
    round_size: int
    next_sample: int
    round_samples: list[int]
    plan_greedy: bool
    round_priority: float
    threads: Annotated[list[dict], operator.add]
    rounds: Annotated[list[dict], operator.add]
    answer: str | None
    votes: dict[str, int]
    stop_reason: str


class ChunkState(TypedDict):
    task_id: str
    prompt_ids: list[int]
    task_family: str
    answer_pattern: str | None
    stop_strings: list[str]
    seed: int
    cr: float
    max_new_tokens: int
    samples: list[int]
    temperature: float
    kv_bytes: int  # what these threads' own tokens may grow to (the allocator's unit; the prompt is held apart)
    prompt_bytes: int  # what the task's held prompt at this ratio reserves
    priority: float  # expected accuracy gained per KV byte by the round this chunk belongs to


class Controller:
    def __init__(self, pool, profile: CalibrationProfile, kv_bytes_per_token: int, ratios: list[float],
                 temperature: float | None = None, first_round: int = 4, threshold: float = 0.95, weighting: str = "majority",
                 greedy_first: bool = True, confident_logprob: float = -0.5, min_gain: float = 0.02,
                 checkpointer=None, allocators: list[ThreadAllocator] | None = None,
                 budget_model: KVBudgetModel | None = None):
        self.pool, self.profile = pool, profile
        self.ratios = sorted(ratios)
        # The workers' model (their info's ``budget_model``) counts memory as their admission does; without it,
        # DESIGN's 1/cr at the profile's window.
        self.budget_model = budget_model or KVBudgetModel.nominal(kv_bytes_per_token, self.ratios, profile.window)
        # Sampled threads run at the profile's nucleus and (unless told otherwise) the temperature the plan picks
        # among those the profile measured: its accuracies hold only there.
        self.temperature = temperature
        self.top_p = profile.top_p
        self.first_round, self.threshold, self.weighting = first_round, threshold, weighting
        # -0.5: on 60 fresh k=1..20 problems (seed 7001, the shipped DMS model at CR 1), the greedy threads whose
        # every token had log-probability >= -0.5 (28 of 60) were 96% right; the other 32, 75%.
        self.greedy_first, self.confident_logprob = greedy_first, confident_logprob
        self.min_gain = min_gain  # escalating past the plan must be expected to add this much accuracy
        self.allocators = allocators  # one per worker, shared by the controllers of tasks that run at once (None: no ranking)
        self._listeners: dict[str, EventListener] = {}  # task id -> who hears its events
        self._running: set[str] = set()  # tasks this controller is running now
        self._token_listeners: dict[str, TokenListener] = {}  # task id -> who hears its threads' tokens
        self._cancelled: set[str] = set()  # tasks told to stop: their next decision ends them
        # task id -> (its worker's allocator, ratio -> bytes its held prompt holds there)
        self._prompt_grants: dict[str, tuple[ThreadAllocator, dict[float, int]]] = {}
        self.graph = self._build().compile(checkpointer=checkpointer if checkpointer is not None else make_checkpointer())

    # -- the budget model ---------------------------------------------------------------------------
    def kv_bytes(self, state: SolveState, cr: float, threads: int, max_new_tokens: int | None = None) -> int:
        """KV bytes ``threads`` threads of this task (one prefill) may grow to at ``cr``: what the engine reserves."""
        limit = state["max_new_tokens"] if max_new_tokens is None else max_new_tokens
        return self.budget_model.group_bytes(cr, state["prompt_tokens"], limit, threads)

    def fits(self, state: SolveState, cr: float) -> int:
        """Threads of this task that fit in its KV budget at once at ratio ``cr``."""
        return self.budget_model.threads_that_fit(state["kv_budget_bytes"], cr, state["prompt_tokens"], state["max_new_tokens"])

    # -- nodes ---------------------------------------------------------------------------------------
    def _emit(self, task_id: str, name: str, data: dict) -> None:
        listener = self._listeners.get(task_id)
        if listener is not None:
            listener(name, data)

    @property
    def reads_signal(self) -> bool:
        """Whether tasks learn their difficulty from their first greedy thread (else the family tells it)."""
        return self.profile.signal == "greedy_confidence"

    def assess(self, state: SolveState) -> dict:
        if self.reads_signal:
            return {"k": None, "prompt_tokens": len(state["prompt_ids"])}
        k = state.get("k")
        if k is None:  # the caller gave none: the family reads it off the prompt (the chain task's k)
            k = get_family(state.get("task_family", "chain"), answer_pattern=state.get("answer_pattern")).difficulty(
                state["prompt"])
        if k is None:
            raise ValueError(f"a {self.profile.signal} profile plans only tasks whose family reads it off the prompt")
        return {"k": k, "prompt_tokens": len(state["prompt_ids"])}

    def plan(self, state: SolveState) -> dict:
        if state.get("k") is None:  # greedy_confidence: one greedy thread first; its confidence is the difficulty
            cr = self.profile.signal_cr if self.profile.signal_cr in self.ratios else self.ratios[0]
            event = {"event": "plan", "cr": cr, "threads": 1, "greedy": True, "provisional": True,
                     "temperature": self.sampling_temperature(state),
                     "expected_accuracy": round(self.profile.pooled_greedy_accuracy(cr), 3)}
            self._emit(state["task_id"], "plan", event)
            return {"cr": cr, "target_threads": 1, "max_new_tokens": self.profile.max_new_tokens, "round_size": 1,
                    "next_sample": 0, "plan_greedy": False, "rounds": [event]}
        update = self._planned(state, state["k"])
        self._emit(state["task_id"], "plan", update["rounds"][0])
        return {**update, "round_size": 1 if self.greedy_first else min(self.first_round, update["target_threads"]),
                "next_sample": 0}

    def _planned(self, state: SolveState, k: float, event: str = "plan") -> dict:
        """The planner's choice for difficulty ``k`` as a state update (with its event, not yet emitted)."""
        chosen = plan(self.profile, k, state["kv_budget_bytes"],
                      lambda cr, n: self.kv_bytes(state, cr, n, self.profile.max_new_tokens), self.ratios,
                      max_threads=state["max_threads"], temperature=self.temperature)
        # With a greedy first thread, a plan of n sampled threads runs n + 1 threads in all.
        extra = int(self.greedy_first and not chosen.greedy)
        record = {"event": event, "cr": chosen.cr, "threads": chosen.threads, "greedy": chosen.greedy,
                  "temperature": chosen.temperature, "expected_accuracy": round(chosen.expected_accuracy, 3)}
        return {"cr": chosen.cr, "target_threads": chosen.threads + extra, "max_new_tokens": chosen.max_new_tokens,
                "temperature": chosen.temperature, "plan_greedy": chosen.greedy, "rounds": [record]}

    def expected_accuracy(self, state: SolveState, cr: float, threads: int) -> float:
        """What ``threads`` threads of this task are expected to score (the first greedy, if so run)."""
        if threads <= 0:
            return 0.0
        if state.get("k") is None:  # only the first greedy thread is planned before the difficulty is known
            return self.profile.pooled_greedy_accuracy(cr)
        if self.greedy_first:
            return self.profile.accuracy_with_greedy(state["k"], cr, threads, self.sampling_temperature(state))
        return self.profile.accuracy(state["k"], cr, threads, self.sampling_temperature(state))

    def sampling_temperature(self, state: SolveState) -> float:
        """The task's planned temperature (a task checkpointed before plans carried one: the profile's)."""
        return state.get("temperature", self.profile.temperature)

    def dispatch(self, state: SolveState) -> dict:
        size = min(state["round_size"], self.fits(state, state["cr"]), state["max_threads"] - len(state.get("threads", [])))
        samples = list(range(state["next_sample"], state["next_sample"] + max(1, size)))
        used = len(state.get("threads", []))
        gain = (self.expected_accuracy(state, state["cr"], used + len(samples))
                - self.expected_accuracy(state, state["cr"], used))
        cost = self.kv_bytes(state, state["cr"], len(samples))
        event = {"event": "round", "cr": state["cr"], "threads": len(samples), "greedy": self.greedy_round(samples)}
        self._emit(state["task_id"], "round", event)
        return {"round_samples": samples, "next_sample": samples[-1] + 1, "round_priority": gain / cost,
                "rounds": [event]}

    def greedy_round(self, samples: list[int]) -> bool:
        """Whether a round is the greedy first thread: sample 0, when the controller opens with one (always, when
        that thread's confidence is the task's difficulty)."""
        return (self.greedy_first or self.reads_signal) and samples[0] == 0

    def fan_out(self, state: SolveState) -> list[Send]:
        samples = state["round_samples"]
        cr, limit = state["cr"], state["max_new_tokens"]
        return [
            Send("run_chunk", ChunkState(task_id=state["task_id"], prompt_ids=state["prompt_ids"],
                                         task_family=state.get("task_family", "chain"),
                                         answer_pattern=state.get("answer_pattern"),
                                         stop_strings=list(state.get("stop_strings", [])), seed=state["seed"], cr=cr,
                                         max_new_tokens=limit, samples=samples[i : i + CHUNK],
                                         temperature=0.0 if self.greedy_round(samples) else self.sampling_temperature(state),
                                         kv_bytes=self.budget_model.thread_bytes(cr, limit, len(samples[i : i + CHUNK])),
                                         prompt_bytes=self.budget_model.prompt_bytes(cr, state["prompt_tokens"]),
                                         priority=state.get("round_priority", 0.0)))
            for i in range(0, len(samples), CHUNK)
        ]

    async def run_chunk(self, chunk: ChunkState) -> dict:
        task_id = chunk["task_id"]
        tokens = self._token_listeners.get(task_id)
        request = ProblemRequest(
            f"{task_id}:{chunk['samples'][0]}", tuple(chunk["prompt_ids"]), tuple(chunk["samples"]),
            SamplingParams(chunk["temperature"], self.top_p, chunk["max_new_tokens"], chunk["seed"]), chunk["cr"],
            task_id=task_id, keep_task=True, task_family=chunk.get("task_family", "chain"),
            answer_pattern=chunk.get("answer_pattern"), stop_strings=tuple(chunk.get("stop_strings", ())),
            stream_tokens=tokens is not None,
        )

        def thread_done(result) -> None:
            if tokens is not None:
                tokens(result)
            self._emit(task_id, "thread", {"sample": result.sample, "answer": result.answer, "tokens": result.tokens,
                                           "cr": result.cr, "realized_cr": result.realized_cr,
                                           "finish_reason": result.finish_reason})

        if self.allocators is None:
            results = await self.pool.collect(request, thread_done, tokens)
        else:
            allocator = self.allocators[await self.pool.pin(task_id)]
            async with allocator.grant(task_id, chunk["kv_bytes"], chunk["priority"]):
                self._hold_prompt(allocator, chunk)
                results = await self.pool.collect(request, thread_done, tokens)
        self._emit(task_id, "chunk", {"samples": chunk["samples"]})
        return {"threads": [asdict(r) for r in results]}

    def _hold_prompt(self, allocator: ThreadAllocator, chunk: ChunkState) -> None:
        """The task's held prompt at this ratio counts on its worker's allocator from its first chunk on."""
        _, grants = self._prompt_grants.setdefault(chunk["task_id"], (allocator, {}))
        if chunk["cr"] not in grants:
            grants[chunk["cr"]] = chunk["prompt_bytes"]
            allocator.hold(chunk["prompt_bytes"])

    def _release_prompts(self, task_id: str) -> None:
        allocator, grants = self._prompt_grants.pop(task_id, (None, {}))
        if allocator is not None:
            allocator.unhold(sum(grants.values()))

    def aggregate(self, state: SolveState) -> dict:
        threads = state["threads"]
        answers = [t["answer"] for t in threads]
        family = get_family(state.get("task_family", "chain"), answer_pattern=state.get("answer_pattern"))
        # equal answers by the family's key (0.5 and \frac{1}{2} are one math answer)
        vote = vote_by(self.weighting, answers, [t["mean_logprob"] for t in threads], key=family.key)
        return {"answer": vote.answer, "votes": vote.counts}

    def cancel(self, task_id: str) -> None:
        """End a running task at its next decision (its threads are stopped by the pool's cancel); a task this
        controller is not running is ignored."""
        if task_id in self._running:
            self._cancelled.add(task_id)

    def decide(self, state: SolveState) -> dict:
        if state["task_id"] in self._cancelled:
            return {"stop_reason": "cancelled"}
        used = len(state["threads"])
        greedy_round = self.greedy_round(state["round_samples"])
        if greedy_round and state.get("k") is None:
            return self._replan(state)
        if greedy_round:
            if state.get("plan_greedy"):
                return {"stop_reason": "planned"}
            if state["threads"][0].get("min_logprob", -float("inf")) >= self.confident_logprob:
                return {"stop_reason": "confident"}
        if settled(state["votes"], self.threshold):
            return {"stop_reason": "settled"}
        if used >= state["max_threads"]:
            return {"stop_reason": "budget"}
        if state["next_sample"] < state["target_threads"]:
            grown = self.first_round if greedy_round else state["round_size"] * 2
            size = min(grown, state["target_threads"] - state["next_sample"])
            return self._escalate(state, {"round_size": size}, {"event": "escalate", "more_threads": size})
        if len(state["votes"]) == 1:  # the plan is done and its threads agree: what the profile expected
            return {"stop_reason": "planned"}
        # The threads disagree and the plan is spent. A higher ratio fits more threads in the same memory, but
        # it is worth switching to only if the profile expects its threads to vote better than more threads here;
        # and neither is worth it unless the profile expects it to add at least ``min_gain`` accuracy.
        remaining = state["max_threads"] - used
        size = min(state["round_size"] * 2, remaining)
        now = self.expected_accuracy(state, state["cr"], used)
        staying = self.expected_accuracy(state, state["cr"], used + size)
        for cr in self.ratios:
            if cr <= state["cr"] or self.fits(state, cr) <= self.fits(state, state["cr"]):
                continue
            switch = min(self.fits(state, cr), remaining)
            switched = self.profile.accuracy(state["k"], cr, switch, self.sampling_temperature(state))
            if switched > staying and switched >= now + self.min_gain:
                return self._escalate(state, {"cr": cr, "round_size": switch, "target_threads": state["next_sample"] + switch},
                                      {"event": "escalate", "cr": cr, "more_threads": switch})
        if staying < now + self.min_gain:
            return {"stop_reason": "no_expected_gain"}
        return self._escalate(state, {"round_size": size, "target_threads": state["next_sample"] + size},
                              {"event": "escalate", "more_threads": size})

    def _replan(self, state: SolveState) -> dict:
        """After a greedy_confidence task's first thread: its lowest token log-probability is the task's difficulty;
        plan the task from that bin. A plan of that one greedy thread (at its ratio) ends the task here."""
        first = state["threads"][0]
        k = first.get("min_logprob")
        k = -1e9 if k is None else max(k, -1e9)  # a thread with no tokens: the least confident bin
        update = self._planned({**state, "k": k}, k, event="replan")
        event = {**update["rounds"][0], "signal": round(k, 4)}
        self._emit(state["task_id"], "replan", event)
        if update["plan_greedy"]:  # the greedy thread that ran is the plan (at the ratio the signal is read at)
            return {"k": k, "rounds": [event], "stop_reason": "planned"}
        target = state["next_sample"] + event["threads"]  # the plan's sampled threads follow the greedy one
        return {**update, "k": k, "rounds": [event], "target_threads": target,
                "round_size": min(self.first_round, event["threads"])}

    def _escalate(self, state: SolveState, update: dict, event: dict) -> dict:
        self._emit(state["task_id"], "escalation", event)
        return {**update, "rounds": [event]}

    @staticmethod
    def after_decide(state: SolveState) -> str:
        return END if state.get("stop_reason") else "dispatch"

    def _build(self) -> StateGraph:
        graph = StateGraph(SolveState)
        graph.add_node("assess", self.assess)
        graph.add_node("plan", self.plan)
        graph.add_node("dispatch", self.dispatch)
        graph.add_node("run_chunk", self.run_chunk)
        graph.add_node("aggregate", self.aggregate)
        graph.add_node("decide", self.decide)
        graph.add_edge(START, "assess")
        graph.add_edge("assess", "plan")
        graph.add_edge("plan", "dispatch")
        graph.add_conditional_edges("dispatch", self.fan_out, ["run_chunk"])
        graph.add_edge("run_chunk", "aggregate")
        graph.add_edge("aggregate", "decide")
        graph.add_conditional_edges("decide", self.after_decide, ["dispatch", END])
        return graph

    # -- running tasks -------------------------------------------------------------------------------
    async def solve(self, task_id: str, prompt: str, prompt_ids: list[int], budget: Budget, seed: int = 0,
                    on_event: EventListener | None = None, on_tokens: TokenListener | None = None,
                    difficulty: float | None = None, task_family: str = "chain", answer_pattern: str | None = None,
                    stop_strings: tuple[str, ...] = ()) -> dict[str, Any]:
        """Run (or, if its checkpoint exists and is unfinished, resume) one task; returns its final state.

        ``prompt_ids`` is the model input, tokenized once by the caller; ``difficulty`` is the task's value of the
        profile's signal when the family knows it up front (a ``k`` profile reads it off the prompt otherwise);
        ``task_family`` (with its ``answer_pattern`` and ``stop_strings``) says how threads stop and which answers
        are equal; ``on_event(name, data)`` hears the plan, each round, each escalation and each finished thread as
        they happen; ``on_tokens`` the running threads' tokens (``TokenProgress``) and each finished thread
        (``ThreadResult``). The task's worker-side state (its held prompt) is the caller's to close
        (``pool.close_task``)."""
        config = {"configurable": {"thread_id": task_id}, "recursion_limit": 200}
        if on_event is not None:
            self._listeners[task_id] = on_event
        if on_tokens is not None:
            self._token_listeners[task_id] = on_tokens
        self._running.add(task_id)
        try:
            snapshot = await self.graph.aget_state(config)
            # An interrupted run has tasks left in its latest checkpoint: some to run, or all of them finished with
            # their writes saved but the checkpoint after them not (``snapshot.next`` names only the former). A
            # finished run has none.
            if snapshot.tasks:
                return await self.graph.ainvoke(None, config)
            if snapshot.values:
                return snapshot.values
            initial = SolveState(task_id=task_id, prompt=prompt, prompt_ids=list(prompt_ids), seed=seed, k=difficulty,
                                 task_family=task_family, answer_pattern=answer_pattern, stop_strings=list(stop_strings),
                                 kv_budget_bytes=budget.kv_budget_bytes, max_threads=budget.max_threads, threads=[], rounds=[])
            return await self.graph.ainvoke(initial, config)
        finally:
            self._running.discard(task_id)
            self._listeners.pop(task_id, None)
            self._token_listeners.pop(task_id, None)
            self._cancelled.discard(task_id)
            self._release_prompts(task_id)


def make_checkpointer():
    """Where the controller's state is checkpointed: Redis when ``$REDIS_URL`` is set, else in memory."""
    url = os.environ.get("REDIS_URL")
    if url:
        from orchestrator.redis_saver import RedisSaver

        return RedisSaver.from_url(url)
    return InMemorySaver()
