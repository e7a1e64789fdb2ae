"""Tensor-parallel worker processes: ranks 1..N-1 of an engine (rank 0 is the engine's process).

:class:`WorkerPool` (in the engine's process) starts each worker as ``python -m
tqattn.engine.worker`` — a fresh interpreter, so a user's script needs no ``__main__`` guard —
hands it the engine arguments on stdin and joins the process group with it. A worker builds the
same model runner as the engine (its shard of the model, its KV heads' cache) and then runs what
rank 0 sends (:func:`serve`) until told to stop.

Stopping, whatever happens: :meth:`WorkerPool.shutdown` asks the workers to exit and kills any
that do not; the engine calls it when it is deleted, on interpreter exit, and when a call fails
half way (the other ranks may wait in a collective that never completes). A worker exits when its
stdin closes, so it never outlives the engine's process, even one that was killed. A worker that
fails writes its traceback to a file the pool reads; rank 0 raises it (:class:`TensorParallelError`).
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from . import parallel
from .parallel import TensorParallelError

logger = logging.getLogger(__name__)

_READY_POLL_S = 0.2
_STOP_WAIT_S = 30.0


def _package_root() -> str:
    """The directory this tqattn is imported from: a worker imports the same one."""
    return str(Path(__file__).resolve().parents[2])


class WorkerPool:
    """Ranks 1..N-1 of one engine, and rank 0's membership of the process group."""

    def __init__(self, args, device: torch.device):
        tp = args.tensor_parallel_size
        self.device = device
        self.procs: list[subprocess.Popen] = []
        self.group: parallel.TensorParallelGroup | None = None
        self._stopping = False
        self._dir = Path(tempfile.mkdtemp(prefix="tqattn-tp-"))
        self._store = dist.TCPStore("127.0.0.1", 0, tp, is_master=True, wait_for_workers=False,
                                    timeout=parallel.TIMEOUT)
        try:
            env = {**os.environ, **parallel.worker_env(device.type), "WORLD_SIZE": str(tp),
                   "PYTHONPATH": os.pathsep.join(filter(None, [_package_root(),
                                                               os.environ.get("PYTHONPATH")]))}
            for rank in range(1, tp):
                spec = {"rank": rank, "world_size": tp, "port": self._store.port, "args": args,
                        "device": device.type, "error_file": str(self._error_file(rank))}
                proc = subprocess.Popen([sys.executable, "-m", "tqattn.engine.worker"], stdin=subprocess.PIPE,
                                        env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)})
                self.procs.append(proc)
                proc.stdin.write(pickle.dumps(spec))
                proc.stdin.flush()  # stays open: a worker exits when it closes
            self._wait_ready(tp)
            self.group = parallel.init_process_group(0, tp, self._store, device)
            self.group.on_failure = self._failed
        except BaseException:
            self.shutdown(graceful=False)
            raise
        self._monitor = threading.Thread(target=self._watch, name="tqattn-tp-monitor", daemon=True)
        self._monitor.start()

    def _error_file(self, rank: int) -> Path:
        return self._dir / f"rank{rank}.err"

    def _wait_ready(self, tp: int) -> None:
        """Until every worker has connected to the store; raises if one exits first."""
        keys = [f"ready{rank}" for rank in range(1, tp)]
        while not self._store.check(keys):
            self._raise_if_exited()
            time.sleep(_READY_POLL_S)

    def _exited(self) -> list[tuple[int, int]]:
        return [(rank, proc.returncode) for rank, proc in enumerate(self.procs, 1) if proc.poll() is not None]

    def _raise_if_exited(self) -> None:
        exited = self._exited()
        if exited:
            raise TensorParallelError(self._describe(exited))

    def _describe(self, exited: list[tuple[int, int]]) -> str:
        parts = []
        for rank, code in exited:
            f = self._error_file(rank)
            tb = f.read_text() if f.is_file() else ""
            parts.append(f"tensor-parallel worker rank {rank} exited with code {code}"
                         + (f":\n{tb.rstrip()}" if tb else " (no traceback: killed, or it crashed)"))
        return "\n".join(parts)

    def _watch(self) -> None:
        """Log a worker that exits on its own at once; on NCCL, abort the process group so that
        rank 0, waiting in a collective with it, gets an error instead of hanging."""
        while not self._stopping:
            exited = self._exited()
            if exited:
                if not self._stopping:
                    logger.error("%s", self._describe(exited))
                    if self.device.type == "cuda":
                        try:
                            dist.distributed_c10d._abort_process_group()
                        except Exception:  # noqa: BLE001 — best effort; gloo fails its ops on its own
                            pass
                return
            time.sleep(_READY_POLL_S)

    def _failed(self, exc: BaseException) -> BaseException:
        """Rank 0's call failed: a worker's traceback if one failed, and the workers stopped."""
        deadline = time.monotonic() + 5.0
        while not self._exited() and time.monotonic() < deadline and not isinstance(exc, KeyboardInterrupt):
            time.sleep(0.05)  # a worker that failed first is on its way out
        exited = [(r, c) for r, c in self._exited() if c != 0]
        message = self._describe(exited) if exited else (
            f"rank 0 failed during a call every rank takes part in ({type(exc).__name__}: {exc}); "
            f"the workers were stopped")
        self.shutdown(graceful=False)
        return TensorParallelError(message)

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the workers and leave the process group; idempotent. Graceful (the engine idle
        and every rank well): ask them to exit and wait; otherwise — a rank failed, or one may
        wait in a collective that never completes — kill them at once."""
        if self._stopping and not self.procs:
            return
        self._stopping = True
        group, self.group = self.group, None
        healthy = group is not None and group.failed is None and not self._exited()
        if graceful and healthy:
            try:
                group.send(("shutdown",))
            except Exception:  # noqa: BLE001 — a worker gone meanwhile: killed below
                healthy = False
        if group is not None and group.failed is None:  # the engine's next call says so
            group.failed = TensorParallelError("shut down")
        deadline = time.monotonic() + (_STOP_WAIT_S if graceful and healthy else 0.0)
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdin is not None:
                proc.stdin.close()
        self.procs = []
        if group is not None:  # this process joined the group
            try:
                if not healthy and self.device.type == "cuda":  # NCCL may hang on a dead peer
                    dist.distributed_c10d._abort_process_group()
                else:
                    parallel.destroy_process_group()
            except Exception:  # noqa: BLE001 — leaving a broken group: nothing more to do
                pass
        shutil.rmtree(self._dir, ignore_errors=True)


# ---- the worker's side -----------------------------------------------------------------------

def serve(runner, group: parallel.TensorParallelGroup) -> None:
    """Run what rank 0 sends until it says stop."""
    while True:
        message = group.recv()
        kind = message[0]
        if kind == "shutdown":
            return
        if kind == "step":
            runner.worker_step(*message[1:])
        elif kind == "call":
            _, name, args, kwargs = message
            getattr(runner, name)(*args, **kwargs)
        else:
            raise TensorParallelError(f"unknown message {kind!r} from rank 0")


def _exit_with_parent() -> None:
    """The engine's process holds our stdin open: EOF means it exited (or is done with us)."""
    try:
        sys.stdin.buffer.read()
    finally:
        os._exit(0)


def main() -> None:
    spec = pickle.load(sys.stdin.buffer)
    rank = spec["rank"]
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s tqattn rank {rank}: %(message)s")
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # rank 0 shows the loading progress
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    try:
        run_worker(spec)
    except BaseException:
        Path(spec["error_file"]).write_text(traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


def run_worker(spec: dict) -> None:
    from .llm_engine import build_model_runner, setup_compilation

    rank, tp, args = spec["rank"], spec["world_size"], spec["args"]
    device = torch.device("cuda", rank) if spec["device"] == "cuda" else torch.device("cpu")
    if device.type == "cpu":  # the host's cores shared between the ranks
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    setup_compilation(args, device)
    store = dist.TCPStore("127.0.0.1", spec["port"], tp, is_master=False, timeout=parallel.TIMEOUT)
    store.set(f"ready{rank}", "1")
    group = parallel.init_process_group(rank, tp, store, device)
    runner = build_model_runner(args, device, group)[2]
    serve(runner, group)
    parallel.destroy_process_group()


if __name__ == "__main__":
    main()
