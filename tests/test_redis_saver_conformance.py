"""LangGraph's own checkpoint conformance suite (``langgraph-checkpoint-conformance``) against RedisSaver on a
real redis-server: every capability it knows, base and extended, must be detected and pass.

One test per capability, so a failure names the capability and the suite's failing checks."""

import asyncio
import uuid

import pytest
import redis
from langgraph.checkpoint.conformance import checkpointer_test, validate  # the test extra: pip install -e '.[test]'
from langgraph.checkpoint.conformance.capabilities import Capability

from orchestrator.redis_saver import RedisSaver


def registered_saver(redis_url: str):
    """A fresh saver per capability suite, each under its own key prefix, its keys removed afterwards."""

    @checkpointer_test(name=f"RedisSaver-{uuid.uuid4().hex[:6]}")
    async def factory():
        client = redis.Redis.from_url(redis_url)
        prefix = f"conformance-{uuid.uuid4().hex[:8]}"
        try:
            yield RedisSaver(client, prefix=prefix)
        finally:
            stale = list(client.scan_iter(match=f"{prefix}:*", count=1000))
            if stale:
                client.delete(*stale)
            client.close()

    return factory


@pytest.mark.parametrize("capability", [c.value for c in Capability])
def test_conformance(redis_url, capability):
    report = asyncio.run(validate(registered_saver(redis_url), capabilities={capability}))
    result = report.results[capability]
    assert result.detected, f"RedisSaver does not implement {capability}"
    assert result.passed, f"{capability}: {result.tests_failed} failed: {result.failures}"
    assert result.tests_passed > 0
