"""The LangGraph checkpoint saver on a real redis-server: round trip, history and filters, pending writes
(a failed step resumes without rerunning the tasks that finished), async methods, thread deletion; and the
maintenance calls on real graphs: prune (keeping what a DeltaChannel is rebuilt from), copy_thread,
delete_for_runs, each leaving no orphaned key behind. The conformance suite is in test_redis_saver_conformance."""

import asyncio
import operator
import uuid
from typing import Annotated, TypedDict

import pytest
import redis
from langgraph.channels.delta import DeltaChannel
from langgraph.graph import END, START, StateGraph

from orchestrator.redis_saver import RedisSaver


class State(TypedDict):
    log: Annotated[list[str], operator.add]


@pytest.fixture
def saver(redis_url):
    return RedisSaver(redis.Redis.from_url(redis_url), prefix=f"test-{uuid.uuid4().hex[:6]}")


def counting_graph(calls: dict, fail_once: set):
    """start -> (left, right in parallel) -> join; a node named in ``fail_once`` raises the first time."""
    def node(name):
        def run(state: State) -> State:
            calls[name] = calls.get(name, 0) + 1
            if name in fail_once:
                fail_once.discard(name)
                raise RuntimeError(f"{name} crashed")
            return {"log": [name]}
        return run

    graph = StateGraph(State)
    for name in ("start", "left", "right", "join"):
        graph.add_node(name, node(name))
    graph.add_edge(START, "start")
    graph.add_edge("start", "left")
    graph.add_edge("start", "right")
    graph.add_edge(["left", "right"], "join")
    graph.add_edge("join", END)
    return graph


def test_round_trip_history_filters_and_deletion(saver):
    app = counting_graph({}, set()).compile(checkpointer=saver)
    config = {"configurable": {"thread_id": "t1"}}
    assert sorted(app.invoke({"log": []}, config)["log"]) == ["join", "left", "right", "start"]
    assert app.get_state(config).values["log"][-1] == "join"
    history = list(saver.list(config))
    assert len(history) >= 4 and history[0].config == saver.get_tuple(config).config
    ids = [h.config["configurable"]["checkpoint_id"] for h in history]
    assert ids == sorted(ids, reverse=True)  # newest first
    assert [h.metadata["step"] for h in saver.list(config, filter={"source": "input"})] == [-1]
    assert len(list(saver.list(config, limit=2))) == 2
    older = list(saver.list(config, before=history[1].config))
    assert [h.config for h in older] == [h.config for h in history[2:]]
    assert history[0].parent_config == history[1].config
    # another thread is listed too when no thread is given, and deleting one leaves the other
    app.invoke({"log": []}, {"configurable": {"thread_id": "t2"}})
    assert {h.config["configurable"]["thread_id"] for h in saver.list(None)} == {"t1", "t2"}
    saver.delete_thread("t1")
    assert saver.get_tuple(config) is None and list(saver.list(config)) == []
    assert saver.get_tuple({"configurable": {"thread_id": "t2"}}) is not None


def test_a_failed_step_resumes_without_rerunning_finished_tasks(saver):
    calls: dict = {}
    app = counting_graph(calls, fail_once={"right"}).compile(checkpointer=saver)
    config = {"configurable": {"thread_id": "crash"}}
    with pytest.raises(RuntimeError, match="right crashed"):
        app.invoke({"log": []}, config)
    pending = saver.get_tuple(config).pending_writes
    assert any(channel == "log" and value == ["left"] for _, channel, value in pending)  # left's result was kept
    result = app.invoke(None, config)  # resume from the checkpoint
    assert sorted(result["log"]) == ["join", "left", "right", "start"]
    assert calls == {"start": 1, "left": 1, "right": 2, "join": 1}


def test_async_methods(saver):
    async def run():
        app = counting_graph({}, set()).compile(checkpointer=saver)
        config = {"configurable": {"thread_id": "async"}}
        result = await app.ainvoke({"log": []}, config)
        listed = [h async for h in saver.alist(config, limit=3)]
        latest = await saver.aget_tuple(config)
        await saver.adelete_thread("async")
        return result, listed, latest, await saver.aget_tuple(config)

    result, listed, latest, gone = asyncio.run(run())
    assert result["log"][-1] == "join" and len(listed) == 3
    assert listed[0].config == latest.config and gone is None


def stored_keys(saver) -> set[str]:
    return {k.decode() for k in saver.client.scan_iter(match=f"{saver.prefix}:*", count=1000)}


def thread_keys(saver, thread_id: str) -> set[str]:
    return {k for k in stored_keys(saver) if k.split(":")[2:3] == [thread_id]}


def thread_blobs(saver, thread_id: str) -> set[str]:
    return {k for k in stored_keys(saver) if k.startswith(f"{saver.prefix}:blob:{thread_id}:")}


def referenced_blobs(saver, thread_id: str) -> set[str]:
    return {saver._key("blob", thread_id, t.config["configurable"]["checkpoint_ns"], channel, str(version))
            for t in saver.list({"configurable": {"thread_id": thread_id}})
            for channel, version in t.checkpoint["channel_versions"].items()}


def test_prune_keeps_the_latest_state_and_frees_the_rest(saver):
    app = counting_graph({}, set()).compile(checkpointer=saver)
    pruned, other = {"configurable": {"thread_id": "pruned"}}, {"configurable": {"thread_id": "other"}}
    for _ in range(2):
        app.invoke({"log": ["again"]}, pruned)
    app.invoke({"log": []}, other)
    before, other_ids = app.get_state(pruned).values, [t.config for t in saver.list(other)]
    blobs_before = thread_blobs(saver, "pruned")

    saver.prune(["pruned"])
    assert len(list(saver.list(pruned))) == 1
    assert app.get_state(pruned).values == before
    assert thread_blobs(saver, "pruned") == referenced_blobs(saver, "pruned") < blobs_before  # the rest was freed
    tracked = {k.decode() for k in saver.client.smembers(saver._key("keys", "pruned"))}
    assert tracked >= thread_keys(saver, "pruned") - {saver._key("keys", "pruned")}  # what is left is still tracked
    assert [t.config for t in saver.list(other)] == other_ids
    assert app.invoke({"log": ["more"]}, pruned)["log"][: len(before["log"])] == before["log"]  # the thread goes on

    saver.prune(["other"], strategy="delete")
    assert saver.get_tuple(other) is None
    with pytest.raises(ValueError, match="strategy"):
        saver.prune(["pruned"], strategy="keep_oldest")


def test_prune_keeps_the_ancestors_a_delta_channel_is_rebuilt_from(saver):
    def extend(state, writes):
        return [*state, *(item for write in writes for item in write)]

    class DeltaState(TypedDict):
        log: Annotated[list[str], DeltaChannel(extend, snapshot_frequency=4)]
        n: int

    graph = StateGraph(DeltaState)
    graph.add_node("a", lambda s: {"log": [f"a{s['n']}"], "n": s["n"] + 1})
    graph.add_node("b", lambda s: {"log": [f"b{s['n']}"], "n": s["n"] + 1})
    graph.add_edge(START, "a")
    graph.add_edge("a", "b")
    graph.add_edge("b", END)
    app = graph.compile(checkpointer=saver)
    config = {"configurable": {"thread_id": "delta"}}
    for i in range(3):
        app.invoke({"log": [f"in{i}"], "n": 0}, config)
    before = app.get_state(config).values
    assert before["log"] == ["in0", "a0", "b1", "in1", "a0", "b1", "in2", "a0", "b1"]

    saver.prune(["delta"])
    kept = list(saver.list(config))
    # the latest has no snapshot of ``log``: keeping it alone would rebuild ``log`` from nothing
    assert 1 < len(kept) < 12 and "log" in kept[-1].checkpoint["channel_values"]
    assert app.get_state(config).values == before


def test_copy_thread_gives_an_independent_thread(saver):
    app = counting_graph({}, set()).compile(checkpointer=saver)
    source, target = {"configurable": {"thread_id": "source"}}, {"configurable": {"thread_id": "target"}}
    app.invoke({"log": ["first"]}, source)
    history = [(t.checkpoint["id"], t.metadata["step"]) for t in saver.list(source)]

    saver.copy_thread("source", "target")
    saver.delete_thread("source")  # the copy owns its blobs and writes
    assert [(t.checkpoint["id"], t.metadata["step"]) for t in saver.list(target)] == history
    assert saver.get_tuple(target).parent_config["configurable"]["thread_id"] == "target"
    log = app.invoke({"log": ["second"]}, target)["log"]  # the copy goes on from the source's state
    assert len(log) == 10 and log[0] == "first" and log[5] == "second" and log[-1] == "join"
    assert saver.get_tuple(source) is None and thread_blobs(saver, "source") == set()


def test_delete_for_runs_removes_those_runs_everywhere_and_nothing_else(saver):
    app = counting_graph({}, set()).compile(checkpointer=saver)
    shared, alone = {"configurable": {"thread_id": "shared"}}, {"configurable": {"thread_id": "alone"}}
    app.invoke({"log": ["one"]}, {**shared, "metadata": {"run_id": "run-1"}})
    app.invoke({"log": ["two"]}, {**shared, "metadata": {"run_id": "run-2"}})
    app.invoke({"log": []}, {**alone, "metadata": {"run_id": "run-1"}})
    assert {t.metadata["run_id"] for t in saver.list(shared)} == {"run-1", "run-2"}

    saver.delete_for_runs(["run-1", "never-ran"])
    assert {t.metadata["run_id"] for t in saver.list(shared)} == {"run-2"}
    assert thread_blobs(saver, "shared") <= referenced_blobs(saver, "shared")
    assert saver.get_tuple(alone) is None and thread_keys(saver, "alone") == set()
    assert {t.config["configurable"]["thread_id"] for t in saver.list(None)} == {"shared"}

    saver.delete_for_runs(["run-2"])
    assert stored_keys(saver) == set()  # the last checkpoints gone, the thread and its index go too
