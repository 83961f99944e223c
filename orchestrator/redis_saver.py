"""A LangGraph checkpoint saver on plain Redis (no modules: Debian's redis-server 7 is enough).

Layout, all under one key prefix (default ``thinkpool``):

* ``cp:{thread}:{ns}:{id}``: a hash with the checkpoint (without channel values), its metadata, its parent;
* ``ids:{thread}:{ns}``: a sorted set of the checkpoint ids (same score, so ordered lexically: LangGraph's
  ids sort by time);
* ``blob:{thread}:{ns}:{channel}:{version}``: one channel value, stored once per version;
* ``writes:{thread}:{ns}:{id}``: a hash of the pending writes of the tasks run from that checkpoint;
* ``keys:{thread}``: every key of a thread (so ``delete_thread`` removes exactly those), ``threads``: all
  thread ids (for listing without a thread).

Values go through the saver's serializer (``serde.dumps_typed``), so anything LangGraph can checkpoint,
Redis stores. The async methods run the same code on a worker thread (the client is thread-safe).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import redis
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    get_checkpoint_id,
    get_checkpoint_metadata,
)
from langgraph.checkpoint.serde.types import ChannelProtocol  # noqa: F401  (re-exported types stay importable)

try:  # the sort key LangGraph uses for pending writes (task path, task id, index)
    from langgraph.checkpoint.base import writes_sort_key
except ImportError:  # pragma: no cover - older langgraph
    def writes_sort_key(task_path: str, task_id: str, idx: int):
        return (task_path, task_id, idx)


class RedisSaver(BaseCheckpointSaver[str]):
    def __init__(self, client: redis.Redis | None = None, url: str | None = None, prefix: str = "thinkpool", **kwargs):
        super().__init__(**kwargs)
        if client is None:
            if url is None:
                raise ValueError("RedisSaver needs a client or a url (e.g. redis://localhost:6379/0)")
            client = redis.Redis.from_url(url)
        self.client = client
        self.prefix = prefix

    @classmethod
    def from_url(cls, url: str, prefix: str = "thinkpool") -> "RedisSaver":
        return cls(url=url, prefix=prefix)

    # -- keys ----------------------------------------------------------------------------------------
    def _key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    def _track(self, pipe, thread_id: str, *keys: str) -> None:
        pipe.sadd(self._key("keys", thread_id), *keys)
        pipe.sadd(self._key("threads"), thread_id)

    # -- reading -------------------------------------------------------------------------------------
    def _tuple(self, thread_id: str, ns: str, checkpoint_id: str) -> CheckpointTuple | None:
        saved = self.client.hgetall(self._key("cp", thread_id, ns, checkpoint_id))
        if not saved:
            return None
        checkpoint: Checkpoint = self.serde.loads_typed((saved[b"cp_type"].decode(), saved[b"cp"]))
        metadata = self.serde.loads_typed((saved[b"md_type"].decode(), saved[b"md"]))
        parent = saved.get(b"parent", b"").decode() or None
        return CheckpointTuple(
            config={"configurable": {"thread_id": thread_id, "checkpoint_ns": ns, "checkpoint_id": checkpoint_id}},
            checkpoint={**checkpoint, "channel_values": self._load_blobs(thread_id, ns, checkpoint["channel_versions"])},
            metadata=metadata,
            parent_config=(
                {"configurable": {"thread_id": thread_id, "checkpoint_ns": ns, "checkpoint_id": parent}} if parent else None
            ),
            pending_writes=self._load_writes(thread_id, ns, checkpoint_id),
        )

    def _load_blobs(self, thread_id: str, ns: str, versions: ChannelVersions) -> dict[str, Any]:
        values: dict[str, Any] = {}
        pipe = self.client.pipeline(transaction=False)
        channels = list(versions)
        for channel in channels:
            pipe.hgetall(self._key("blob", thread_id, ns, channel, str(versions[channel])))
        for channel, blob in zip(channels, pipe.execute()):
            if blob and blob[b"type"] != b"empty":
                values[channel] = self.serde.loads_typed((blob[b"type"].decode(), blob[b"data"]))
        return values

    def _load_writes(self, thread_id: str, ns: str, checkpoint_id: str) -> list[tuple[str, str, Any]]:
        stored = []
        for raw in self.client.hvals(self._key("writes", thread_id, ns, checkpoint_id)):
            header, _, data = raw.partition(b"\n")
            task_id, channel, kind, task_path, idx = json.loads(header)
            stored.append((writes_sort_key(task_path, task_id, idx), task_id, channel, (kind, data)))
        stored.sort(key=lambda item: item[0])
        return [(task_id, channel, self.serde.loads_typed(value)) for _, task_id, channel, value in stored]

    def _ids(self, thread_id: str, ns: str) -> list[str]:
        """Checkpoint ids of a thread and namespace, newest first."""
        return [i.decode() for i in self.client.zrevrangebylex(self._key("ids", thread_id, ns), "+", "-")]

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        thread_id = config["configurable"]["thread_id"]
        ns = config["configurable"].get("checkpoint_ns", "")
        checkpoint_id = get_checkpoint_id(config)
        if checkpoint_id is None:
            ids = self._ids(thread_id, ns)
            if not ids:
                return None
            checkpoint_id = ids[0]
        return self._tuple(thread_id, ns, checkpoint_id)

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        if config is not None:
            threads = [config["configurable"]["thread_id"]]
        else:
            threads = sorted(t.decode() for t in self.client.smembers(self._key("threads")))
        wanted_ns = config["configurable"].get("checkpoint_ns") if config else None
        wanted_id = get_checkpoint_id(config) if config else None
        before_id = get_checkpoint_id(before) if before else None
        for thread_id in threads:
            namespaces = sorted(n.decode() for n in self.client.smembers(self._key("ns", thread_id)))
            for ns in namespaces:
                if wanted_ns is not None and ns != wanted_ns:
                    continue
                for checkpoint_id in self._ids(thread_id, ns):
                    if wanted_id and checkpoint_id != wanted_id:
                        continue
                    if before_id and checkpoint_id >= before_id:
                        continue
                    found = self._tuple(thread_id, ns, checkpoint_id)
                    if found is None:
                        continue
                    if filter and not all(found.metadata.get(k) == v for k, v in filter.items()):
                        continue
                    if limit is not None:
                        if limit <= 0:
                            return
                        limit -= 1
                    yield found

    # -- writing -------------------------------------------------------------------------------------
    def put(self, config: RunnableConfig, checkpoint: Checkpoint, metadata: CheckpointMetadata,
            new_versions: ChannelVersions) -> RunnableConfig:
        thread_id = config["configurable"]["thread_id"]
        ns = config["configurable"].get("checkpoint_ns", "")
        stored = checkpoint.copy()
        values: dict[str, Any] = stored.pop("channel_values")  # type: ignore[misc]
        pipe = self.client.pipeline(transaction=True)
        keys = []
        for channel, version in new_versions.items():
            kind, data = self.serde.dumps_typed(values[channel]) if channel in values else ("empty", b"")
            key = self._key("blob", thread_id, ns, channel, str(version))
            pipe.hset(key, mapping={"type": kind, "data": data})
            keys.append(key)
        cp_type, cp = self.serde.dumps_typed(stored)
        md_type, md = self.serde.dumps_typed(get_checkpoint_metadata(config, metadata))
        key = self._key("cp", thread_id, ns, checkpoint["id"])
        pipe.hset(key, mapping={"cp_type": cp_type, "cp": cp, "md_type": md_type, "md": md,
                                "parent": config["configurable"].get("checkpoint_id") or ""})
        pipe.zadd(self._key("ids", thread_id, ns), {checkpoint["id"]: 0})
        pipe.sadd(self._key("ns", thread_id), ns)
        keys += [key, self._key("ids", thread_id, ns), self._key("ns", thread_id)]
        self._track(pipe, thread_id, *keys)
        pipe.execute()
        return {"configurable": {"thread_id": thread_id, "checkpoint_ns": ns, "checkpoint_id": checkpoint["id"]}}

    def put_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str = "") -> None:
        thread_id = config["configurable"]["thread_id"]
        ns = config["configurable"].get("checkpoint_ns", "")
        key = self._key("writes", thread_id, ns, config["configurable"]["checkpoint_id"])
        pipe = self.client.pipeline(transaction=True)
        for idx, (channel, value) in enumerate(writes):
            idx = WRITES_IDX_MAP.get(channel, idx)
            kind, data = self.serde.dumps_typed(value)
            field = f"{task_id}:{idx}"
            raw = json.dumps([task_id, channel, kind, task_path, idx]).encode() + b"\n" + data
            # Regular writes are saved once (a retried task must not replace them); special ones replace.
            (pipe.hsetnx if idx >= 0 else pipe.hset)(key, field, raw)
        self._track(pipe, thread_id, key)
        pipe.execute()

    def delete_thread(self, thread_id: str) -> None:
        tracked = self._key("keys", thread_id)
        keys = [k.decode() for k in self.client.smembers(tracked)]
        pipe = self.client.pipeline(transaction=True)
        if keys:
            pipe.delete(*keys)
        pipe.delete(tracked)
        pipe.srem(self._key("threads"), thread_id)
        pipe.execute()

    # -- async: the same operations on a worker thread ----------------------------------------------
    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return await asyncio.to_thread(self.get_tuple, config)

    async def alist(self, config: RunnableConfig | None, *, filter: dict[str, Any] | None = None,
                    before: RunnableConfig | None = None, limit: int | None = None) -> AsyncIterator[CheckpointTuple]:
        found = await asyncio.to_thread(lambda: list(self.list(config, filter=filter, before=before, limit=limit)))
        for item in found:
            yield item

    async def aput(self, config: RunnableConfig, checkpoint: Checkpoint, metadata: CheckpointMetadata,
                   new_versions: ChannelVersions) -> RunnableConfig:
        return await asyncio.to_thread(self.put, config, checkpoint, metadata, new_versions)

    async def aput_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str,
                          task_path: str = "") -> None:
        await asyncio.to_thread(self.put_writes, config, writes, task_id, task_path)

    async def adelete_thread(self, thread_id: str) -> None:
        await asyncio.to_thread(self.delete_thread, thread_id)

    def get_next_version(self, current: str | None, channel: None) -> str:
        """Versions sort as strings: a zero-padded counter (the in-memory saver's scheme)."""
        number = 0 if current is None else (current if isinstance(current, int) else int(str(current).split(".")[0]))
        return f"{number + 1:032}.{0:016}"
