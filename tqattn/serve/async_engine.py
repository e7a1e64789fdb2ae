"""The async engine: one thread owns the LLMEngine and steps it while there is work.

The event loop never runs model code. It sends commands (add, abort) through a queue and reads each
request's pieces from that request's own asyncio queue, which the engine thread fills with
``loop.call_soon_threadsafe`` after every step. A bounded waiting queue gives back-pressure: when
``max_waiting_requests`` requests are already waiting for a slot, a new one is refused
(:class:`QueueFull`, a 503 with Retry-After) instead of queueing without limit.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import Hashable

from ..engine.llm_engine import LLMEngine
from ..engine.sampling import SamplingParams
from ..engine.streaming import IncrementalOutput, StreamOutput
from .metrics import ServerMetrics

logger = logging.getLogger(__name__)


class QueueFull(Exception):
    """The waiting queue is full; the client should retry after ``retry_after`` seconds."""

    def __init__(self, num_waiting: int, retry_after: int = 1):
        super().__init__(f"the server is at capacity: {num_waiting} requests are waiting for a "
                         f"slot (--max-waiting-requests); retry after {retry_after} s")
        self.retry_after = retry_after


class EngineError(RuntimeError):
    """The engine failed while running a step; the request was aborted."""


class RequestStream:
    """One request's pieces as they come: ``async for piece in stream`` (StreamOutput), the last
    with ``finished=True``. :meth:`abort` (idempotent) stops the request and frees its blocks."""

    def __init__(self, engine: AsyncEngine, request_id: Hashable, params: SamplingParams,
                 loop: asyncio.AbstractEventLoop):
        self.engine, self.request_id, self.params = engine, request_id, params
        self.loop = loop
        self.accepted: asyncio.Future = loop.create_future()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.incremental = IncrementalOutput(request_id, params.stop)
        self.finished = False

    # engine thread -> event loop
    def _send(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _accept(self, error: BaseException | None) -> None:
        def set_result():
            if not self.accepted.done():
                self.accepted.set_exception(error) if error else self.accepted.set_result(True)
        try:
            self.loop.call_soon_threadsafe(set_result)
        except RuntimeError:
            pass

    def __aiter__(self):
        return self

    async def __anext__(self) -> StreamOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting_requests: int = 256,
                 metrics: ServerMetrics | None = None):
        if not isinstance(max_waiting_requests, int) or max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be a positive integer, got {max_waiting_requests!r}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.metrics = metrics or ServerMetrics()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._pending = 0  # adds sent to the engine thread and not yet taken
        self._streams: dict[Hashable, RequestStream] = {}  # engine thread only
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="tqattn-engine", daemon=True)
        # published by the engine thread after every step, read by /metrics and admission
        self.num_running = 0
        self.num_waiting = 0
        self.kv_cache_usage = 0.0
        self.num_steps = 0

    # ---- event-loop side ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    async def add_request(self, prompt: str | dict, params: SamplingParams,
                          request_id: Hashable | None = None) -> RequestStream:
        """Queue a request; returns once the engine accepted it (raises ValueError if the engine
        refuses it, QueueFull if the waiting queue is full)."""
        if not self.is_alive:
            raise EngineError("the engine loop is not running")
        with self._lock:
            waiting = self._pending + self.num_waiting
            if waiting >= self.max_waiting_requests:
                self.metrics.num_rejected += 1
                raise QueueFull(waiting)
            self._pending += 1
        stream = RequestStream(self, request_id or uuid.uuid4().hex, params, asyncio.get_running_loop())
        self._commands.put(("add", stream, prompt))
        self._wake.set()
        try:
            await stream.accepted
        except asyncio.CancelledError:  # the client left before the engine took the request
            stream.abort()
            raise
        return stream

    def abort(self, request_id: Hashable) -> None:
        self._commands.put(("abort", request_id, None))
        self._wake.set()

    # ---- engine thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while not self._stopping:
            self._take_commands()
            if not engine.has_unfinished_requests():
                self._publish()
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # a bug, not the input: fail what is running, keep serving
                logger.exception("engine step failed; aborting the %d running requests", len(self._streams))
                self._fail_all(EngineError(f"the engine failed: {type(e).__name__}: {e}"))
                continue
            self.num_steps += 1
            # counts first: a client that gets its answer may send the next request at once
            self._publish()
            for out in outputs:
                stream = self._streams.pop(out.request_id, None)
                self.metrics.observe_finished(out)
                if stream is not None:
                    stream._send(stream.incremental.finish(out))
            for rid, stream in self._streams.items():
                progress = engine.request_progress(rid)
                piece = stream.incremental.update(*progress) if progress is not None else None
                if piece is not None:
                    stream._send(piece)
            self._publish()
        self._fail_all(EngineError("the server is shutting down"))

    def _take_commands(self) -> None:
        while True:
            try:
                kind, obj, prompt = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._add(obj, prompt)
            else:
                if self.engine.abort_request(obj):
                    self.metrics.num_aborted += 1
                self._streams.pop(obj, None)

    def _add(self, stream: RequestStream, prompt) -> None:
        try:
            self.engine.add_request(stream.request_id, prompt, stream.params)
        except Exception as e:  # ValueError: what the client asked for; anything else: ours
            stream._accept(e)
        else:
            self._streams[stream.request_id] = stream
            stream._accept(None)
        finally:
            with self._lock:
                self._pending -= 1
                self.num_waiting = len(self.engine.scheduler.waiting)

    def _fail_all(self, error: Exception) -> None:
        for rid, stream in list(self._streams.items()):
            self.engine.abort_request(rid)
            stream._send(error)
        self._streams.clear()
        self._publish()

    def _publish(self) -> None:
        sched = self.engine.scheduler
        with self._lock:
            self.num_running = len(sched.running)
            self.num_waiting = len(sched.waiting)
        self.kv_cache_usage = self.engine.block_manager.usage
        self.metrics.num_preemptions = self.engine.stats()["num_preemptions"]
        self.metrics.last_step_time = time.time()
