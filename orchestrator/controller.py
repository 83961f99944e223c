"""The controller: a LangGraph ``StateGraph`` that chooses, per task, the compression ratio, thread count and temperature.

    assess -> plan -> dispatch -> run_chunk (one per 4 threads, in parallel) -> aggregate -> decide
                          ^                                                                 |
                          +---------------------- escalate (more threads, a higher ratio) --+--> END

* ``assess`` estimates the difficulty (the chain task's k; unknown tasks are treated as the hardest bin);
* ``plan`` asks the planner for (ratio, threads, temperature, token limit) within the task's KV budget; the
  temperature holds for all the task's sampled threads (the profile measures votes at one temperature);
* ``dispatch`` opens a round: the first is one greedy thread (``greedy_first``: the model's single most
  likely answer, usually more accurate than any one sampled thread), the next ``first_round`` sampled
  threads; later rounds double;
* ``run_chunk`` runs a few threads on the workers (one request, prompt shared); each chunk is its own
  LangGraph task, so its results are saved as pending writes the moment it finishes: a controller killed
  mid-round and restarted from its checkpoint reruns only the chunks that had not finished;
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

Many tasks at once: give every controller the same :class:`~orchestrator.allocator.ThreadAllocator` and
each round's chunks wait for their KV bytes there, ranked by the accuracy the round is expected to add
per byte it reserves, so the workers' memory goes to the tasks where threads buy the most.
"""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass
from typing import Annotated, Any, TypedDict

from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send

from orchestrator.allocator import ThreadAllocator
from policies.planner import CalibrationProfile, plan
from policies.stopping import settled
from policies.voting import confidence_vote, majority_vote
from tasks.chain import ProblemError, parse_problem
from tasks.prompt import format_prompt
from workers.kv_budget import KVBudgetModel
from workers.thread import SamplingParams
from workers.worker import ProblemRequest

CHUNK = 4  # threads per run_chunk task: the unit of work that survives a controller crash


@dataclass(frozen=True)
class Budget:
    """A task's limits: KV memory its threads may hold at once, and threads in total."""

    kv_budget_bytes: int
    max_threads: int = 64


class SolveState(TypedDict, total=False):
    task_id: str
    prompt: str
    k: int | None
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
    prompt: str
    seed: int
    cr: float
    max_new_tokens: int
    samples: list[int]
    temperature: float
    kv_bytes: int  # what these threads may grow to (the allocator's unit)
    priority: float  # expected accuracy gained per KV byte by the round this chunk belongs to


class Controller:
    def __init__(self, pool, profile: CalibrationProfile, tokenizer, kv_bytes_per_token: int, ratios: list[float],
                 temperature: float | None = None, first_round: int = 4, threshold: float = 0.95, weighting: str = "majority",
                 greedy_first: bool = True, confident_logprob: float = -0.5, min_gain: float = 0.02,
                 checkpointer=None, on_chunk=None, allocator: ThreadAllocator | None = None,
                 budget_model: KVBudgetModel | None = None):
        self.pool, self.profile, self.tokenizer = pool, profile, tokenizer
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
        self.on_chunk = on_chunk  # called with (task_id, samples) when a chunk finishes (progress, tests)
        self.allocator = allocator  # shared by the controllers of tasks that run at once (None: no ranking)
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
    def assess(self, state: SolveState) -> dict:
        try:
            k = parse_problem(state["prompt"].strip()).k
        except ProblemError:
            k = None
        return {"k": k, "prompt_tokens": len(self.tokenizer(format_prompt(state["prompt"]))["input_ids"])}

    def plan(self, state: SolveState) -> dict:
        chosen = plan(self.profile, state["k"], state["kv_budget_bytes"],
                      lambda cr, n: self.kv_bytes(state, cr, n, self.profile.max_new_tokens), self.ratios,
                      max_threads=state["max_threads"], temperature=self.temperature)
        # With a greedy first thread, a plan of n sampled threads runs n + 1 threads in all.
        extra = int(self.greedy_first and not chosen.greedy)
        return {"cr": chosen.cr, "target_threads": chosen.threads + extra, "max_new_tokens": chosen.max_new_tokens,
                "temperature": chosen.temperature,
                "round_size": 1 if self.greedy_first else min(self.first_round, chosen.threads), "next_sample": 0,
                "plan_greedy": chosen.greedy,
                "rounds": [{"event": "plan", "cr": chosen.cr, "threads": chosen.threads, "greedy": chosen.greedy,
                            "temperature": chosen.temperature, "expected_accuracy": round(chosen.expected_accuracy, 3)}]}

    def expected_accuracy(self, state: SolveState, cr: float, threads: int) -> float:
        """What ``threads`` threads of this task are expected to score (the first greedy, if so run)."""
        if threads <= 0:
            return 0.0
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
        greedy = self.greedy_round(samples)
        return {"round_samples": samples, "next_sample": samples[-1] + 1, "round_priority": gain / cost,
                "rounds": [{"event": "round", "cr": state["cr"], "threads": len(samples), "greedy": greedy}]}

    def greedy_round(self, samples: list[int]) -> bool:
        """Whether a round is the greedy first thread: sample 0, when the controller opens with one."""
        return self.greedy_first and samples[0] == 0

    def fan_out(self, state: SolveState) -> list[Send]:
        samples = state["round_samples"]
        return [
            Send("run_chunk", ChunkState(task_id=state["task_id"], prompt=state["prompt"], seed=state["seed"], cr=state["cr"],
                                         max_new_tokens=state["max_new_tokens"], samples=samples[i : i + CHUNK],
                                         temperature=0.0 if self.greedy_round(samples) else self.sampling_temperature(state),
                                         kv_bytes=self.kv_bytes(state, state["cr"], len(samples[i : i + CHUNK])),
                                         priority=state.get("round_priority", 0.0)))
            for i in range(0, len(samples), CHUNK)
        ]

    async def run_chunk(self, chunk: ChunkState) -> dict:
        request = ProblemRequest(
            f"{chunk['task_id']}:{chunk['samples'][0]}", format_prompt(chunk["prompt"]), tuple(chunk["samples"]),
            SamplingParams(chunk["temperature"], self.top_p, chunk["max_new_tokens"], chunk["seed"]), chunk["cr"],
        )
        if self.allocator is None:
            results = await self.pool.collect(request)
        else:
            async with self.allocator.grant(chunk["task_id"], chunk.get("kv_bytes", 0), chunk.get("priority", 0.0)):
                results = await self.pool.collect(request)
        if self.on_chunk is not None:
            self.on_chunk(chunk["task_id"], chunk["samples"])
        return {"threads": [
            {"sample": r.sample_index, "answer": r.answer, "tokens": r.tokens, "mean_logprob": r.mean_logprob,
             "min_logprob": r.min_logprob,
             "realized_cr": r.realized_cr, "kv_cr": r.kv_cr, "cr": r.cr, "finish_reason": r.finish_reason} for r in results
        ]}

    def aggregate(self, state: SolveState) -> dict:
        threads = state["threads"]
        answers = [t["answer"] for t in threads]
        if self.weighting == "confidence":
            vote = confidence_vote(answers, [t["mean_logprob"] for t in threads])
        else:
            vote = majority_vote(answers, [t["mean_logprob"] for t in threads])
        return {"answer": vote.answer, "votes": vote.counts}

    def decide(self, state: SolveState) -> dict:
        used = len(state["threads"])
        greedy_round = self.greedy_round(state["round_samples"])
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
            return {"round_size": size, "rounds": [{"event": "escalate", "more_threads": size}]}
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
                return {"cr": cr, "round_size": switch, "target_threads": state["next_sample"] + switch,
                        "rounds": [{"event": "escalate", "cr": cr, "more_threads": switch}]}
        if staying < now + self.min_gain:
            return {"stop_reason": "no_expected_gain"}
        return {"round_size": size, "target_threads": state["next_sample"] + size,
                "rounds": [{"event": "escalate", "more_threads": size}]}

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
    async def solve(self, task_id: str, prompt: str, budget: Budget, seed: int = 0) -> dict[str, Any]:
        """Run (or, if its checkpoint exists and is unfinished, resume) one task; returns its final state."""
        config = {"configurable": {"thread_id": task_id}, "recursion_limit": 200}
        snapshot = await self.graph.aget_state(config)
        if snapshot.values and snapshot.next:  # an interrupted run: continue from the checkpoint
            return await self.graph.ainvoke(None, config)
        if snapshot.values and not snapshot.next:  # already finished
            return snapshot.values
        initial = SolveState(task_id=task_id, prompt=prompt, seed=seed, kv_budget_bytes=budget.kv_budget_bytes,
                             max_threads=budget.max_threads, threads=[], rounds=[])
        return await self.graph.ainvoke(initial, config)


def make_checkpointer():
    """Where the controller's state is checkpointed: Redis when ``$REDIS_URL`` is set, else in memory."""
    url = os.environ.get("REDIS_URL")
    if url:
        from orchestrator.redis_saver import RedisSaver

        return RedisSaver.from_url(url)
    return InMemorySaver()


def check_budget(profile: CalibrationProfile, kv_bytes_per_token: int, ratios: list[float], prompt_tokens: int,
                 budget: Budget, budget_model: KVBudgetModel | None = None) -> None:
    """Raise ``ValueError`` (naming ``kv_budget``) before any work if the budget holds no thread at any ratio."""
    model = budget_model or KVBudgetModel.nominal(kv_bytes_per_token, ratios, profile.window)
    needed = min(model.group_bytes(cr, prompt_tokens, profile.max_new_tokens) for cr in ratios)
    if budget.kv_budget_bytes < needed:
        raise ValueError(f"kv_budget: {budget.kv_budget_bytes} bytes cannot hold one thread "
                         f"(the smallest, at {max(ratios):g}x, needs {needed} bytes)")
    if budget.max_threads < 1:
        raise ValueError("max_threads: must be at least 1")
