"""The LangGraph checkpoint saver on a real redis-server: round trip, history and filters, pending writes
(a failed step resumes without rerunning the tasks that finished), async methods, thread deletion."""

import asyncio
import operator
import uuid
from typing import Annotated, TypedDict

import pytest
import redis
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
