"""The kernel precompile (tqattn/engine/precompile.py) on CPU: launches bound for sm_90 and
deferred, builds deduplicated, compiled by worker processes into Triton's disk cache where the
JIT's own compile finds them, every failure falling back to the warm-up's compile; off on CPU."""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from tqattn.engine import precompile  # noqa: E402
from tqattn.engine.compile_pool import CompileError, CompilePool, WorkerError  # noqa: E402
from tqattn.engine.kernel_build import KernelBuild  # noqa: E402
from tqattn.engine.precompile import Capture, Precompiler, format_summary  # noqa: E402

from .tiny_kernel import add_one as _add_one  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
CHILD = os.path.join(os.path.dirname(__file__), "precompile_child.py")




class Pool:
    """Records the builds; answers each with a done future (or ``answer(build)``'s)."""

    workers = 2

    def __init__(self, answer=None):
        self.builds, self.closed = [], False
        self.answer = answer or (lambda b: (0.5, b.cache_key()))

    def submit(self, build):
        self.builds.append(build)
        fut = Future()
        try:
            fut.set_result(self.answer(build))
        except Exception as e:  # noqa: BLE001
            fut.set_exception(e)
        return fut

    def close(self):
        self.closed = True


@pytest.fixture
def launched(monkeypatch, tmp_path):
    """An empty Triton cache; JITFunction.run replaced by a stand-in that records real launches."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    ran = []

    def run(fn, *args, grid, warmup, **kwargs):
        ran.append((fn.__name__, args[1], warmup))
        return "compiled kernel"
    monkeypatch.setattr(JITFunction, "run", run)
    return ran


def test_launches_are_deferred_and_builds_deduplicated(launched):
    pool = Pool()
    capture = Capture(pool, TARGET, prefix="tests.")
    x = torch.zeros(64)
    stand_in = JITFunction.run
    other = Capture(Pool(), TARGET, prefix="tqattn.")   # not this module's kernels
    with capture.deferring():
        assert _add_one[(1,)](x, 3, BLOCK=4) is None     # not launched
        _add_one[(1,)](x, 5, BLOCK=4)                    # n is no constexpr: the same build
        _add_one[(1,)](x, 32, BLOCK=4)                   # n % 16 == 0: triton specializes it
        _add_one[(1,)](x, 3, BLOCK=8)                    # another constexpr
        t = threading.Thread(target=lambda: _add_one[(1,)](x, 7, BLOCK=4))
        t.start()                                        # another thread's launch runs
        t.join()
    with other.deferring():
        assert _add_one[(1,)](x, 9, BLOCK=4) == "compiled kernel"
    assert launched == [("add_one", 7, False), ("add_one", 9, False)]
    assert JITFunction.run is stand_in
    assert len(pool.builds) == 3 and capture.launches == 4
    assert [b.constexprs for b in pool.builds] == [{(2,): 4}, {(2,): 4}, {(2,): 8}]
    assert pool.builds[1].attrs != pool.builds[0].attrs     # divisibility of n
    s = capture.summary()
    assert (s["submitted"], s["compiled"], s["cached"], s["failed"], s["unbuilt"]) == (3, 3, 0, [], [])
    # what the workers receive: it pickles and names the same cache entry
    for b in pool.builds:
        assert pickle.loads(pickle.dumps(b)).cache_key() == b.cache_key()


def test_a_build_in_the_disk_cache_is_not_sent(launched):
    """A real worker compiles the build for sm_90 into the cache; then it is found there."""
    pool = CompilePool(1)
    try:
        capture = Capture(pool, TARGET, prefix="tests.")
        with capture.deferring():
            _add_one[(1,)](torch.zeros(8), 3, BLOCK=4)
        s = capture.wait(120)
    finally:
        pool.close()
    assert (s["submitted"], s["compiled"], s["failed"]) == (1, 1, [])   # the worker's key agreed
    again = Capture(Pool(), TARGET, prefix="tests.")
    with again.deferring():
        _add_one[(1,)](torch.zeros(8), 5, BLOCK=4)
    assert again.summary()["cached"] == 1 and not again.pool.builds


class SlowPool(Pool):
    """Each build done 0.3 s after it is sent."""

    def __init__(self, order):
        super().__init__()
        self.order = order

    def submit(self, build):
        self.order.append(f"sent {build.constexprs[(2,)]}")
        fut = Future()

        def finish():
            time.sleep(0.3)
            self.order.append(f"compiled {build.constexprs[(2,)]}")
            fut.set_result((0.3, build.cache_key()))
        threading.Thread(target=finish).start()
        return fut


def test_warmup_calls_wait_for_their_build_then_run(launched):
    order = []
    capture = Capture(SlowPool(order), TARGET, prefix="tests.")
    with capture.deferring():
        # warmup=True returns the compiled kernel (decode_mma.programs_per_sm reads it)
        assert _add_one.warmup(torch.zeros(8), 3, BLOCK=4, grid=(1,)) == "compiled kernel"
    assert order == ["sent 4", "compiled 4"] and launched == [("add_one", 3, True)]
    failing = Capture(Pool(lambda b: 1 / 0), TARGET, prefix="tests.")
    with failing.deferring():   # the pool's failure: triton compiles it as it always does
        assert _add_one.warmup(torch.zeros(8), 3, BLOCK=4, grid=(1,)) == "compiled kernel"
    assert "ZeroDivisionError" in failing.summary()["failed"][0]


def test_a_step_waiting_for_a_build_runs_again_at_the_end(launched):
    """The step stops at its warmup=True call; the next steps' builds are sent meanwhile."""
    order, got = [], []

    def first():
        order.append("first")
        got.append(_add_one.warmup(torch.zeros(8), 3, BLOCK=4, grid=(1,)))
        order.append("got the kernel")
        _add_one[(1,)](torch.zeros(8), 3, BLOCK=16)   # after the kernel it needed

    def second():
        order.append("second")
        _add_one[(1,)](torch.zeros(8), 3, BLOCK=8)
    capture = Capture(SlowPool(order), TARGET, prefix="tests.")
    capture.run([first, second])
    assert order[:4] == ["first", "sent 4", "second", "sent 8"]
    assert order[4] == "first" and order.index("got the kernel") > order.index("compiled 4")
    assert got == ["compiled kernel"] and launched == [("add_one", 3, True)]
    assert capture.wait(5)["compiled"] == 3 and "sent 16" in order

    def broken():   # a real failure of a step is not taken for a stop
        raise KeyError("x")
    with pytest.raises(KeyError):
        Capture(Pool(), TARGET, prefix="tests.").run([broken])

    tries = []

    def swallowing():   # host code that catches the stop still gets its step run again
        try:
            tries.append(_add_one.warmup(torch.zeros(8), 3, BLOCK=32, grid=(1,)))
        except Exception:  # noqa: BLE001
            tries.append("fell back")
    Capture(SlowPool([]), TARGET, prefix="tests.").run([swallowing])
    assert tries == ["fell back", "compiled kernel"]


def test_failures_are_reported_not_raised(launched, caplog):
    class Unpicklable(Pool):
        def submit(self, build):
            raise pickle.PicklingError("no")

    capture = Capture(Unpicklable(), TARGET, prefix="tests.")
    with capture.deferring():
        assert _add_one[(1,)](torch.zeros(8), 3, BLOCK=4) is None
    s = capture.summary()
    assert s["submitted"] == 0 and "PicklingError: no" in s["unbuilt"][0]
    # a worker that built another version of the kernel (another cache key) did not help
    other = Capture(Pool(lambda b: (1.0, "another key")), TARGET, prefix="tests.")
    with other.deferring():
        _add_one[(1,)](torch.zeros(8), 3, BLOCK=4)
    s = dict(other.summary(), workers=2, capture_s=0.1, total_s=1.0)
    assert s["compiled"] == 0 and "another cache key" in s["failed"][0]
    assert "1 failed (the warm-up compiles them)" in format_summary(s)

    # a warm-up that raises: logged, the pool closed, the launches run again as usual
    pool = Pool()

    def warmup():
        _add_one[(1,)](torch.zeros(8), 3, BLOCK=4)
        raise RuntimeError("boom")
    pre = Precompiler(2, TARGET, pool)
    with caplog.at_level(logging.INFO, logger="tqattn.engine.precompile"):
        assert pre.run([warmup]) is None
    assert pool.closed and "stopped (RuntimeError: boom)" in caplog.text
    assert _add_one[(1,)](torch.zeros(8), 3, BLOCK=4) == "compiled kernel"


def test_precompiler_run_summary(launched, caplog, monkeypatch):
    monkeypatch.setattr(precompile, "KERNEL_PREFIX", "tests.")
    pool = Pool()

    def warmup():
        _add_one[(1,)](torch.zeros(8), 3, BLOCK=4)
        _add_one[(1,)](torch.zeros(8), 3, BLOCK=8)
    with caplog.at_level(logging.INFO, logger="tqattn.engine.precompile"):
        s = Precompiler(2, TARGET, pool).run([warmup])
    assert not launched and len(pool.builds) == 2 and pool.closed
    assert (s["launches"], s["compiled"], s["workers"]) == (2, 2, 2)
    assert "kernel precompile: 2 of 2 new kernel builds compiled by 2 worker processes" in caplog.text


def test_off_on_cpu_with_enforce_eager_and_when_asked(monkeypatch, caplog):
    cuda = torch.device("cuda")  # a device object only: nothing starts in these cases
    assert precompile.start(torch.device("cpu"), False) is None
    assert precompile.start(cuda, True) is None
    monkeypatch.setenv(precompile.ENV, "0")
    assert precompile.start(cuda, False) is None
    monkeypatch.setenv(precompile.ENV, "yes")
    with pytest.raises(ValueError, match="TQATTN_PRECOMPILE='yes': expected 1 .* 0 .* or force"):
        precompile.start(cuda, False)
    monkeypatch.delenv(precompile.ENV, raising=False)   # on by default: tries, says why not
    with caplog.at_level(logging.INFO, logger="tqattn.engine.precompile"):
        monkeypatch.setenv(precompile.WORKERS_ENV, "1")
        assert precompile.start(cuda, False) is None
        assert caplog.text.count("1 worker process(es) would not compile in parallel") == 1
        monkeypatch.setenv(precompile.ENV, "1")
        for workers in ("1", "many"):
            monkeypatch.setenv(precompile.WORKERS_ENV, workers)
            assert precompile.start(cuda, False) is None
        monkeypatch.setattr(triton, "__version__", "9.9.0")
        assert precompile.start(cuda, False) is None
    text = caplog.text
    assert "1 worker process(es) would not compile in parallel" in text
    assert "'many' is not a number" in text and "triton 9.9.0 is not a version" in text
    assert 0 <= precompile.default_workers() <= precompile.MAX_WORKERS


def test_pool_failures():
    """A real worker: a build it cannot compile fails alone; a worker that exits fails the
    builds after it, and with none left every build fails at once."""
    pool = CompilePool(1)
    try:
        bad = KernelBuild("tqattn.no_such_module", "k", {}, {}, {}, {}, TARGET)
        with pytest.raises(CompileError, match="No module named 'tqattn.no_such_module'"):
            pool.submit(bad).result(timeout=120)
        with pytest.raises(TypeError, match="pickle"):
            pool.submit(KernelBuild("m", "k", {}, {(0,): threading.Lock()}, {}, {}, TARGET))
        pool._procs[0].kill()
        pool._procs[0].wait()
        with pytest.raises(WorkerError, match="exited"):
            pool.submit(bad).result(timeout=60)
        with pytest.raises(WorkerError, match="no compile worker is left"):
            pool.submit(bad).result(timeout=60)
    finally:
        pool.close()


def _child(*cases, tmp_path) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, CHILD, *cases], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_product_launches_precompile_into_the_disk_cache(tmp_path):
    """Real store launches through a real pool (a worker process), for sm_90; then the warm-up's
    builds of a Qwen3-4B-shaped layer (store, tensor-core and portable decode, merge, dequant)
    all pickle with their cache keys intact."""
    store, warmup = _child("store", "warmup", tmp_path=tmp_path)
    s = store["summary"]
    assert (s["launches"], s["submitted"], s["compiled"], s["failed"]) == (2, 1, 1, [])
    assert store["again"]["cached"] == 1 and store["again"]["submitted"] == 0
    # the JIT's compile of the same launches in this process: disk-cache hits, fast
    assert store["parent_hits"] == [True, True] and store["parent_s"] < s["compile_s"] / 5
    w = warmup["summary"]
    assert w["unbuilt"] == [] and w["submitted"] >= 8 and all(warmup["same_key"])
    assert {"_store_kernel", "_decode_mma_kernel", "_decode_split_kernel", "_merge_kernel",
            "_dequant_kernel"} <= set(warmup["kernels"])


def test_engine_startup_with_the_precompile(monkeypatch, caplog):
    """On CPU it is off (nothing to compile) even when asked for; forced on, start-up runs the
    warm-up once deferred, then for real, and reports the part and the warm-up's builds."""
    pytest.importorskip("transformers")
    from tqattn import LLM
    from tqattn.engine import llm_engine

    small = dict(load_format="dummy", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32,
                 enable_prefix_caching=False)
    monkeypatch.setenv(precompile.ENV, "1")
    llm = LLM("qwen3-tiny", **small)
    assert "precompile" not in llm.llm_engine.startup_times

    pool, runs = Pool(), []
    monkeypatch.setattr(precompile, "start", lambda device, eager: Precompiler(2, TARGET, pool))
    run = llm_engine.run_warmup
    monkeypatch.setattr(llm_engine, "run_warmup", lambda r, s: runs.append(len(s)) or run(r, s))
    monkeypatch.setattr(torch, "compile", lambda *a, **k: a[0])   # the warm-up runs on CPU
    with caplog.at_level(logging.INFO, logger="tqattn.engine"):
        engine = LLM("qwen3-tiny", compile_model=True, **small).llm_engine
    times = engine.startup_times
    assert list(times) == ["load", "calibration", "compile", "kv_cache", "precompile",
                           "warmup", "cudagraph_capture", "total"]
    assert abs(sum(v for k, v in times.items() if k != "total") - times["total"]) < 0.05
    # the capture runs the steps one at a time, the warm-up all of them
    assert runs == [1] * runs[-1] + [runs[-1]] and pool.closed
    assert "kernel precompile: 0 of 0 new kernel builds" in caplog.text
    assert ("warm-up: 0 Triton kernel builds loaded from the disk cache, 0 compiled; "
            "0 Dynamo compiles") in caplog.text
    assert engine.startup_builds["warmup"] == {"dynamo": 0, "triton_loaded": 0,
                                               "triton_compiled": 0}
    assert engine.startup_builds["precompile"]["launches"] == 0
