"""A LangGraph checkpoint saver on plain Redis (no modules: Debian's redis-server 7 is enough).

Layout, all under one key prefix (default ``thinkpool``):

* ``cp:{thread}:{ns}:{id}``: a hash with the checkpoint (without channel values), its metadata, its parent;
* ``ids:{thread}:{ns}``: a sorted set of the checkpoint ids (same score, so ordered lexically: LangGraph's
  ids sort by time);
* ``blob:{thread}:{ns}:{channel}:{version}``: one channel value, stored once per version;
* ``writes:{thread}:{ns}:{id}``: a hash of the pending writes of the tasks run from that checkpoint;
* ``keys:{thread}``: every key of a thread (so ``delete_thread`` removes exactly those), ``threads``: all
  thread ids (for listing without a thread);
* the run index, for ``delete_for_runs``: ``run:{run}`` the threads holding checkpoints of a run,
  ``runcp:{thread}:{run}`` those checkpoints (JSON ``[ns, id]``), ``runs:{thread}`` the runs of a thread.
  Checkpoints saved before the index existed are not found by ``delete_for_runs``.

Maintenance (``copy_thread``, ``prune``, ``delete_for_runs``) runs as WATCH/MULTI transactions, retried when a
writer touches the thread meanwhile, and removes the channel blobs no remaining checkpoint refers to.

Values go through the saver's serializer (``serde.dumps_typed``), so anything LangGraph can checkpoint,
Redis stores. The async methods run the same code on a worker thread (the client is thread-safe).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, NamedTuple

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


class _Stored(NamedTuple):
    """A checkpoint as stored: without its channel values (those live in the blobs), its metadata, its parent."""

    checkpoint: Checkpoint
    metadata: CheckpointMetadata
    parent: str | None


# How copy_thread merges each kind of key into the target thread: hashes are copied over, indexes united.
_HASH_KINDS = ("cp", "blob", "writes")
_ZSET_KINDS = ("ids",)
_SET_KINDS = ("ns", "runcp", "runs")


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
        full_metadata = get_checkpoint_metadata(config, metadata)
        cp_type, cp = self.serde.dumps_typed(stored)
        md_type, md = self.serde.dumps_typed(full_metadata)
        key = self._key("cp", thread_id, ns, checkpoint["id"])
        pipe.hset(key, mapping={"cp_type": cp_type, "cp": cp, "md_type": md_type, "md": md,
                                "parent": config["configurable"].get("checkpoint_id") or ""})
        pipe.zadd(self._key("ids", thread_id, ns), {checkpoint["id"]: 0})
        pipe.sadd(self._key("ns", thread_id), ns)
        keys += [key, self._key("ids", thread_id, ns), self._key("ns", thread_id)]
        run_id = full_metadata.get("run_id")
        if run_id:
            run_id = str(run_id)
            pipe.sadd(self._key("runcp", thread_id, run_id), json.dumps([ns, checkpoint["id"]]))
            pipe.sadd(self._key("runs", thread_id), run_id)
            pipe.sadd(self._key("run", run_id), thread_id)
            keys += [self._key("runcp", thread_id, run_id), self._key("runs", thread_id)]
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

        def apply(pipe) -> None:
            keys = [k.decode() for k in self.client.smembers(tracked)]
            runs = [r.decode() for r in self.client.smembers(self._key("runs", thread_id))]
            pipe.multi()
            self._queue_thread_removal(pipe, thread_id, keys, runs)

        self.client.transaction(apply, tracked)

    def _queue_thread_removal(self, pipe, thread_id: str, keys: list[str], runs: list[str]) -> None:
        if keys:
            pipe.delete(*keys)
        for run_id in runs:
            pipe.srem(self._key("run", run_id), thread_id)
        pipe.delete(self._key("keys", thread_id))
        pipe.srem(self._key("threads"), thread_id)

    # -- maintenance: copy, prune, delete by run -----------------------------------------------------
    def _stored(self, thread_id: str, ns: str, checkpoint_id: str) -> _Stored | None:
        saved = self.client.hmget(self._key("cp", thread_id, ns, checkpoint_id),
                                  "cp_type", "cp", "md_type", "md", "parent")
        if saved[0] is None:
            return None
        cp_type, cp, md_type, md, parent = saved
        return _Stored(self.serde.loads_typed((cp_type.decode(), cp)), self.serde.loads_typed((md_type.decode(), md)),
                       (parent or b"").decode() or None)

    def _blob_keys(self, thread_id: str, ns: str, versions: ChannelVersions) -> set[str]:
        return {self._key("blob", thread_id, ns, channel, str(version)) for channel, version in versions.items()}

    def _valued_channels(self, thread_id: str, ns: str, versions: ChannelVersions) -> set[str]:
        """Channels whose value at these versions is stored (what ``get_tuple`` shows in ``channel_values``)."""
        channels = list(versions)
        pipe = self.client.pipeline(transaction=False)
        for channel in channels:
            pipe.hget(self._key("blob", thread_id, ns, channel, str(versions[channel])), "type")
        return {channel for channel, kind in zip(channels, pipe.execute()) if kind is not None and kind != b"empty"}

    def _queue_checkpoint_removal(self, pipe, thread_id: str, ns: str, dropped: dict[str, _Stored | None],
                                  kept: dict[str, _Stored | None]) -> None:
        """Remove ``dropped`` checkpoints of one namespace, their writes, their run index entries, and the blobs
        that none of ``kept`` (the namespace's remaining checkpoints) refers to."""
        if not dropped:
            return
        gone: set[str] = set()
        for checkpoint_id, stored in dropped.items():
            gone |= {self._key("cp", thread_id, ns, checkpoint_id), self._key("writes", thread_id, ns, checkpoint_id)}
            if stored is None:
                continue
            gone |= self._blob_keys(thread_id, ns, stored.checkpoint["channel_versions"])
            run_id = stored.metadata.get("run_id")
            if run_id:
                pipe.srem(self._key("runcp", thread_id, str(run_id)), json.dumps([ns, checkpoint_id]))
        for stored in kept.values():
            if stored is not None:
                gone -= self._blob_keys(thread_id, ns, stored.checkpoint["channel_versions"])
        pipe.zrem(self._key("ids", thread_id, ns), *dropped)
        pipe.delete(*gone)
        pipe.srem(self._key("keys", thread_id), *gone)
        if not kept:
            pipe.srem(self._key("ns", thread_id), ns)

    def _delta_chain(self, thread_id: str, ns: str, head_id: str) -> dict[str, _Stored | None]:
        """The latest checkpoint and the ancestors its DeltaChannels are rebuilt from.

        A DeltaChannel stores a snapshot only every so many updates; between snapshots its value is replayed from
        the writes of the ancestors back to the nearest one holding a stored value. The channels still counting
        since their snapshot are named in the metadata's ``counters_since_delta_snapshot``; walking the parent
        chain until each has a stored value keeps what ``get_delta_channel_history`` will read."""
        head = self._stored(thread_id, ns, head_id)
        chain: dict[str, _Stored | None] = {head_id: head}
        if head is None:
            return chain
        pending = set(head.metadata.get("counters_since_delta_snapshot") or ())
        pending -= self._valued_channels(thread_id, ns, head.checkpoint["channel_versions"])
        parent = head.parent
        while pending and parent and parent not in chain:
            stored = self._stored(thread_id, ns, parent)
            if stored is None:
                break
            chain[parent] = stored
            pending -= self._valued_channels(thread_id, ns, stored.checkpoint["channel_versions"])
            parent = stored.parent
        return chain

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy every checkpoint of every namespace, with its writes and blobs, keeping the checkpoint ids (so
        parent links and the order stay as they are). Checkpoints already on the target are kept; one with the
        same id is replaced. Copies belong to the same runs as their sources."""
        if source_thread_id == target_thread_id:
            return
        tracked = self._key("keys", source_thread_id)

        def apply(pipe) -> None:
            keys = sorted(k.decode() for k in self.client.smembers(tracked))
            runs = [r.decode() for r in self.client.smembers(self._key("runs", source_thread_id))]
            pipe.multi()
            if not keys:
                return
            copied = []
            for key in keys:
                kind, _, rest = key[len(self.prefix) + 1:].partition(":")
                target = self._key(kind, target_thread_id + rest[len(source_thread_id):])
                if kind in _HASH_KINDS:
                    pipe.copy(key, target, replace=True)
                elif kind in _ZSET_KINDS:
                    pipe.zunionstore(target, [target, key], aggregate="MIN")
                elif kind in _SET_KINDS:
                    pipe.sunionstore(target, [target, key])
                else:  # pragma: no cover - a kind this version does not know
                    raise ValueError(f"unknown key kind {kind!r} in {key!r}")
                copied.append(target)
            for run_id in runs:
                pipe.sadd(self._key("run", run_id), target_thread_id)
            self._track(pipe, target_thread_id, *copied)

        self.client.transaction(apply, tracked)

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """``keep_latest``: each namespace of each thread keeps its latest checkpoint with its writes (plus the
        ancestors its DeltaChannels are rebuilt from); ``delete``: the threads are removed."""
        if strategy not in ("keep_latest", "delete"):
            raise ValueError(f"unknown prune strategy {strategy!r}: 'keep_latest' or 'delete'")
        for thread_id in thread_ids:
            if strategy == "delete":
                self.delete_thread(thread_id)
                continue

            def apply(pipe, thread_id=thread_id) -> None:
                plans = []
                for ns in sorted(n.decode() for n in self.client.smembers(self._key("ns", thread_id))):
                    ids = self._ids(thread_id, ns)
                    if len(ids) <= 1:
                        continue
                    kept = self._delta_chain(thread_id, ns, ids[0])
                    dropped = {i: self._stored(thread_id, ns, i) for i in ids if i not in kept}
                    plans.append((ns, dropped, kept))
                pipe.multi()
                for ns, dropped, kept in plans:
                    self._queue_checkpoint_removal(pipe, thread_id, ns, dropped, kept)
                self._queue_run_index_cleanup(pipe, thread_id, plans)

            self.client.transaction(apply, self._key("keys", thread_id))

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Remove the checkpoints (any thread, any namespace) whose metadata names one of these runs, with their
        writes; a thread left with no checkpoint is removed altogether. Children of a removed checkpoint keep
        their parent link (the parent reads as missing)."""
        run_ids = {str(r) for r in run_ids}
        threads = set()
        for run_id in run_ids:
            threads |= {t.decode() for t in self.client.smembers(self._key("run", run_id))}
        for thread_id in sorted(threads):

            def apply(pipe, thread_id=thread_id) -> None:
                doomed: dict[str, set[str]] = {}
                for run_id in run_ids:
                    for raw in self.client.smembers(self._key("runcp", thread_id, run_id)):
                        ns, checkpoint_id = json.loads(raw)
                        doomed.setdefault(ns, set()).add(checkpoint_id)
                plans = []
                for ns, candidates in sorted(doomed.items()):
                    stored = {i: self._stored(thread_id, ns, i) for i in self._ids(thread_id, ns)}
                    # the index may be stale (a checkpoint re-saved under another run): the metadata decides
                    dropped = {i: s for i, s in stored.items() if i in candidates
                               and (s is None or str(s.metadata.get("run_id")) in run_ids)}
                    plans.append((ns, dropped, {i: s for i, s in stored.items() if i not in dropped}))
                left = {n.decode() for n in self.client.smembers(self._key("ns", thread_id))}
                left -= {ns for ns, _, kept in plans if not kept}
                tracked = [k.decode() for k in self.client.smembers(self._key("keys", thread_id))]
                runs = [r.decode() for r in self.client.smembers(self._key("runs", thread_id))]
                pipe.multi()
                if not left:
                    self._queue_thread_removal(pipe, thread_id, tracked, runs)
                    for run_id in run_ids:
                        pipe.srem(self._key("run", run_id), thread_id)
                    return
                for ns, dropped, kept in plans:
                    self._queue_checkpoint_removal(pipe, thread_id, ns, dropped, kept)
                for run_id in run_ids:  # the run is gone from this thread, whatever the index said
                    self._queue_forget_run(pipe, thread_id, run_id)

            self.client.transaction(apply, self._key("keys", thread_id), self._key("runs", thread_id))

    def _queue_run_index_cleanup(self, pipe, thread_id: str, plans) -> None:
        """After a prune, forget the runs that no longer have a checkpoint in the thread."""
        dropped_by_run: dict[str, set[str]] = {}
        for ns, dropped, _ in plans:
            for checkpoint_id, stored in dropped.items():
                if stored is not None and stored.metadata.get("run_id"):
                    entry = json.dumps([ns, checkpoint_id])
                    dropped_by_run.setdefault(str(stored.metadata["run_id"]), set()).add(entry)
        for run_id, dropped in dropped_by_run.items():
            entries = {raw.decode() for raw in self.client.smembers(self._key("runcp", thread_id, run_id))}
            if entries <= dropped:
                self._queue_forget_run(pipe, thread_id, run_id)

    def _queue_forget_run(self, pipe, thread_id: str, run_id: str) -> None:
        pipe.delete(self._key("runcp", thread_id, run_id))
        pipe.srem(self._key("runs", thread_id), run_id)
        pipe.srem(self._key("run", run_id), thread_id)
        pipe.srem(self._key("keys", thread_id), self._key("runcp", thread_id, run_id))

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

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        await asyncio.to_thread(self.copy_thread, source_thread_id, target_thread_id)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        await asyncio.to_thread(lambda: self.prune(thread_ids, strategy=strategy))

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        await asyncio.to_thread(self.delete_for_runs, run_ids)

    def get_next_version(self, current: str | None, channel: None) -> str:
        """Versions sort as strings: a zero-padded counter (the in-memory saver's scheme)."""
        number = 0 if current is None else (current if isinstance(current, int) else int(str(current).split(".")[0]))
        return f"{number + 1:032}.{0:016}"
