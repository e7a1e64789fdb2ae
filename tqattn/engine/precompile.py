"""Compile the warm-up's kernel builds in parallel before the warm-up runs.

Triton compiles each new kernel variant on first launch, one after the other and holding the
GIL, so the warm-up of a TurboQuant model spends most of its time compiling (a build takes a few
seconds of one core). With the precompile, start-up:

1. starts a :class:`~tqattn.engine.compile_pool.CompilePool` at the beginning (its workers
   import triton while the model loads and compiles);
2. at the warm-up, runs the warm-up steps once with tqattn's kernel launches deferred: each
   launch is bound as triton would bind it, and a build that is neither seen before nor in
   Triton's disk cache goes to the pool instead of compiling here; the kernel does not run
   (nothing reads a dummy step's outputs on the host). An explicit ``warmup=True`` call — which
   returns the compiled kernel (the tensor-core decode reads its register count) — gets its
   build from the pool and then goes through triton as usual, so it returns what it always does
   (its step stops and runs again at the end, so that the wait overlaps the other builds);
3. waits for the pool; the real warm-up then loads every build from the disk cache.

It only moves compilation earlier and elsewhere: the same builds are compiled, the same steps
run afterwards. A build the pool did not deliver is compiled by the warm-up as before, and any
failure logs one line and leaves the warm-up as it was. On by default for the triton versions
it was tested with (its start-up measurement: bench/results/README.md); ``TQATTN_PRECOMPILE=0``
turns it off, ``=force`` on with any triton; ``TQATTN_PRECOMPILE_WORKERS`` sets the pool size
(default: CPU cores - 1, at most 16). Off on CPU and with ``enforce_eager``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Callable

logger = logging.getLogger(__name__)

ENV, WORKERS_ENV = "TQATTN_PRECOMPILE", "TQATTN_PRECOMPILE_WORKERS"
TESTED_TRITON = ("3.6.",)   # binding and cache keys follow triton's internals of these versions
MAX_WORKERS = 16
WAIT_S = 300.0   # a pool slower than this is given up on: the warm-up compiles the rest
KERNEL_PREFIX = "tqattn."   # whose launches are deferred; other kernels run as usual
PRELOAD = ("tqattn.kernels",)


def default_workers() -> int:
    """CPU cores this process may use, less one for the parent (which runs the deferred steps).
    The workers compile after the model's compile, so Inductor's workers are idle by then."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return min(cores - 1, MAX_WORKERS)


def start(device, enforce_eager: bool) -> Precompiler | None:
    """A started precompiler, or None where it is off (logged, unless on CPU, enforce_eager or
    turned off)."""
    setting = os.environ.get(ENV, "1")
    if setting not in ("0", "1", "force"):
        raise ValueError(f"{ENV}={setting!r}: expected 1 (on, the default), 0 (off) or force "
                         f"(on with any triton version)")
    if device.type != "cuda" or enforce_eager or setting == "0":
        return None
    why = _unavailable(force=setting == "force")
    if why is None:
        try:
            workers = int(os.environ.get(WORKERS_ENV) or default_workers())
        except ValueError:
            workers, why = 0, f"{WORKERS_ENV}={os.environ[WORKERS_ENV]!r} is not a number"
        if why is None and workers < 2:
            why = f"{workers} worker process(es) would not compile in parallel"
    if why is None:
        try:
            return Precompiler(workers)
        except Exception as e:  # noqa: BLE001 — no pool: the warm-up compiles as it would
            why = f"the compile pool did not start ({type(e).__name__}: {e})"
    logger.info("kernel precompile off: %s; the warm-up compiles the kernels one by one", why)
    return None


def _unavailable(force: bool) -> str | None:
    try:
        import triton
    except ImportError:
        return "no triton"
    from .kernel_build import available

    why = available()
    if why is None and not force and not triton.__version__.startswith(TESTED_TRITON):
        why = (f"triton {triton.__version__} is not a version it was tested with "
               f"({', '.join(v + 'x' for v in TESTED_TRITON)}; {ENV}=force forces it)")
    return why


class Precompiler:
    def __init__(self, workers: int, target=None, pool=None):
        """``target``: the triton GPUTarget to compile for, None: the current device's;
        ``pool``: a started pool, None: a CompilePool of ``workers`` processes."""
        if pool is None:
            from .compile_pool import CompilePool

            pool = CompilePool(workers, PRELOAD)
        self.pool = pool
        self.target = target

    def run(self, steps: list[Callable[[], None]]) -> dict | None:
        """Run the warm-up ``steps`` with tqattn's launches deferred (:meth:`Capture.run`), wait
        for the pool's builds, close the pool; log a summary and return it. Never raises (a
        failure is logged; then None)."""
        t0 = time.perf_counter()
        capture = None
        try:
            capture = Capture(self.pool, self._target())
            capture.run(steps)
            captured = time.perf_counter() - t0
            summary = capture.wait(WAIT_S)
            summary.update(capture_s=captured, total_s=time.perf_counter() - t0,
                           workers=self.pool.workers)
            logger.info("kernel precompile: %s", format_summary(summary))
            return summary
        except Exception as e:  # noqa: BLE001 — the warm-up compiles whatever is missing
            done = capture.summary() if capture is not None else {}
            logger.warning("kernel precompile stopped (%s: %s) after %.1f s, %d builds handed to "
                           "the pool; the warm-up compiles the rest one by one", type(e).__name__,
                           e, time.perf_counter() - t0, done.get("submitted", 0))
            return None
        finally:
            self.pool.close()

    def close(self) -> None:
        self.pool.close()

    def _target(self):
        if self.target is None:
            from triton.runtime import driver

            self.target = driver.active.get_current_target()
        return self.target


class BuildPending(Exception):
    """Stops a captured step at a ``warmup=True`` call whose build is still compiling."""


class Capture:
    """The builds of the launches made inside :meth:`deferring`, handed to ``pool``."""

    def __init__(self, pool, target, prefix: str | None = None):
        from .kernel_build import Binder

        self.pool = pool
        self.prefix = KERNEL_PREFIX if prefix is None else prefix
        self.binder = Binder(target)
        self.launches = 0
        self.seen: dict[tuple, Future | None] = {}    # (id(fn), JIT key) -> its build's future
        self.futures: dict[str, Future] = {}          # cache key -> build handed to the pool
        self.names: dict[str, str] = {}               # cache key -> kernel name
        self.cached = 0      # builds already in Triton's disk cache
        self.unbuilt: list[str] = []  # launches that could not be described or sent: why
        self.stopped = False  # the current step met a pending build (:meth:`run`)

    def add(self, fn, args: tuple, kwargs: dict) -> Future | None:
        """Hand the launch's build to the pool unless known; its future (None: nothing to wait)."""
        self.launches += 1
        key, bound = self.binder.bind(fn, args, kwargs)
        seen_key = (id(fn), key)
        if seen_key in self.seen:
            return self.seen[seen_key]
        fut = None
        try:
            build = self.binder.build(fn, bound)
            cache_key = build.cache_key(fn)
            if cache_key in self.futures:
                fut = self.futures[cache_key]
            elif build.in_disk_cache(cache_key):
                self.cached += 1
            else:
                fut = self.futures[cache_key] = self.pool.submit(build)
                self.names[cache_key] = build.qualname
        except Exception as e:  # noqa: BLE001 — this build compiles in the warm-up instead
            self.unbuilt.append(f"{fn.module}.{fn.__name__}: {type(e).__name__}: {e}")
        self.seen[seen_key] = fut
        return fut

    def run(self, steps: list[Callable[[], None]]) -> None:
        """Run the steps with launches deferred. A ``warmup=True`` call whose build is still
        compiling stops its step (the step runs again at the end, when the build is likely
        done), so one step's wait does not hold up the builds of the steps after it."""
        retry = []
        with self.deferring(stop_on_pending=True):
            for step in steps:
                self.stopped = False
                try:
                    step()
                except Exception:
                    if not self.stopped:  # not a stop of ours (however the model re-raised it)
                        raise
                if self.stopped:
                    retry.append(step)
        with self.deferring(stop_on_pending=False):
            for step in retry:
                step()

    @contextlib.contextmanager
    def deferring(self, stop_on_pending: bool = False):
        """Inside, on this thread, launches of kernels under ``prefix`` do not run: their builds
        go to the pool. A ``warmup=True`` call waits for its build, then runs as usual (it returns
        the compiled kernel); with ``stop_on_pending`` it raises :class:`BuildPending` instead
        while the build is not done."""
        from triton.runtime.jit import JITFunction

        orig = JITFunction.run
        owner = threading.get_ident()

        def run(fn, *args, grid, warmup, **kwargs):
            if threading.get_ident() != owner or not fn.module.startswith(self.prefix):
                return orig(fn, *args, grid=grid, warmup=warmup, **kwargs)
            fut = self.add(fn, args, kwargs)
            if not warmup:
                return None
            if fut is not None and not fut.done():
                if stop_on_pending:
                    self.stopped = True
                    raise BuildPending(fn.__name__)
                wait_futures([fut], timeout=WAIT_S)   # its failure: triton compiles it below
            return orig(fn, *args, grid=grid, warmup=warmup, **kwargs)

        JITFunction.run = run
        try:
            yield self
        finally:
            JITFunction.run = orig

    def wait(self, timeout: float) -> dict:
        """Wait for the pool's builds (at most ``timeout`` seconds); the summary."""
        wait_futures(list(self.futures.values()), timeout=timeout)
        return self.summary()

    def summary(self) -> dict:
        compiled, failed, compile_s = 0, [], 0.0
        for cache_key, fut in self.futures.items():
            name = self.names.get(cache_key, "?")
            if not fut.done() or fut.cancelled():
                failed.append(f"{name}: not done in time")
                continue
            err = fut.exception()
            if err is not None:
                failed.append(f"{name}: {type(err).__name__}: {err}")
                continue
            seconds, worker_key = fut.result()
            if worker_key != cache_key:  # the worker imported another version of the kernel
                failed.append(f"{name}: the worker's build has another cache key")
                continue
            compiled += 1
            compile_s += seconds
        return {"launches": self.launches, "submitted": len(self.futures), "compiled": compiled,
                "compile_s": compile_s, "cached": self.cached, "failed": failed,
                "unbuilt": list(self.unbuilt)}


def format_summary(s: dict) -> str:
    """One line: what was compiled where and what it took."""
    text = (f"{s['compiled']} of {s['submitted']} new kernel builds compiled by {s['workers']} "
            f"worker processes in {s['total_s']:.1f} s ({s['compile_s']:.1f} s of compiling; "
            f"warm-up steps run deferred in {s['capture_s']:.1f} s: {s['launches']} launches, "
            f"{s['cached']} builds already in Triton's disk cache)")
    for what, items in (("failed", s["failed"]), ("not precompiled", s["unbuilt"])):
        if items:
            text += f"; {len(items)} {what} (the warm-up compiles them): " + "; ".join(items[:3])
    return text
