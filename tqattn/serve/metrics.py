"""Server metrics in the Prometheus text format (vLLM's names under the ``tqattn:`` prefix).

Counters and histograms are updated by the engine thread as requests finish; gauges are read from
the async engine when /metrics is scraped. Plain integers and floats under the GIL: a scrape may see
one step's updates half applied, never a torn value.
"""

from __future__ import annotations

import bisect
import math

from ..engine.outputs import RequestOutput

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                0.2, 0.3, 0.5, 1.0, 2.5, 10.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last: above every bucket
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, cum = [], 0
        for le, n in zip((*self.buckets, math.inf), self.counts):
            cum += n
            le_s = "+Inf" if le == math.inf else repr(float(le))
            out.append(f'{name}_bucket{{{labels},le="{le_s}"}} {cum}')
        out.append(f"{name}_sum{{{labels}}} {self.sum!r}")
        out.append(f"{name}_count{{{labels}}} {self.count}")
        return out


class ServerMetrics:
    def __init__(self):
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {"stop": 0, "length": 0}
        self.num_aborted = 0
        self.num_rejected = 0  # 503: the waiting queue was full
        self.num_preemptions = 0
        self.num_cudagraph_steps = 0  # steps that replayed a captured decode graph
        self.step_time = Histogram(STEP_BUCKETS)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def observe_finished(self, out: RequestOutput) -> None:
        """A request that finished by itself (stop or length); aborted ones are counted apart."""
        c, m = out.outputs[0], out.metrics
        if c.finish_reason not in self.finished:
            return
        self.finished[c.finish_reason] += 1
        self.prompt_tokens += len(out.prompt_token_ids)
        self.generation_tokens += len(c.token_ids)
        if m is None:
            return
        if m.time_to_first_token is not None:
            self.ttft.observe(m.time_to_first_token)
        if m.decode_time is not None and len(c.token_ids) > 1:
            self.tpot.observe(m.decode_time / (len(c.token_ids) - 1))
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)

    def observe_step(self, seconds: float, cudagraph: bool) -> None:
        """One call of the engine's step (with async scheduling it also waits for the step before)."""
        self.step_time.observe(seconds)
        self.num_cudagraph_steps += cudagraph

    def render(self, model_name: str, num_running: int, num_waiting: int, kv_cache_usage: float,
               compilations: int | None = None) -> str:
        lab = f'model_name="{_escape(model_name)}"'
        lines: list[str] = []

        def metric(name, kind, help_, samples):
            lines.append(f"# HELP tqattn:{name} {help_}")
            lines.append(f"# TYPE tqattn:{name} {kind}")
            lines.extend(samples)

        def one(name, kind, help_, value, extra=""):
            metric(name, kind, help_, [f"tqattn:{name}{{{lab}{extra}}} {value}"])

        one("num_requests_running", "gauge", "Requests in the running batch.", num_running)
        one("num_requests_waiting", "gauge", "Requests waiting for a slot.", num_waiting)
        one("kv_cache_usage_perc", "gauge", "Fraction of KV-cache blocks in use (1 = full).",
            repr(float(kv_cache_usage)))
        one("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", self.prompt_tokens)
        one("generation_tokens_total", "counter", "Generated tokens of finished requests.",
            self.generation_tokens)
        one("num_preemptions_total", "counter", "Sequences preempted (their KV recomputed later).",
            self.num_preemptions)
        metric("request_success_total", "counter", "Requests that finished, by finish reason.",
               [f'tqattn:request_success_total{{{lab},finished_reason="{r}"}} {n}'
                for r, n in self.finished.items()])
        one("request_aborted_total", "counter", "Requests aborted (client gone, timeout).", self.num_aborted)
        one("request_rejected_total", "counter", "Requests refused with 503 (waiting queue full).",
            self.num_rejected)
        one("engine_cudagraph_steps_total", "counter", "Engine steps that replayed a decode CUDA graph.",
            self.num_cudagraph_steps)
        if compilations is not None:
            one("compilations_after_startup", "gauge", "Dynamo frames and Triton kernels compiled after "
                "start-up (each one stalled a step).", compilations)
        for name, h, help_ in (("engine_step_seconds", self.step_time, "Engine step calls (count: steps)."),
                               ("time_to_first_token_seconds", self.ttft, "Time to first token."),
                               ("time_per_output_token_seconds", self.tpot,
                                "Time per output token after the first."),
                               ("e2e_request_latency_seconds", self.e2e, "Arrival to finish.")):
            metric(name, "histogram", help_, h.lines(f"tqattn:{name}", lab))
        return "\n".join(lines) + "\n"


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
