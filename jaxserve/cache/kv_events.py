"""KV-cache events in vLLM's wire format, so routers (vllm-router `kv_aware`, llm-d's KV-cache
indexer, Dynamo) can route by what a replica's prefix cache really holds.

Wire format (vllm/distributed/kv_events.py, `ZmqEventPublisher`), one ZMQ PUB multipart message a
batch: [topic (utf-8), sequence number (8 bytes, big-endian, from 0), msgpack payload]. The payload
is vLLM's `KVEventBatch` (msgspec, array_like): [ts: float64, [event, ...], data_parallel_rank].
Events are msgspec tagged structs; two encodings exist (`event_encoding`, a jaxserve key):

- "map" (default; vLLM since PR #42892, seen in 0.26): {"type": "BlockStored", "block_hashes": ...,
  "parent_block_hash": ..., "token_ids": ..., "block_size": ..., "lora_id": None, "medium": "GPU",
  "lora_name": None}, {"type": "BlockRemoved", "block_hashes": ..., "medium": "GPU"},
  {"type": "AllBlocksCleared"}. vllm-router 0.1.17 (kv_aware) reads only this one: it logs
  "KV event must be a tagged map" for arrays (tried here, 2026-12-05).
- "array" (vLLM 0.23 and earlier, msgspec array_like=True): the same fields by position, tag first,
  ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name].
llm-d's indexer and Dynamo read both. Fields vLLM leaves at their defaults (extra_keys, group_idx,
kv_cache_spec_*) are omitted, as msgspec's omit_defaults does. Block hashes are uint64
(block_hash.py says which hash); medium is "GPU", the name vLLM gives its device KV cache.

A ROUTER socket on `replay_endpoint` serves late joiners: a request [8-byte big-endian start
sequence] gets every buffered batch from it as [seq, payload] and then the end marker [-1 as 8
signed bytes, b""]; the last `buffer_steps` batches are kept.

Hot path: the radix cache appends plain tuples to a KVEventRecorder; once per engine step the
recorder hands them to its publisher's bounded queue without blocking (put_nowait). Encoding and
ZMQ run on the publisher's thread. A full queue drops the step's events and marks the recorder
out of sync; the next step that fits sends AllBlocksCleared and then the whole tree as
BlockStored events, so a subscriber's view is right again (vLLM's publisher blocks instead).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from jaxserve.cache.block_hash import BlockHasher

log = logging.getLogger(__name__)

MEDIUM = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)

# Raw events as the radix cache records them (cheap tuples; hashes still in internal form):
#   ("stored", hashes, parent_hash | None, token_ids, block_size)
#   ("removed", hashes)
#   ("cleared",)
RawEvent = tuple


@dataclass
class KVEventsConfig:
    """vLLM's --kv-events-config (vllm/config/kv_events.py), plus `event_encoding`."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" | "null"; None: "zmq" when enabled
    endpoint: str = "tcp://*:5557"  # '*', '::', ipc:// or inproc:// bind; anything else connects
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # ZMQ send high-water mark: past it, PUB drops for a slow subscriber
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""
    event_encoding: str = "map"  # jaxserve: "map" (vLLM since #42892) or "array" (vLLM <= 0.23)

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv-events publisher must be 'zmq' or 'null', got {self.publisher!r}")
        if self.event_encoding not in ("array", "map"):
            raise ValueError(f"kv-events event_encoding must be 'array' or 'map', got {self.event_encoding!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"kv-events {name} must be a positive integer, got {value!r}")

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, value: "str | dict[str, Any] | KVEventsConfig | None") -> "KVEventsConfig":
        """From the --kv-events-config JSON string (or a YAML mapping)."""
        if value is None:
            return cls()
        if isinstance(value, KVEventsConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"kv_events_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"kv_events_config must be a JSON object, got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(value) - known
        if unknown:
            raise ValueError(f"unknown kv_events_config key(s) {sorted(unknown)}; known: {sorted(known)}")
        return cls(**value)


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """Replica `rank`'s endpoint, as vLLM gives each data-parallel rank its own: tcp port + rank,
    inproc/ipc names + "_dp{rank}"."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://") and ":" in endpoint[len("tcp://"):]:
        base, port = endpoint.rsplit(":", 1)
        return f"{base}:{int(port) + rank}"
    raise ValueError(f"cannot give data-parallel rank {rank} its own endpoint from {endpoint!r}")


# ---- encoding (publisher thread) ---------------------------------------------------------------
def encode_event(raw: RawEvent, external: Callable[[Any], int], as_map: bool) -> Any:
    kind = raw[0]
    if kind == "stored":
        _, hashes, parent, token_ids, block_size = raw
        fields = (("block_hashes", [external(h) for h in hashes]),
                  ("parent_block_hash", None if parent is None else external(parent)),
                  ("token_ids", list(token_ids)), ("block_size", block_size),
                  ("lora_id", None), ("medium", MEDIUM), ("lora_name", None))
        tag = "BlockStored"
    elif kind == "removed":
        fields = (("block_hashes", [external(h) for h in raw[1]]), ("medium", MEDIUM))
        tag = "BlockRemoved"
    elif kind == "cleared":
        fields, tag = (), "AllBlocksCleared"
    else:
        raise ValueError(f"unknown KV event {kind!r}")
    if as_map:
        return {"type": tag, **dict(fields)}
    return [tag, *(v for _, v in fields)]


def encode_batch(ts: float, events: list[RawEvent], rank: int, external: Callable[[Any], int],
                 as_map: bool = False) -> bytes:
    import msgpack

    return msgpack.packb([ts, [encode_event(e, external, as_map) for e in events], rank], use_bin_type=True)


# ---- publishing --------------------------------------------------------------------------------
class ZmqEventPublisher:
    """PUB socket (+ optional ROUTER replay socket) fed from a bounded queue by one thread."""

    def __init__(self, config: KVEventsConfig, rank: int, external: Callable[[Any], int]):
        import zmq

        self.config = config
        self.rank = rank
        self._external = external
        self._as_map = config.event_encoding == "map"
        self._topic = config.topic.encode("utf-8")
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.endpoint = offset_endpoint(config.endpoint, rank)
        self.replay_endpoint = offset_endpoint(config.replay_endpoint, rank)
        self.dropped_batches = 0
        self.published_batches = 0
        ctx = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        if any(s in self.endpoint for s in ("*", "::")) or self.endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(self.endpoint)
        else:
            self._pub.connect(self.endpoint)
        self._replay = None
        if self.replay_endpoint:
            self._replay = ctx.socket(zmq.ROUTER)
            self._replay.bind(self.replay_endpoint)
        self._stop = threading.Event()
        # Sockets are created here and then used by the thread alone (ZMQ sockets are not thread-safe).
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{rank}", daemon=True)
        self._thread.start()
        log.info("KV events: replica %d publishes on %s%s", rank, self.endpoint,
                 f", replay on {self.replay_endpoint}" if self.replay_endpoint else "")

    def try_publish(self, events: list[RawEvent]) -> bool:
        """Queue one batch without blocking; False (batch dropped) when the queue is full."""
        try:
            self._queue.put_nowait((time.time(), events))
            return True
        except queue.Full:
            self.dropped_batches += 1
            return False

    def _run(self) -> None:
        seq = 0
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                item = self._queue.get(timeout=0.02)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            if item is None:
                self._queue.task_done()
                return
            ts, events = item
            try:
                payload = encode_batch(ts, events, self.rank, self._external, self._as_map)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                self.published_batches += 1
                seq += 1
            except Exception:  # noqa: BLE001 - a broken batch must not stop the stream
                log.exception("KV events: batch %d could not be published", seq)
            finally:
                self._queue.task_done()

    def drain(self, timeout: float = 5.0) -> bool:
        """Wait until every queued batch is published; whether that happened within `timeout` s."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline or not self._thread.is_alive():
                return False
            time.sleep(0.002)
        return True

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:  # [identity, b"", start] from a REQ socket
            log.warning("KV events: malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def close(self, timeout: float = 2.0) -> None:
        """Publish what is queued (for up to `timeout` s), then close the sockets."""
        self._stop.set()
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("KV events: replica %d's publisher did not drain in %.1f s", self.rank, timeout)
            return  # the thread still owns the sockets; it is a daemon and goes with the process
        self._pub.close(linger=500)  # a moment for the last batches to leave
        if self._replay is not None:
            self._replay.close(linger=0)


class KVEventRecorder:
    """One replica's events of the current step: the radix cache records, the engine flushes."""

    def __init__(self, hasher: BlockHasher, publisher: ZmqEventPublisher | None = None):
        self.hasher = hasher
        self.publisher = publisher
        # A replica's first batch says it holds nothing, as Dynamo's and llm-d's indexers expect
        # of a restarted worker: one that kept this endpoint's blocks from before drops them.
        self.pending: list[RawEvent] = [("cleared",)]
        self.snapshot: Callable[[], list[RawEvent]] | None = None  # set by the radix cache
        self.out_of_sync = False

    def stored(self, hashes: list, parent: Any, token_ids: Any, block_size: int) -> None:
        self.pending.append(("stored", hashes, parent, token_ids, block_size))

    def removed(self, hashes: list) -> None:
        self.pending.append(("removed", hashes))

    def cleared(self) -> None:
        self.pending.append(("cleared",))

    def flush(self) -> None:
        """Hand this step's events to the publisher (called once per engine step)."""
        if self.out_of_sync and self.snapshot is not None:
            events = [("cleared",), *self.snapshot()]  # the whole state replaces what was lost
        elif self.pending:
            events = self.pending
        else:
            return
        self.pending = []
        if self.publisher is None:
            return
        ok = self.publisher.try_publish(events)
        if not ok and not self.out_of_sync:
            log.warning("KV events: replica %d's queue is full (%d batches); events dropped, a full "
                        "resync follows", self.publisher.rank, self.publisher.config.max_queue_size)
        self.out_of_sync = not ok
