"""What generate() returns, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


@dataclass
class RequestMetrics:
    """Wall-clock times (time.perf_counter seconds) of one request."""
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (last admission)

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def decode_time(self) -> float | None:
        if self.finished_time is None or self.first_token_time is None:
            return None
        return self.finished_time - self.first_token_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(repr=False, default=None)

    @property
    def num_cached_tokens(self) -> int:
        return self.metrics.num_cached_tokens if self.metrics else 0


@dataclass
class StepRecord:
    """One engine step in the timeline (LLMEngine.record_steps)."""
    kind: str  # "decode" (every sequence generating one token), "prefill", or "mixed"
    num_tokens: int  # tokens run through the model, recomputed ones included
    num_seqs: int
    num_decodes: int
    graph_bucket: int | None  # the CUDA graph's batch size; None when the step ran without one
    # from the previous step's tokens reaching the host (or this step's launch, if later) to
    # this step's: its share of the run's wall time (async scheduling: of the device's time)
    wall_ms: float
    host_ms: float  # the step() call that launched it, less its waits for the device
    num_preempted: int = 0
    device_ms: float | None = None  # CUDA: from the step's first device work to its sampled tokens
    device_idle_ms: float | None = None  # CUDA: the device's gap after the previous recorded step
