"""AsyncEngine: the asyncio face of the engine, for the servers.

One thread owns the device and loops: apply pending aborts, run a step, hand each request's output
to its asyncio queue. Submissions take a lock that the loop holds only around a step, so validation
errors reach the caller directly; aborts are queued and applied before the next step, so a
cancelled request's pages are free before anything else runs.

Multi-host, the thread is also the only one that talks to the followers: it sends keep-alives while
idle and STOP when it ends. A failed step is fatal there (the followers may be inside a step the
leader abandoned), as is any error outside a step anywhere: the engine then fails every request,
stops and calls ``on_fatal``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Sequence

from jaxserve.config import EngineConfig
from jaxserve.engine.engine import LLMEngine, RequestOutput
from jaxserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int


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
        self._streams: dict[str, _Stream] = {}
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
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield incremental outputs until the request finishes. With n > 1, each completion's
        outputs arrive tagged with its index (outputs[0].index). Leaving the loop aborts the request."""
        if not self.accepting:
            raise EngineDeadError("the engine is shutting down")
        arrival = time.monotonic()  # before waiting for the engine's lock: that wait is queueing too
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        request_id = request_id or self.engine.new_request_id()
        sub_ids = [request_id] if params.n == 1 else [f"{request_id}-{i}" for i in range(params.n)]
        await loop.run_in_executor(None, self._submit, request_id, sub_ids, prompt, params, priority, loop, queue,
                                   arrival)
        remaining = set(sub_ids)
        try:
            while remaining:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    remaining.discard(item.request_id)
                yield item
        finally:
            for sub in remaining:
                self.abort(sub)

    def abort(self, request_id: str) -> None:
        """Abort a request (or all completions of an n > 1 request); pages are freed before the next step."""
        for rid in [r for r in list(self._streams) if r == request_id or r.startswith(request_id + "-")]:
            self._aborts.append(rid)
        self._wake.set()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def shutdown(self) -> None:
        """Stop after the step in progress (the thread then releases any multi-host followers)."""
        self.accepting = False
        self._stopped = True
        self._wake.set()
        self._thread.join()

    # ---- engine thread ----------------------------------------------------------------------
    def _submit(self, request_id, sub_ids, prompt, params, priority, loop, queue, arrival) -> None:
        with self._count_lock:
            self._pending_submits += 1
        try:
            self._lock.acquire()
        finally:
            with self._count_lock:
                self._pending_submits -= 1
        with _Held(self._lock):
            if self._stopped:  # the loop is gone: nothing would ever serve this request
                raise EngineDeadError("the engine has stopped")
            added = []
            try:
                for i, rid in enumerate(sub_ids):
                    if rid in self._streams:
                        raise ValueError(f"request_id {rid!r} is already in use")
                    self.engine.add_request(rid, prompt, params, priority=priority, seed_offset=i,
                                            group_id=request_id if len(sub_ids) > 1 else None,
                                            arrival_time=arrival)
                    self._streams[rid] = _Stream(loop, queue, i)
                    added.append(rid)
            except BaseException:
                for rid in added:
                    self.engine.abort(rid)
                    self._streams.pop(rid, None)
                raise
        self._wake.set()

    def _deliver(self, rid: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(rid)
        if stream is None:
            return
        if isinstance(item, RequestOutput):
            item.outputs[0].index = stream.index
            if item.finished:
                self._streams.pop(rid, None)
        else:
            self._streams.pop(rid, None)
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the client's event loop is gone
            pass

    def _loop(self) -> None:
        try:
            while not self._stopped:
                with self._lock:
                    while self._aborts:
                        rid = self._aborts.popleft()
                        self.engine.abort(rid)
                        self._streams.pop(rid, None)
                    busy = self.engine.has_unfinished()
                    if busy:
                        try:
                            outputs = self.engine.step()
                            self.step_count += 1
                        except Exception as exc:  # report to the requests in flight
                            log.exception("engine step failed")
                            self._fail_all(RuntimeError(f"engine step failed: {exc}"))
                            if self.engine.multihost:
                                raise  # the followers may be inside the step we abandoned
                            outputs = []  # single host: keep serving
                        for out in outputs:
                            self._deliver(out.request_id, out)
                    else:
                        self.engine.keep_followers_alive()
                if not busy:
                    self._wake.wait(0.05)
                    self._wake.clear()
                while self._pending_submits and not self._stopped:
                    time.sleep(0.0002)  # a plain Lock is not fair: let submitters in between steps
            with self._lock:
                self._fail_all(EngineDeadError("the server is shutting down"))
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
