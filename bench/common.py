"""Timing helpers shared by the benchmarks.

Discipline (the same for every method and baseline): the call is captured once in a CUDA graph
and the graph is replayed; before each timed replay L2 is flushed by streaming 256 MB through
it; CUDA events bracket the replay alone; median of at least ``min_reps`` replays (up to
``max_reps`` / ~``budget_ms`` of work) after warm-up.

Flush modes: "memset" (default) zeroes a 256 MB buffer, as ``triton.testing.do_bench`` does,
leaving L2 full of dirty lines; "read" sums it, leaving clean lines (on the H200 the decode
kernels time the same either way: bench/results/decode_s8_flush_h200_prelim.md); "none" times
warm replays (what an L2-resident working set costs).
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import sys

import torch

FLUSH_BYTES = 256 * 1024 * 1024


FLUSH_MODES = ("memset", "read", "none")


class Timer:
    def __init__(self, device="cuda", flush: str = "memset"):
        if flush not in FLUSH_MODES:
            raise ValueError(f"flush={flush!r}: expected one of {FLUSH_MODES}")
        self.mode = flush
        if flush != "none":
            self.buf = torch.zeros(FLUSH_BYTES // 4, dtype=torch.float32, device=device)
            self.sink = torch.empty((), dtype=torch.float32, device=device)

    def flush(self) -> None:
        if self.mode == "memset":
            self.buf.zero_()
        elif self.mode == "read":
            torch.sum(self.buf, dim=0, out=self.sink)

    @staticmethod
    def _capture(fn, warmup: int) -> torch.cuda.CUDAGraph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        for _ in range(warmup):
            graph.replay()
        torch.cuda.synchronize()
        return graph

    def _replays(self, graphs, min_reps, max_reps, budget_ms) -> list[list[float]]:
        """µs of each graph's replays, the graphs taking turns (each replay after a flush)."""
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        ev[0].record()
        for _ in range(3):
            for g in graphs:
                g.replay()
        ev[1].record()
        torch.cuda.synchronize()
        est_ms = max(ev[0].elapsed_time(ev[1]) / 3, 1e-3)
        reps = int(min(max_reps, max(min_reps, budget_ms / est_ms)))
        events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                   for _ in range(reps)] for _ in graphs]
        for i in range(reps):
            for g, ev_g in zip(graphs, events):
                self.flush()
                ev_g[i][0].record()
                g.replay()
                ev_g[i][1].record()
        torch.cuda.synchronize()
        return [[s.elapsed_time(e) * 1e3 for s, e in ev_g] for ev_g in events]

    def graph_us(self, fn, *, min_reps=20, max_reps=400, budget_ms=250.0, warmup=3) -> dict:
        """Median µs of a CUDA-graph replay of fn(), L2 flushed before each rep."""
        graph = self._capture(fn, warmup)
        times, = self._replays([graph], min_reps, max_reps, budget_ms)
        del graph
        return {"us": statistics.median(times), "reps": len(times),
                "min_us": min(times), "p90_us": sorted(times)[int(0.9 * (len(times) - 1))]}

    def paired_us(self, fn_a, fn_b, *, min_reps=40, max_reps=400, budget_ms=500.0,
                  warmup=3) -> dict:
        """What fn_b costs over fn_a: their graphs replayed in turns (a, b, a, b, ...), so drift
        in clocks or memory state between two separate timings does not enter; diff_us = the
        median of the per-turn differences."""
        graphs = [self._capture(fn_a, warmup), self._capture(fn_b, warmup)]
        ta, tb = self._replays(graphs, min_reps, max_reps, budget_ms)
        del graphs
        return {"a_us": statistics.median(ta), "b_us": statistics.median(tb),
                "diff_us": statistics.median(b - a for a, b in zip(ta, tb)), "reps": len(ta)}

    def eager_us(self, fn, reps=20) -> float:
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            self.flush()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) * 1e3)
        return statistics.median(times)


def copy_bandwidth_gbs(nbytes: int = 4 << 30, reps: int = 20) -> dict:
    """Device-to-device copy rate, counting bytes read + written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        dst.copy_(src)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    ms = statistics.median(times)
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes": nbytes, "ms": ms, "gbs_rw": 2 * nbytes / ms / 1e6}


def _cuda_device() -> dict:
    props = torch.cuda.get_device_properties(0)
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001 - informational only
        smi = ""
    return {"device": torch.cuda.get_device_name(0), "sms": props.multi_processor_count,
            "nvidia_smi": smi, "cuda": torch.version.cuda}


def environment() -> dict:
    """Device, versions, date and command of a run (on a CPU: e.g. compiled_vs_eager.py
    --device cpu)."""
    import triton

    from tqattn.attention.env_report import collect_env
    cuda = torch.cuda.is_available()
    keep = (("transformers", "tokenspeed_fa3", "flash_attn_4", "fa_versions", "tqattn") if cuda
            else ("transformers", "tqattn"))
    device = (_cuda_device() if cuda else
              {"device": f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"})
    return {**device, "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(),
            **{k: v for k, v in collect_env().items() if k in keep},
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python3"] + sys.argv)}
