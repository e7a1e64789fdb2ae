"""The async engine: one thread owns the LLMEngine and steps it while there is work.

The event loop never runs model code. It sends commands (add, abort) through a queue; after
every step the engine thread hands the loop, in one ``loop.call_soon_threadsafe``, each running
request's new token ids and each finished request's output. Everything else per token —
detokenizing, building the pieces, waking the readers — runs on the loop, while the engine thread
waits for the device: the two share one GIL, and time the engine thread spends per token
stretches every step.

A reader that falls behind gets the pieces that piled up as one. A bounded waiting queue gives
back-pressure: when ``max_waiting_requests`` requests are already waiting for a slot, a new one
is refused (:class:`QueueFull`, a 503 with Retry-After) instead of queueing without limit.
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
from ..engine.outputs import RequestOutput
from ..engine.sampling import SamplingParams
from ..engine.streaming import IncrementalOutput, StreamOutput, merge
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
    with ``finished=True``. :meth:`abort` (idempotent) stops the request and frees its blocks.
    Everything here but :attr:`request_id` and :attr:`params` belongs to the event loop."""

    def __init__(self, engine: AsyncEngine, request_id: Hashable, params: SamplingParams,
                 loop: asyncio.AbstractEventLoop):
        self.engine, self.request_id, self.params = engine, request_id, params
        self.loop = loop
        self.accepted: asyncio.Future = loop.create_future()
        self.incremental = IncrementalOutput(request_id, params.stop, engine.engine.tokenizer,
                                             params.skip_special_tokens)
        self.finished = False  # the reader has the last piece (or an error), or aborted
        self._pending: list = []  # StreamOutputs, then possibly an exception
        self._waiter: asyncio.Future | None = None

    # event loop: filled by AsyncEngine._deliver (and by a timer, with an exception)
    def put(self, item: StreamOutput | BaseException) -> None:
        self._pending.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _accept(self, error: BaseException | None) -> None:
        if not self.accepted.done():
            self.accepted.set_exception(error) if error else self.accepted.set_result(True)

    def __aiter__(self):
        return self

    async def __anext__(self) -> StreamOutput:
        if self.finished:
            raise StopAsyncIteration
        while not self._pending:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        pending = self._pending
        if isinstance(pending[0], BaseException):
            self.finished = True
            self._pending = []
            raise pending[0]
        n = next((i for i, p in enumerate(pending) if isinstance(p, BaseException)), len(pending))
        piece, self._pending = merge(pending[:n]), pending[n:]
        self.finished = piece.finished
        return piece

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
        # engine thread only: the running requests' streams and how many tokens each was sent
        self._streams: dict[Hashable, RequestStream] = {}
        self._sent: dict[Hashable, int] = {}
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

    @staticmethod
    def _deliver(updates: list[tuple[RequestStream, object]]) -> None:
        """On the loop: each stream's new token ids (a list), final output or error."""
        for stream, x in updates:
            if stream.finished:  # aborted by its reader meanwhile
                continue
            if isinstance(x, list):
                piece = stream.incremental.add_tokens(x)
                if piece is not None:
                    stream.put(piece)
            elif isinstance(x, RequestOutput):
                stream.put(stream.incremental.finish(x))
            else:
                stream.put(x)

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
                t = time.perf_counter()
                outputs = engine.step()
                self.metrics.observe_step(time.perf_counter() - t, engine.runner.last_graph_bucket is not None)
            except Exception as e:  # a bug, not the input: fail what is running, keep serving
                logger.exception("engine step failed; aborting the %d running requests", len(self._streams))
                self._fail_all(EngineError(f"the engine failed: {type(e).__name__}: {e}"))
                continue
            self.num_steps += 1
            # counts first: a client that gets its answer may send the next request at once
            self._publish()
            updates = []
            for out in outputs:
                stream = self._streams.pop(out.request_id, None)
                self._sent.pop(out.request_id, None)
                self.metrics.observe_finished(out)
                if stream is not None:
                    updates.append((stream, out))
            for rid, stream in self._streams.items():
                new = engine.request_token_ids(rid, self._sent[rid])
                if new:
                    self._sent[rid] += len(new)
                    updates.append((stream, new))
            self._send(updates)
        self._fail_all(EngineError("the server is shutting down"))

    def _send(self, updates: list[tuple[RequestStream, object]]) -> None:
        """Hand one step's updates to their loops, one call per loop."""
        if not updates:
            return
        loop = updates[0][0].loop
        if any(s.loop is not loop for s, _ in updates):  # streams of several loops
            for lp in {s.loop for s, _ in updates}:
                self._call(lp, self._deliver, [u for u in updates if u[0].loop is lp])
        else:
            self._call(loop, self._deliver, updates)

    @staticmethod
    def _call(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

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
                self._sent.pop(obj, None)

    def _add(self, stream: RequestStream, prompt) -> None:
        try:
            self.engine.add_request(stream.request_id, prompt, stream.params)
        except Exception as e:  # ValueError: what the client asked for; anything else: ours
            self._call(stream.loop, stream._accept, e)
        else:
            self._streams[stream.request_id] = stream
            self._sent[stream.request_id] = 0
            self._call(stream.loop, stream._accept, None)
        finally:
            with self._lock:
                self._pending -= 1
                self.num_waiting = len(self.engine.scheduler.waiting)

    def _fail_all(self, error: Exception) -> None:
        updates = []
        for rid, stream in list(self._streams.items()):
            self.engine.abort_request(rid)
            updates.append((stream, error))
        self._streams.clear()
        self._sent.clear()
        self._send(updates)
        self._publish()

    def _publish(self) -> None:
        sched = self.engine.scheduler
        with self._lock:
            self.num_running = len(sched.running)
            self.num_waiting = len(sched.waiting)
        self.kv_cache_usage = self.engine.block_manager.usage
        self.metrics.num_preemptions = sched.stats.num_preemptions
        self.metrics.last_step_time = time.time()
