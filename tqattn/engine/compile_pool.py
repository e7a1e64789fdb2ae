"""Worker processes that compile :class:`~tqattn.engine.kernel_build.KernelBuild` s into Triton's
disk cache, several at once (triton's compile holds the GIL: threads do not overlap it).

Workers are fresh interpreters started with ``subprocess`` — never a fork of a process that
initialised CUDA, and never multiprocessing's spawn, which re-imports the caller's ``__main__``
(a script that builds an ``LLM`` at top level would load the model again in every worker). They
see no GPU (``CUDA_VISIBLE_DEVICES=""``), import modules from the parent's ``sys.path`` and
inherit its environment (so ``TRITON_CACHE_DIR``), except ``TRITON_INTERPRET``: they compile.
Each takes one pickled build at a time over its stdin and answers on its stdout.
"""

from __future__ import annotations

import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

_LEN = struct.Struct("<Q")


class WorkerError(RuntimeError):
    """A worker exited (or none is left); the build was not compiled."""


class CompileError(RuntimeError):
    """A worker could not compile the build (its message is the worker's exception)."""


def _send(stream, payload: bytes) -> None:
    stream.write(_LEN.pack(len(payload)) + payload)
    stream.flush()


def _recv(stream) -> bytes | None:
    head = stream.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    payload = stream.read(_LEN.unpack(head)[0])
    if payload is None or len(payload) < _LEN.unpack(head)[0]:
        return None
    return payload


class CompilePool:
    """``workers`` processes, started at once (each imports triton and the ``preload`` packages
    with their submodules while the caller goes on); :meth:`submit` returns a Future of
    (compile seconds, the cache key the worker computed)."""

    def __init__(self, workers: int, preload: tuple[str, ...] = ()):
        if workers < 1:
            raise ValueError(f"a compile pool needs at least one worker, got {workers}")
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
        env.pop("TRITON_INTERPRET", None)
        path = [p or os.getcwd() for p in sys.path if isinstance(p, str)]
        code = (f"import sys; sys.path[:0] = {path!r}; "
                f"from tqattn.engine.compile_pool import worker_main; worker_main({list(preload)!r})")
        self._procs = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=env, cwd=os.getcwd())
                       for _ in range(workers)]
        self._idle: queue.Queue = queue.Queue()
        for p in self._procs:
            self._idle.put(p)
        self._lock = threading.Lock()
        self._live = workers
        self._threads = ThreadPoolExecutor(workers, thread_name_prefix="tqattn-compile")
        self._finalizer = weakref.finalize(self, _shutdown, self._threads, self._procs, self._idle)

    @property
    def workers(self) -> int:
        return len(self._procs)

    def submit(self, build) -> Future:
        """Queue a build; raises at once (pickle's error) if it cannot be sent."""
        payload = pickle.dumps(build, protocol=pickle.HIGHEST_PROTOCOL)
        return self._threads.submit(self._compile, payload)

    def _compile(self, payload: bytes):
        proc = self._idle.get()
        if proc is None:  # every worker has exited, or the pool is closed
            self._idle.put(None)
            raise WorkerError("no compile worker is left")
        try:
            _send(proc.stdin, payload)
            reply = _recv(proc.stdout)
        except (OSError, ValueError):
            reply = None
        if reply is None:
            self._lose(proc)
            raise WorkerError(f"compile worker {proc.pid} exited (status {proc.poll()})")
        self._idle.put(proc)
        ok, value = pickle.loads(reply)
        if not ok:
            raise CompileError(value)
        return value

    def _lose(self, proc) -> None:
        with self._lock:
            self._live -= 1
            last = self._live == 0
        proc.kill()
        if last:
            self._idle.put(None)  # wakes the callers waiting for a worker

    def close(self) -> None:
        """Cancel what has not started, end the workers (without waiting for them)."""
        self._finalizer()


def _shutdown(threads: ThreadPoolExecutor, procs: list, idle: queue.Queue) -> None:
    threads.shutdown(wait=False, cancel_futures=True)
    idle.put(None)  # a call still waiting for a worker fails instead of waiting forever
    for p in procs:  # an idle worker exits at the end of its input
        try:
            p.stdin.close()
        except OSError:
            pass
    threading.Thread(target=_reap, args=(procs,), daemon=True).start()


def _reap(procs: list, grace_s: float = 5.0) -> None:
    for p in procs:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:  # still compiling a build nobody waits for
            p.kill()
            p.wait()


def worker_main(preload: list[str]) -> None:
    """A worker: compile each build read from stdin, answer (ok, (seconds, cache key) or error)."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints (compiler tools) go to stderr, not into the answers
    inp = sys.stdin.buffer
    _preload(preload)
    while (payload := _recv(inp)) is not None:
        try:
            build = pickle.loads(payload)
            reply = (True, (build.compile(), build.cache_key()))
        except Exception as e:  # noqa: BLE001 — reported to the parent, which falls back
            reply = (False, f"{type(e).__name__}: {e}")
        _send(out, pickle.dumps(reply))


def _preload(packages: list[str]) -> None:
    """Import triton's compiler and the packages' modules now, not in the first build's time."""
    import importlib
    import pkgutil

    import triton.compiler  # noqa: F401

    for name in packages:
        try:
            pkg = importlib.import_module(name)
            for m in pkgutil.iter_modules(getattr(pkg, "__path__", [])):
                importlib.import_module(f"{name}.{m.name}")
        except Exception:  # noqa: BLE001 — a module that does not import is imported (and
            pass           # reported) by the build that needs it
