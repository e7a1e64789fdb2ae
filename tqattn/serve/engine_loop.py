"""The engine side of the server: one thread owns the LLMEngine and steps it while there is work.

The HTTP front end (:mod:`tqattn.serve.frontend`) runs in its own process, so that its per-token
work — detokenizing, building events, writing sockets — never holds this process's GIL while the
engine builds and launches a step. The two talk over two one-way pipes:

* commands in (a reader thread queues them for the engine thread): ``("add", rid, prompt,
  params)``, ``("abort", rid)``, and ``("ready",)`` once the front end listens;
* one message out per engine step, and one per batch of commands taken while idle:
  ``(updates, stats, step)`` with ``updates`` a list of ``(rid, kind, payload)`` — ``accepted``
  (None), ``refused`` ((the RequestError or a message, whether it is the client's error: a
  ValueError)), ``tokens``
  (the new token ids), ``finished`` (the :class:`RequestOutput`), ``failed`` (a message) —,
  ``stats`` the counts the front end admits by and reports, and ``step`` the step's (seconds,
  whether it replayed a CUDA graph) or None.

Every finished request's output goes out, aborted or not listened to, so that the front end's
metrics count it. When the loop stops, the requests still running fail ("the server is shutting
down") and the out pipe closes: the front end sees end-of-file and exits. When the front end's
pipe ends (it exited or was killed), the loop aborts what runs and stops.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Hashable

from ..engine.llm_engine import LLMEngine
from ..engine.scheduler import RequestError

logger = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, engine: LLMEngine, events, commands):
        self.engine = engine
        self._events, self._commands = events, commands  # multiprocessing Connections
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self.ready = threading.Event()  # the front end said it listens
        self._sent: dict[Hashable, int] = {}  # running requests: output tokens sent so far
        self._stopping = False
        self.num_steps = 0
        self.num_aborted = 0  # requests aborted while they ran or waited
        self._thread = threading.Thread(target=self._run, name="tqattn-engine", daemon=True)
        self._reader = threading.Thread(target=self._read, name="tqattn-engine-commands", daemon=True)

    def start(self) -> None:
        self._reader.start()
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> bool:
        """Stop stepping (what runs fails), close the out pipe; False if the engine thread is
        still inside a step or a send after ``timeout`` (the pipe then stays open)."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        self._events.close()
        if self._reader.is_alive():
            self._reader.join(1.0)
        return True

    def close(self) -> None:
        """Release the pipes (after shutdown)."""
        self._events.close()
        self._commands.close()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _read(self) -> None:
        # polls, so that it ends with the loop: a thread left blocked in a read when the
        # interpreter exits can abort the process (std::terminate during its teardown)
        while not self._stopping:
            try:
                if not self._commands.poll(0.2):
                    continue
                command = self._commands.recv()
            except (EOFError, OSError):  # the front end has gone: nobody can reach us any more
                self._queue.put(("gone",))
                self._wake.set()
                return
            except Exception:  # a message we cannot read: a bug on the other side
                logger.exception("unreadable command from the front end")
                continue
            if command[0] == "ready":
                self.ready.set()
                continue
            self._queue.put(command)
            self._wake.set()

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                updates, took = self._take_commands()
                if not engine.has_unfinished_requests():
                    if took:  # accepted / refused requests, or counts that aborts changed
                        self._send(updates, None)
                    if self._stopping:
                        break
                    self._wake.wait()
                    self._wake.clear()
                    continue
                try:
                    t = time.perf_counter()
                    outputs = engine.step()
                    step = (time.perf_counter() - t, engine.runner.last_graph_bucket is not None)
                except Exception as e:  # a bug, not the input: fail what runs, keep serving
                    logger.exception("engine step failed; aborting the %d running requests", len(self._sent))
                    self._send(updates + self._fail_all(f"the engine failed: {type(e).__name__}: {e}"), None)
                    continue
                self.num_steps += 1
                for out in outputs:
                    self._sent.pop(out.request_id, None)
                    updates.append((out.request_id, "finished", out))
                for rid, n in self._sent.items():
                    new = engine.request_token_ids(rid, n)
                    if new:
                        self._sent[rid] = n + len(new)
                        updates.append((rid, "tokens", new))
                self._send(updates, step)
            self._send(self._fail_all("the server is shutting down", "stopped"), None)
        except Exception:
            logger.exception("the engine loop stopped")
            self._fail_all("the engine loop stopped")

    def _take_commands(self) -> tuple[list, bool]:
        updates, took = [], False
        while True:
            try:
                command = self._queue.get_nowait()
            except queue.Empty:
                return updates, took
            took = True
            if command[0] == "add":
                _, rid, prompt, params = command
                try:
                    self.engine.add_request(rid, prompt, params)
                except Exception as e:  # ValueError: what the client asked for; anything else: ours
                    if not isinstance(e, ValueError):
                        logger.exception("adding request %r failed", rid)
                    why = e if isinstance(e, RequestError) else str(e)
                    updates.append((rid, "refused", (why, isinstance(e, ValueError))))
                else:
                    self._sent[rid] = 0
                    updates.append((rid, "accepted", None))
            elif command[0] == "abort":
                self._sent.pop(command[1], None)
                self.num_aborted += self.engine.abort_request(command[1])
            elif command[0] == "gone":
                self._stopping = True
                self.num_aborted += len(self._sent)
                self._fail_all("the front end has gone", "stopped")

    def _fail_all(self, message: str, kind: str = "failed") -> list:
        # everything the engine holds, not only what we sent: a step that failed midway must
        # not leave work that makes the next step fail again
        self.engine.abort_all()
        updates = [(rid, kind, message) for rid in self._sent]
        self._sent.clear()
        return updates

    def stats(self) -> dict:
        engine = self.engine
        sched = engine.scheduler
        return {"num_running": len(sched.running), "num_waiting": len(sched.waiting),
                "kv_cache_usage": engine.block_manager.usage,
                "num_preemptions": sched.stats.num_preemptions, "num_aborted": self.num_aborted,
                "compilations": engine.num_compilations()}

    def _send(self, updates: list, step) -> None:
        self.send((updates, self.stats(), step))

    def send(self, message) -> None:
        """To the front end (from the engine thread once started). A front end that has gone
        (or a closed pipe) drops it."""
        try:
            self._events.send(message)
        except (BrokenPipeError, EOFError, OSError):
            pass
