"""The front end's view of the engine: requests in, per-request streams of pieces out.

The engine runs elsewhere (:class:`tqattn.serve.engine_loop.EngineLoop`, in the server's main
process); this side sends it commands over one pipe and reads its per-step messages from another
in a reader thread, which hands each message to the event loop in one
``loop.call_soon_threadsafe``. Everything per token — detokenizing, building the pieces, waking
the readers — runs on the loop, in the front end's process.

A reader that falls behind gets the pieces that piled up as one. A bounded waiting queue gives
back-pressure: when ``max_waiting_requests`` requests are already waiting for a slot, a new one
is refused (:class:`QueueFull`, a 503 with Retry-After) instead of queueing without limit.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Callable, Hashable

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


def check_max_waiting_requests(n) -> None:
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"max_waiting_requests must be a positive integer, got {n!r}")


class EngineError(RuntimeError):
    """The engine failed while running a step, or stopped; the request was aborted."""


class EngineStopped(EngineError):
    """The engine is shutting down or has stopped: not the request's fault, worth retrying (503)."""


class RequestStream:
    """One request's pieces as they come: ``async for piece in stream`` (StreamOutput), the last
    with ``finished=True``. :meth:`abort` (idempotent) stops the request and frees its blocks.
    Everything here but :attr:`request_id` and :attr:`params` belongs to the event loop."""

    def __init__(self, engine: AsyncEngine, request_id: Hashable, params: SamplingParams,
                 loop: asyncio.AbstractEventLoop):
        self.engine, self.request_id, self.params = engine, request_id, params
        self.loop = loop
        self.accepted: asyncio.Future = loop.create_future()
        self.incremental = IncrementalOutput(request_id, params.stop, engine.tokenizer,
                                             params.skip_special_tokens)
        self.finished = False  # the reader has the last piece (or an error), or aborted
        self._pending: list = []  # StreamOutputs, then possibly an exception
        self._waiter: asyncio.Future | None = None

    # event loop: filled by AsyncEngine._receive (and by a timer, with an exception)
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
    """commands / events: the ends of the pipes to an EngineLoop (multiprocessing Connections);
    tokenizer: the engine's (prompts and chat templates are encoded here, outputs decoded here)."""

    def __init__(self, commands, events, tokenizer, max_model_len: int,
                 max_waiting_requests: int = 256, metrics: ServerMetrics | None = None,
                 max_num_seqs: int | None = None):
        check_max_waiting_requests(max_waiting_requests)
        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        self.max_waiting_requests = max_waiting_requests
        self.max_num_seqs = max_num_seqs  # the engine's running slots; None: count none free
        self.metrics = metrics or ServerMetrics()
        self._commands, self._events = commands, events
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="tqattn-engine-events", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[Hashable, RequestStream] = {}  # loop only
        self._pending = 0  # adds sent and not answered yet (loop only)
        self._closed = False  # the engine's pipe ended
        self.on_closed: Callable[[], None] | None = None  # called from the reader thread
        # the engine's counts, from its last message
        self.num_running = self.num_waiting = self.compilations = 0
        self.kv_cache_usage = 0.0
        self.num_steps = 0

    def start(self) -> None:
        self._reader.start()

    @property
    def is_alive(self) -> bool:
        return not self._closed

    async def add_request(self, prompt: str | dict, params: SamplingParams,
                          request_id: Hashable | None = None) -> RequestStream:
        """Queue a request; returns once the engine accepted it (raises ValueError if the engine
        refuses it, QueueFull if the waiting queue is full, EngineError if it has stopped)."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif loop is not self._loop:
            raise RuntimeError("an AsyncEngine serves one event loop")
        if self._closed:
            raise EngineStopped("the engine loop is not running")
        waiting = self.num_waiting_for_slot()
        if waiting >= self.max_waiting_requests:
            self.metrics.num_rejected += 1
            raise QueueFull(waiting)
        prompt = self._encoded(prompt)
        stream = RequestStream(self, request_id or uuid.uuid4().hex, params, loop)
        self._send(("add", stream.request_id, prompt, params))
        self._streams[stream.request_id] = stream
        self._pending += 1
        try:
            await stream.accepted
        except asyncio.CancelledError:  # the client left before the engine took the request
            stream.abort()
            raise
        return stream

    def num_waiting_for_slot(self) -> int:
        """Requests that would wait for a running slot: the engine's waiting ones, plus the adds
        it has not answered yet beyond the slots it has free (none while some already wait)."""
        free = 0
        if self.num_waiting == 0 and self.max_num_seqs is not None:
            free = max(0, self.max_num_seqs - self.num_running)
        return self.num_waiting + max(0, self._pending - free)

    def _encoded(self, prompt):
        """A text prompt as text and token ids (as LLMEngine.encode makes them): the engine's
        process then spends no time on tokenizing."""
        tok = self.tokenizer
        if tok is not None and isinstance(prompt, str):
            return {"prompt": prompt, "prompt_token_ids": list(tok.encode(prompt))}
        if tok is not None and isinstance(prompt, dict) and "prompt_token_ids" not in prompt \
                and isinstance(prompt.get("prompt"), str):
            return {**prompt, "prompt_token_ids": list(tok.encode(prompt["prompt"]))}
        return prompt

    def abort(self, request_id: Hashable) -> None:
        self._streams.pop(request_id, None)
        try:
            self._send(("abort", request_id))
        except EngineError:  # nothing runs any more
            pass

    def _send(self, command: tuple) -> None:
        try:
            with self._send_lock:
                self._commands.send(command)
        except (BrokenPipeError, EOFError, OSError):  # the engine's side has gone
            self._closed = True
            raise EngineStopped("the engine loop is not running") from None

    # ---- reader thread -----------------------------------------------------------------------------

    def _read(self) -> None:
        while True:
            try:
                message = self._events.recv()
            except (EOFError, OSError):
                break
            except Exception:  # a message we cannot read: a bug on the other side
                logger.exception("unreadable message from the engine loop")
                continue
            loop = self._loop
            if loop is None:  # no request yet: only the counts matter
                self._counts(message[1])
                continue
            try:
                loop.call_soon_threadsafe(self._receive, message)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                break
        self._closed = True
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._fail_all, "the engine loop has stopped")
            except RuntimeError:
                pass
        if self.on_closed is not None:
            self.on_closed()

    # ---- event loop --------------------------------------------------------------------------------

    def _counts(self, stats: dict) -> None:
        self.num_running, self.num_waiting = stats["num_running"], stats["num_waiting"]
        self.kv_cache_usage, self.compilations = stats["kv_cache_usage"], stats["compilations"]
        self.metrics.num_aborted, self.metrics.num_preemptions = stats["num_aborted"], stats["num_preemptions"]

    def _receive(self, message) -> None:
        """One engine message: counts first (a client that gets its answer may send the next
        request at once), then each stream's news."""
        updates, stats, step = message
        self._counts(stats)
        if step is not None:
            self.num_steps += 1
            self.metrics.observe_step(*step)
        streams = self._streams
        for rid, kind, x in updates:
            if kind == "finished":
                self.metrics.observe_finished(x)
            elif kind in ("accepted", "refused"):
                self._pending -= 1
            stream = streams.get(rid)
            if stream is None or stream.finished:  # aborted by its reader meanwhile
                continue
            try:
                self._update(stream, kind, x)
            except Exception as e:  # e.g. the tokenizer: this request fails, the others go on
                logger.exception("request %r: its output could not be built", rid)
                self.abort(rid)  # the engine frees it; the reader still gets the error
                error = EngineError(f"internal error: {type(e).__name__}: {e}")
                stream._accept(error)
                stream.put(error)

    def _update(self, stream: RequestStream, kind: str, x) -> None:
        if kind == "tokens":
            piece = stream.incremental.add_tokens(x)
            if piece is not None:
                stream.put(piece)
        elif kind == "finished":
            del self._streams[stream.request_id]
            stream.put(stream.incremental.finish(x))
        elif kind == "accepted":
            stream._accept(None)
        elif kind == "refused":
            del self._streams[stream.request_id]
            message, client_error = x
            stream._accept(message if isinstance(message, ValueError) else ValueError(message)
                           if client_error else RuntimeError(f"the engine could not add the request: {message}"))
        else:  # failed (a bug), or stopped (shutting down)
            del self._streams[stream.request_id]
            stream.put((EngineStopped if kind == "stopped" else EngineError)(x))

    def _fail_all(self, message: str) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            if not stream.accepted.done():
                stream._accept(EngineStopped(message))
            else:
                stream.put(EngineStopped(message))
