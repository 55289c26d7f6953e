"""AsyncEngine: the asyncio face of the engine, for the servers.

One thread owns the device and loops: apply pending aborts, run a step, hand each request's output
to its asyncio queue. Submissions take a lock that the loop holds only around a step, so validation
errors reach the caller directly; aborts are queued and applied before the next step, so a
cancelled request's pages are free before anything else runs.

Ids: every request gets a server id of its own (``s<N>``, siblings of an n > 1 request
``s<N>.<i>``), so no client can name, and so abort, another client's request; the id a client
gives is a label, unique among the requests in flight (a duplicate is refused) and echoed back.
Every stream ends with a finished output or an exception, whatever removed the request.

Multi-host, the thread is also the only one that talks to the followers: it sends keep-alives while
idle and STOP when it ends. A failed step is fatal there (the followers may be inside a step the
leader abandoned), as is any error outside a step anywhere: the engine then fails every request,
stops and calls ``on_fatal``.
"""

from __future__ import annotations

import asyncio
import logging
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Sequence

from jaxserve.config import EngineConfig
from jaxserve.engine.engine import CompletionOutput, LLMEngine, RequestOutput
from jaxserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int
    label: str  # what the client knows the request by (its own id, or the server id)


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None,
                 show_progress: bool = True, on_fatal: Callable[[BaseException], None] | None = None):
        self.engine = engine or LLMEngine(config or EngineConfig(), show_progress=show_progress)
        self.on_fatal = on_fatal
        self.fatal_error: BaseException | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._aborts: deque[str] = deque()
        self._streams: dict[str, _Stream] = {}  # server (sub-)id -> its consumer
        self._labels: dict[str, str] = {}  # label of a request in flight -> its server id
        self._ids = itertools.count()
        self._stopped = False
        self._count_lock = threading.Lock()
        self._pending_submits = 0  # submitters waiting for the lock: the loop lets them in first
        self.accepting = True
        self.step_count = 0
        self._thread = threading.Thread(target=self._loop, name="jaxserve-engine", daemon=True)
        self._thread.start()

    # ---- public API -------------------------------------------------------------------------
    async def generate(
        self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None,
        priority: int = 0, prompt_text: str | None = None, cumulative: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """Yield incremental outputs until the request finishes. With n > 1, each completion's
        outputs arrive tagged with its index (outputs[0].index). `request_id` is the client's
        label (unique among requests in flight); outputs carry it as their request_id. Leaving
        the loop aborts the request. `prompt_text`: the text token-id `prompt` came from.
        `cumulative=False`: outputs before the final one carry only their deltas (see
        LLMEngine.add_request)."""
        if not self.accepting:
            raise EngineDeadError("the engine is shutting down")
        arrival = time.monotonic()  # before waiting for the engine's lock: that wait is queueing too
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        with self._count_lock:
            server_id = f"s{next(self._ids)}"
        label = request_id or server_id
        sub_ids = [server_id] if params.n == 1 else [f"{server_id}.{i}" for i in range(params.n)]
        submit = loop.run_in_executor(None, self._submit, server_id, label, request_id is not None, sub_ids, prompt,
                                      params, priority, loop, queue, arrival, prompt_text, cumulative)
        try:
            await asyncio.shield(submit)
        except asyncio.CancelledError:  # the client left while we waited for the lock: undo it once it lands

            def undo(f: asyncio.Future) -> None:
                if not f.cancelled() and f.exception() is None:
                    self._abort_subs(sub_ids)
                self._release_label(label, server_id)

            submit.add_done_callback(undo)
            raise
        remaining = set(range(len(sub_ids)))
        try:
            while remaining:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    remaining.discard(item.outputs[0].index)
                yield item
        finally:
            self._abort_subs([sub_ids[i] for i in remaining])
            self._release_label(label, server_id)

    def abort(self, request_id: str) -> None:
        """Abort the request (all n completions) whose label or server id is exactly `request_id`;
        pages are freed before the next step and its stream ends with finish_reason "abort"."""
        with self._count_lock:
            server_id = self._labels.get(request_id, request_id)
        self._abort_subs([rid for rid in list(self._streams) if rid == server_id or rid.startswith(server_id + ".")])

    def _abort_subs(self, sub_ids: list[str]) -> None:
        if sub_ids:
            self._aborts.extend(sub_ids)
            self._wake.set()

    def _release_label(self, label: str, server_id: str) -> None:
        with self._count_lock:
            if self._labels.get(label) == server_id:
                del self._labels[label]

    def check_invariants(self) -> dict[str, int]:
        """Page-pool and prefix-cache invariants, checked between steps; page counts (for tests)."""
        self._acquire_between_steps()
        with _Held(self._lock):
            self.engine.check_invariants()
            e = self.engine
            cached = sum(r.prefix_cache.cached_pages() for r in e.replicas if r.prefix_cache is not None)
            evictable = sum(r.prefix_cache.evictable_pages() for r in e.replicas if r.prefix_cache is not None)
            return {"used_pages": e.num_used_pages, "cached_pages": cached, "evictable_pages": evictable,
                    "running": e.num_running, "waiting": e.num_waiting, "streams": len(self._streams)}

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def shutdown(self) -> None:
        """Stop after the step in progress (the thread then releases any multi-host followers)."""
        self.accepting = False
        self._stopped = True
        self._wake.set()
        self._thread.join()
        close = getattr(self.engine, "close", None)  # test doubles may have none
        if close is not None:
            close()  # the last KV events out, their sockets closed

    def _acquire_between_steps(self, counted: bool = False) -> None:
        """Take the engine lock between two steps: the loop re-takes a plain Lock at once, so it
        yields only while someone is counted as waiting. `counted`: the caller already counted
        itself (under _count_lock, with other bookkeeping)."""
        if not counted:
            with self._count_lock:
                self._pending_submits += 1
        try:
            self._lock.acquire()
        finally:
            with self._count_lock:
                self._pending_submits -= 1

    # ---- engine thread ----------------------------------------------------------------------
    def _submit(self, server_id, label, client_label, sub_ids, prompt, params, priority, loop, queue, arrival,
                prompt_text, cumulative) -> None:
        if params.structured_outputs is not None:
            # Compile the grammar here, outside the engine's lock (cached): add_request then only
            # copies it, and a grammar that does not compile fails before anything is queued.
            self.engine.grammars.compile(params.structured_outputs)
        with self._count_lock:
            if client_label:  # only clients' own ids are labels to look up (server ids are unique already)
                if label in self._labels:
                    raise ValueError(f"request_id {label!r} is already in use")
                self._labels[label] = server_id
            self._pending_submits += 1  # counted with the label, under one lock
        try:
            self._acquire_between_steps(counted=True)
        except BaseException:
            self._release_label(label, server_id)
            raise
        with _Held(self._lock):
            added = []
            try:
                if self._stopped:  # the loop is gone: nothing would ever serve this request
                    raise EngineDeadError("the engine has stopped")
                for i, rid in enumerate(sub_ids):
                    self.engine.add_request(rid, prompt, params, priority=priority, seed_offset=i,
                                            group_id=server_id if len(sub_ids) > 1 else None,
                                            arrival_time=arrival, prompt_text=prompt_text,
                                            cumulative=cumulative)
                    self._streams[rid] = _Stream(loop, queue, i, label)
                    added.append(rid)
            except BaseException:
                for rid in added:
                    self.engine.abort(rid)
                    self._streams.pop(rid, None)
                self._release_label(label, server_id)
                raise
        self._wake.set()

    def _deliver(self, rid: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(rid)
        if stream is None:
            return
        if isinstance(item, RequestOutput):
            item.outputs[0].index = stream.index
            item.request_id = stream.label
            if item.finished:
                self._streams.pop(rid, None)
        else:
            self._streams.pop(rid, None)
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the client's event loop is gone
            pass

    def _end(self, rid: str) -> None:
        """Close a stream whose request the engine no longer has with a final "abort" output,
        so its consumer never waits for ever. Lock held."""
        if rid in self._streams:
            self._deliver(rid, RequestOutput(rid, None, [], [CompletionOutput(0, "", [], "abort")], True))

    def _sweep(self) -> None:
        """Streams whose request left the engine without a finished output (whatever removed it)."""
        tracked = getattr(self.engine, "_tracked", None)
        if tracked is None:
            return
        for rid in [r for r in self._streams if r not in tracked]:
            self._end(rid)

    def _loop(self) -> None:
        try:
            while not self._stopped:
                with self._lock:
                    while self._aborts:
                        rid = self._aborts.popleft()
                        self.engine.abort(rid)
                        self._end(rid)  # a consumer that left drops it; any other one ends
                    busy = self.engine.has_unfinished()
                    if busy:
                        try:
                            outputs = self.engine.step()
                            self.step_count += 1
                        except Exception as exc:  # report to the requests in flight
                            log.exception("engine step failed")
                            self._fail_all(RuntimeError(f"engine step failed: {exc}"))
                            self.engine.discard_in_flight()
                            if self.engine.multihost:
                                raise  # the followers may be inside the step we abandoned
                            outputs = []  # single host: keep serving
                        for out in outputs:
                            self._deliver(out.request_id, out)
                        self._sweep()
                    else:
                        self.engine.keep_followers_alive()
                if not busy:
                    self._wake.wait(0.05)
                    self._wake.clear()
                while self._pending_submits and not self._stopped:
                    time.sleep(0.0002)  # a plain Lock is not fair: let submitters in between steps
            with self._lock:
                self._fail_all(EngineDeadError("the server is shutting down"))
                self.engine.discard_in_flight()
                self.engine.stop_followers()
        except BaseException as exc:  # nothing may end this thread silently: requests would hang
            self._die(exc)

    def _fail_all(self, error: BaseException) -> None:
        """Abort every request in flight (freeing its pages) and send it `error`. Lock held."""
        for rid in list(self._streams):
            try:
                self.engine.abort(rid)
            finally:  # the caller hears of it even if the engine is broken
                self._deliver(rid, error)

    def _die(self, exc: BaseException) -> None:
        log.error("the engine stopped: %s: %s", type(exc).__name__, exc)
        self.accepting = False
        self._stopped = True
        self.fatal_error = exc
        try:
            with self._lock:
                self._fail_all(EngineDeadError(f"the engine stopped: {exc}"))
        except Exception:
            log.exception("failing the requests in flight failed")
        finally:
            if self.on_fatal is not None:
                try:
                    self.on_fatal(exc)
                except Exception:
                    log.exception("on_fatal failed")


class _Held:
    """Context manager releasing an already-acquired lock."""

    def __init__(self, lock: threading.Lock):
        self.lock = lock

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        self.lock.release()
