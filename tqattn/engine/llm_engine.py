"""The engine: model + per-layer KV-cache plan + scheduler + model runner; add_request/step/abort.

Async scheduling (``async_scheduling``, on by default on CUDA): ``step()`` schedules and launches
step N+1 before it waits for step N's sampled tokens, so the host's work for a step (schedule,
inputs, bookkeeping, outputs) overlaps the device's work on the one before. Scheduling needs
only lengths: each sequence that sampled in step N carries a placeholder token until the values
arrive (tqattn/engine/sampled.py), and a max_tokens finish is known at once. What depends on a
value — an EOS or stop token, a stop string — is applied when it arrives; a sequence it finishes
has had one more token computed in the step already launched, which is dropped.

Tensor parallelism (``tensor_parallel_size`` > 1, :mod:`tqattn.engine.parallel`): this process is
rank 0 and starts the other ranks' worker processes before loading; every rank builds the same
model runner over its shard (:func:`build_model_runner`), and the scheduler, the block manager and
sampling stay here. :meth:`LLMEngine.shutdown` (also on deletion and at exit) stops the workers.
"""

from __future__ import annotations

import logging
import time
import weakref
from functools import partial
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from tqattn.attention.backend import AttentionLayerSpec
from tqattn.attention.hf_attention import use_tqattn
from tqattn.attention.selector import (AUTO_SKIP, DEFAULT_AUTO_SKIP_BUDGET, FULL_PRECISION,
                                       build_attention_layers, check_routing_args,
                                       describe_full_precision, describe_plan,
                                       full_precision_layers, resolve_kv_cache_dtypes,
                                       routing_entries)
from tqattn.attention.turboquant import padded_head_size, tensor_core_padding
from tqattn.models import load_config, load_model
from tqattn.models.fused_projections import fuse_projections
from tqattn.models.loader import LoadedModel
from tqattn.models.sharding import split_heads
from tqattn.quant.layout import build_layout
from tqattn.quant.presets import PRESETS

from . import calibration, compilation, parallel, precompile
from .block_manager import BlockManager
from .config import SchedulerConfig
from .kv_cache import KVCacheConfig, bf16_bytes_per_token, determine_num_blocks, kv_cache_groups
from .model_runner import ModelRunner
from .outputs import CompletionOutput, RequestMetrics, RequestOutput, StepRecord
from .sampled import PLACEHOLDER, SampledTokens
from .sampling import SEED_MAX, SEED_MIN, SamplingParams, is_seed, make_generator
from .scheduler import RequestError, ScheduledSeq, Scheduler, SchedulerStats
from .sequence import Sequence, SequenceStatus
from .warmup import backend_token_counts, run_warmup, warmup_steps

logger = logging.getLogger(__name__)

_DTYPES = ("auto", "bfloat16", "float16", "float32")
_FINISH_REASONS = {SequenceStatus.FINISHED_STOPPED: "stop", SequenceStatus.FINISHED_LENGTH: "length",
                   SequenceStatus.FINISHED_ABORTED: "abort"}


@dataclass(kw_only=True)
class EngineArgs:
    model: str = "default"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    # "auto": the layers the start-up calibration finds the codec cannot hold (selector.py)
    kv_cache_dtype_skip_layers: list[int | str] = field(default_factory=lambda: [AUTO_SKIP])
    kv_cache_boundary_layers: int | None = None  # None: the selector's default
    kv_cache_key_centering: bool | None = None  # None: the layers the calibration says need it
    kv_cache_auto_skip_budget: float = DEFAULT_AUTO_SKIP_BUDGET  # of the all-compressed bytes
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    load_format: str = "auto"
    seed: int = 0
    device: str | None = None  # None: cuda if available, else cpu
    enforce_eager: bool = False  # no CUDA graphs and no compiled model
    compile_model: bool | None = None  # torch.compile the model; None: on CUDA unless enforce_eager
    async_scheduling: bool | None = None  # launch step N+1 before reading N's tokens; None: on CUDA
    tensor_parallel_size: int = 1  # ranks (processes, one GPU each) the model is split over
    # q/k/v and gate/up projections as one GEMM each; None: on CUDA without tensor parallelism
    fuse_projections: bool | None = None
    # compressed caches of head sizes the tensor-core decode kernel lacks (80, 96, ...) stored
    # zero-padded to the next one it runs (128): its speed, for more bytes per token; None: where
    # that kernel would then run the layers (a CUDA GPU of sm_80+, GQA group <= 8, no soft-cap)
    kv_cache_pad_head_size: bool | None = None

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; use one of {list(_DTYPES)}")
        allowed = ["auto", "bfloat16", "float16", "float32", *PRESETS]
        if self.kv_cache_dtype not in allowed:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not known; use 'auto' or one "
                             f"of the presets: {', '.join(PRESETS)} (see `tqattn presets`)")
        gmu = self.gpu_memory_utilization
        if isinstance(gmu, bool) or not isinstance(gmu, (int, float)) or not 0 < gmu <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        for name in ("kv_cache_memory_bytes", "num_gpu_blocks_override"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {v!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise ValueError(f"max_model_len must be a positive integer or None, got {self.max_model_len!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be True or False, got {self.enforce_eager!r}")
        if self.compile_model is not None and not isinstance(self.compile_model, bool):
            raise ValueError(f"compile_model must be True or False or None, got {self.compile_model!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be True or False or None, got "
                             f"{self.async_scheduling!r}")
        if self.kv_cache_key_centering is not None and not isinstance(self.kv_cache_key_centering, bool):
            raise ValueError(f"kv_cache_key_centering must be True, False or None, got "
                             f"{self.kv_cache_key_centering!r}")
        if not is_seed(self.seed):
            raise ValueError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}")
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer (1 = no tensor "
                             f"parallelism), got {tp!r}")
        pad = self.kv_cache_pad_head_size
        if pad is not None and not isinstance(pad, bool):
            raise ValueError(f"kv_cache_pad_head_size must be True, False or None, got {pad!r}")
        if self.fuse_projections is not None and not isinstance(self.fuse_projections, bool):
            raise ValueError(f"fuse_projections must be True, False or None, got "
                             f"{self.fuse_projections!r}")
        if self.fuse_projections and tp > 1:
            raise ValueError("fuse_projections=True needs tensor_parallel_size=1 (the tensor-"
                             "parallel plan shards the q/k/v and gate/up projections one by one)")
        if self.enforce_eager and self.compile_model:
            raise ValueError("enforce_eager=True runs the model eagerly (no compilation, no CUDA "
                             "graphs); it cannot be combined with compile_model=True")
        _check_device(self.device)
        if self.kv_cache_dtype_skip_layers is None:  # as the other routing settings: the default
            self.kv_cache_dtype_skip_layers = [AUTO_SKIP]
        check_routing_args(self.kv_cache_dtype_skip_layers, self.kv_cache_boundary_layers,
                           self.kv_cache_auto_skip_budget)
        self.kv_cache_dtype_skip_layers = routing_entries(self.kv_cache_dtype_skip_layers)


def resolve_compile_model(args: EngineArgs, device: torch.device) -> bool:
    """Whether the engine compiles the model: compile_model if set, else on CUDA unless
    enforce_eager (on CPU the default stays eager: compiling takes longer than tiny models run)."""
    if args.compile_model is not None:
        return args.compile_model
    return device.type == "cuda" and not args.enforce_eager


def resolve_device(args: EngineArgs) -> torch.device:
    """The engine's device (rank 0's with tensor parallelism: rank r runs on cuda:r; a named
    GPU other than cuda:0 stays as given, for check_tensor_parallel to refuse)."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.tensor_parallel_size > 1 and device.type == "cuda" and device.index is None:
        return torch.device("cuda", 0)
    return device


def resolve_fuse_projections(args: EngineArgs, device: torch.device) -> bool:
    """Whether the q/k/v and gate/up projections run fused: fuse_projections if set, else on
    CUDA without tensor parallelism (on CPU the model stays transformers' own)."""
    if args.fuse_projections is not None:
        return args.fuse_projections
    return device.type == "cuda" and args.tensor_parallel_size == 1


def setup_compilation(args: EngineArgs, device: torch.device) -> bool:
    """Compile caches and counters of this process; returns whether the model is compiled."""
    compile_model = resolve_compile_model(args, device)
    if compile_model or device.type == "cuda":
        compilation.use_cache_dirs()
    compilation.install()
    return compile_model


def build_model_runner(args: EngineArgs, device: torch.device,
                       tp: parallel.TensorParallelGroup | None = None
                       ) -> tuple[LoadedModel, list, ModelRunner, calibration.KeyPlan]:
    """Load the model (this rank's shard with tensor parallelism), bind its attention to the
    per-layer KV-cache plan and wrap it in a model runner: the start-up every rank runs alike."""
    compile_model = resolve_compile_model(args, device)
    loaded = load_model(args.model, dtype=args.dtype, load_format=args.load_format, device=device,
                        seed=args.seed, max_model_len=args.max_model_len,
                        tensor_parallel_size=args.tensor_parallel_size)
    if resolve_fuse_projections(args, device):
        fuse_projections(loaded.model)
    key_plan = plan_keys(args, loaded, device, tp)
    layers = attention_layers(args, loaded, key_plan, device)
    calibration.apply_key_offsets(layers, key_plan, device)
    use_tqattn(loaded.model, [layer.spec for layer in layers])
    groups = kv_cache_groups(layers, args.block_size)
    runner = ModelRunner(loaded.model, layers, groups, args.block_size, device, args.seed,
                         compile_model=compile_model, tp=tp)
    return loaded, layers, runner, key_plan


def plan_keys(args: EngineArgs, loaded: LoadedModel, device: torch.device,
              tp: parallel.TensorParallelGroup | None = None) -> calibration.KeyPlan:
    """Key centering and automatic routing from the start-up calibration (its seconds in
    ``key_plan.seconds``), through the codec each layer's cache will use (padded or not). With
    tensor parallelism every rank calibrates its own heads in the same collective passes and
    the per-layer errors are averaged over the ranks, so all ranks choose the same layers."""
    t0 = time.perf_counter()
    info = loaded.info
    heads = split_heads(info.num_q_heads, info.num_kv_heads, args.tensor_parallel_size)
    plan = calibration.plan_keys(
        loaded.model, loaded.tokenizer, loaded.info, loaded.name,
        kv_cache_dtype=args.kv_cache_dtype, skip_layers=args.kv_cache_dtype_skip_layers,
        boundary_layers=args.kv_cache_boundary_layers, key_centering=args.kv_cache_key_centering,
        auto_skip_budget=args.kv_cache_auto_skip_budget, max_model_len=loaded.max_model_len,
        average=tp.mean if tp is not None else None,
        cache_head_dims=compressed_head_sizes(args, info, heads, device))
    plan.seconds = time.perf_counter() - t0
    return plan


def compressed_head_sizes(args: EngineArgs, info, heads, device: torch.device) -> list[int]:
    """The head size each layer's cache stores if the layer is compressed: the padded one
    (:func:`resolve_pad_head_size`) where padding applies, else the model's."""
    padded = resolve_pad_head_size(args, info, heads, device)
    return [padded if padded is not None and (args.kv_cache_pad_head_size or not window)
            else info.head_dim for window in info.sliding_windows]


def resolve_pad_head_size(args: EngineArgs, info, heads, device: torch.device) -> int | None:
    """The head size compressed layers store: kv_cache_pad_head_size if set, else padded where
    the tensor-core decode kernel then runs them (bench/results/decode8096_pad_h100_s25.md:
    0.33-0.43x FA3 bf16's time padded, 0.93-3.2x compact on the portable kernel); by default
    sliding-window layers, which that kernel does not run, stay compact."""
    if args.kv_cache_pad_head_size is not None:
        return padded_head_size(info.head_dim) if args.kv_cache_pad_head_size else None
    if args.kv_cache_dtype not in PRESETS:
        return None
    return tensor_core_padding(args.kv_cache_dtype, info.head_dim, heads.num_q_heads,
                               heads.num_kv_heads, args.block_size, device,
                               info.attn_logit_softcapping or 0.0)


def attention_layers(args: EngineArgs, loaded: LoadedModel, key_plan: calibration.KeyPlan,
                     device: torch.device) -> list:
    """Each layer's spec from the HF config (this rank's heads with tensor parallelism), its KV
    dtype from the routing (``key_plan.auto_layers``: what automatic routing chose), its
    backend."""
    info = loaded.info
    routing = (info.num_layers, info.sliding_windows)
    auto = key_plan.auto_layers
    dtypes = resolve_kv_cache_dtypes(*routing, args.kv_cache_dtype, args.kv_cache_dtype_skip_layers,
                                     args.kv_cache_boundary_layers, auto)
    if args.kv_cache_dtype in PRESETS and FULL_PRECISION in dtypes:
        rules = full_precision_layers(*routing, args.kv_cache_dtype_skip_layers,
                                      args.kv_cache_boundary_layers, auto)
        logger.warning("kv_cache_dtype=%s: %s keep a full-precision cache", args.kv_cache_dtype,
                       describe_full_precision(rules, info.num_layers))
    heads = split_heads(info.num_q_heads, info.num_kv_heads, args.tensor_parallel_size)
    cache_sizes = [d if dtypes[i] in PRESETS and d != info.head_dim else None
                   for i, d in enumerate(compressed_head_sizes(args, info, heads, device))]
    padded = next((d for d in cache_sizes if d is not None), None)
    if padded is not None:
        grow = (build_layout(args.kv_cache_dtype, padded).slot_bytes
                / build_layout(args.kv_cache_dtype, info.head_dim).slot_bytes)
        logger.info("kv_cache_pad_head_size: head size %d stored zero-padded to %d in %d "
                    "compressed layers (%.2fx their bytes, the tensor-core decode kernel; "
                    "--no-kv-cache-pad-head-size keeps them compact)", info.head_dim, padded,
                    cache_sizes.count(padded), grow)
    specs = [AttentionLayerSpec(
        layer_idx=i, num_heads=heads.num_q_heads, num_kv_heads=heads.num_kv_heads,
        head_size=info.head_dim, scale=info.scaling, dtype=loaded.dtype,
        kv_cache_dtype=dtypes[i], sliding_window=info.sliding_windows[i],
        logits_soft_cap=info.attn_logit_softcapping or 0.0, kv_cache_head_size=cache_sizes[i])
        for i in range(info.num_layers)]
    try:
        return build_attention_layers(specs, args.block_size)
    except ValueError as e:
        raise ValueError(f"model {loaded.name} (head size {info.head_dim}) cannot use "
                         f"kv_cache_dtype={args.kv_cache_dtype!r}: {e}; pick another preset "
                         f"(see `tqattn presets`) or kv_cache_dtype='auto'") from e


def _check_device(device: str | None) -> None:
    """A device this process can use: None, "cpu", or "cuda[:N]" with a visible CUDA device."""
    if device is None:
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is not supported; use 'cpu', 'cuda' or 'cuda:N' "
                         f"(or None: cuda if available, else cpu)")
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device={device!r} but torch {torch.__version__} sees no CUDA device "
                             f"(a CPU-only build, or no GPU visible); use device='cpu'")
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"device={device!r} but torch sees {count} CUDA device(s): "
                             f"cuda:0..cuda:{count - 1}")


@dataclass
class _Inflight:
    """A launched step whose sampled tokens the host has not read yet."""
    out: Any  # SchedulerOutput
    tokens: SampledTokens
    graph_bucket: int | None = None
    finished: list = field(default_factory=list)  # finished by length when it was launched
    start: float = 0.0  # perf_counter when the call that launched it began
    host_s: float = 0.0  # that call's time, less its waits for the device
    done_at: float | None = None  # perf_counter when its tokens reached the host


@dataclass
class _Request:
    request_id: Hashable
    prompt: str | None
    seq: Sequence
    params: SamplingParams
    metrics: RequestMetrics
    generator: torch.Generator | None = None
    text: str = ""
    stop_string: str | None = None


class LLMEngine:
    def __init__(self, args: EngineArgs):
        """Start-up: (with tensor parallelism: check the model's heads and the devices, start the
        other ranks) load, compile (a first forward), size and allocate the KV cache (on CUDA
        after a profile step), warm up every step kind, capture the decode CUDA graphs. Each
        part's seconds are in ``startup_times``; compilations after it, in
        :meth:`compilation_counts`."""
        self.args = args
        self.device = resolve_device(args)
        self.workers = None  # tensor parallelism: ranks 1..N-1 (worker.WorkerPool)
        t0 = time.perf_counter()
        if args.tensor_parallel_size > 1:
            from .worker import WorkerPool

            # before any process starts: a bad size or model fails here
            parallel.check_tensor_parallel(args.tensor_parallel_size,
                                           load_config(args.model, args.load_format), self.device)
            self.workers = WorkerPool(args, self.device)
        self._finalizer = weakref.finalize(self, _stop_workers, self.workers)
        try:
            with compilation.starting_up():
                self._start(args, t0)
        except BaseException:
            if self.workers is not None:  # a worker may wait in a collective for this rank
                self.workers.shutdown(graceful=False)
            raise

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (also run when the engine is deleted or at exit);
        the engine cannot step after it. Nothing to do without tensor parallelism."""
        self._finalizer()

    def _start(self, args: EngineArgs, t0: float) -> None:
        cuda = self.device.type == "cuda"
        lap = time.perf_counter()
        compile_model = setup_compilation(args, self.device)
        # the compile pool's workers would run the model without the other ranks
        precompiler = (precompile.start(self.device, args.enforce_eager)
                       if args.tensor_parallel_size == 1 else None)  # its workers start now
        self.startup_times: dict[str, float] = {}
        if self.workers is not None:  # the checks, until every rank joined the process group
            self.startup_times["start_workers"] = lap - t0
        # what the warm-up compiled (compilation.builds_since) and the precompile's summary
        # (None: it failed), where they ran
        self.startup_builds: dict[str, dict | None] = {}

        def done(part: str) -> None:
            nonlocal lap
            now = time.perf_counter()
            self.startup_times[part] = now - lap
            lap = now

        tp = self.workers.group if self.workers is not None else None
        loaded, self.layers, runner, self.key_plan = build_model_runner(args, self.device, tp)
        self.loaded, self.runner = loaded, runner
        self.tokenizer = loaded.tokenizer
        self.model_info = loaded.info
        config = SchedulerConfig(
            max_model_len=loaded.max_model_len, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_chunked_prefill=args.enable_chunked_prefill,
            enable_prefix_caching=args.enable_prefix_caching, block_size=args.block_size)
        groups = runner.groups
        done("load")
        # the calibration ran inside the load: its own part
        self.startup_times["load"] -= self.key_plan.seconds
        self.startup_times["calibration"] = self.key_plan.seconds
        if compile_model:  # at the largest step's size (what Inductor tunes for), then the
            # one-token graph (compilation.compile_layers)
            runner.dummy_prefill(args.max_num_batched_tokens, loaded.max_model_len)
            runner.dummy_prefill(1, loaded.max_model_len)
        done("compile")
        num_blocks = self._num_blocks(sum(g.page_bytes for g in groups), loaded.max_model_len)
        self.kv_cache_config = KVCacheConfig(args.block_size, num_blocks, groups)
        runner.allocate_kv_cache(num_blocks)
        done("kv_cache")
        if compile_model or cuda:  # the first use of each kernel variant compiles it
            extra = backend_token_counts(self.layers, args.block_size, self.device,
                                         args.max_num_batched_tokens)
            steps = warmup_steps(args.max_num_seqs, args.max_num_batched_tokens,
                                 loaded.max_model_len, args.block_size, extra)
            if precompiler is not None:  # the builds compiled in parallel, into the disk cache
                self.startup_builds["precompile"] = precompiler.run(
                    [partial(run_warmup, runner, [step]) for step in steps])
                done("precompile")
            before = compilation.mark()
            run_warmup(runner, steps)
            builds = self.startup_builds["warmup"] = compilation.builds_since(before)
            logger.info("warm-up: %d Triton kernel builds loaded from the disk cache, %d compiled; "
                        "%d Dynamo compiles", builds["triton_loaded"], builds["triton_compiled"],
                        builds["dynamo"])
        done("warmup")
        if precompiler is not None:
            precompiler.close()
        if cuda and not args.enforce_eager:
            runner.capture_cudagraphs(args.max_num_seqs, loaded.max_model_len)
        done("cudagraph_capture")

        self.block_manager = BlockManager([num_blocks] * len(groups), args.block_size,
                                          args.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager, self._eos_token_ids())
        self.requests: dict[Hashable, _Request] = {}
        self.step_records: list[StepRecord] | None = None  # see record_steps()
        self.async_scheduling = (cuda if args.async_scheduling is None else args.async_scheduling)
        runner.share_sampled_tokens = self.async_scheduling  # the other ranks feed them in
        self._inflight: _Inflight | None = None
        self._last_done = 0.0  # perf_counter when the last step's tokens reached the host
        self._last_ended = None  # the last recorded step's end event (device timing)
        self.plan = describe_plan(self.layers, args.block_size)
        self.plan.update(centered_layers=self.key_plan.centered_layers,
                         auto_routing=self.key_plan.routing, calibration=self.key_plan.describe())
        self.plan.update(num_blocks=num_blocks, block_size=args.block_size,
                         cache_tokens=self.kv_cache_config.num_tokens,
                         cache_bytes=self.kv_cache_config.total_bytes,
                         bf16_cache_tokens=self.kv_cache_config.total_bytes // bf16_bytes_per_token(self.layers))
        info, n = self.model_info, args.tensor_parallel_size
        heads = split_heads(info.num_q_heads, info.num_kv_heads, n)
        self.plan.update(tensor_parallel_size=n, q_heads_per_rank=heads.num_q_heads,
                         kv_heads_per_rank=heads.num_kv_heads, kv_head_replicas=heads.kv_head_replicas,
                         num_q_heads=info.num_q_heads, num_kv_heads=info.num_kv_heads)
        self.startup_times["total"] = self.load_time = time.perf_counter() - t0
        self._compile_mark = runner.compile_mark = compilation.mark()
        logger.info("%s", format_plan(self.plan))
        logger.info("start-up %s", format_startup(self.startup_times, compile_model,
                                                  bool(runner.graphs)))
        breaks = compilation.graph_breaks() if compile_model else {}
        if breaks:
            logger.warning("the compiled model has graph breaks (each a separate graph, and a "
                           "possible recompile per step size): %s", breaks)

    def compilation_counts(self) -> dict:
        """Compilations since start-up ended, in this process: ``dynamo`` (frames compiled or
        recompiled), ``triton`` (Triton/Gluon kernel variants built), ``total``, and their
        names (``dynamo_frames``, ``triton_kernels``)."""
        return compilation.since(self._compile_mark)

    def num_compilations(self) -> int:
        """compilation_counts()'s total, without naming what compiled (cheap enough per step)."""
        return compilation.count_since(self._compile_mark)

    def _num_blocks(self, bytes_per_block: int, max_model_len: int) -> int:
        args = self.args
        available = None
        if (self.device.type == "cuda" and args.kv_cache_memory_bytes is None
                and args.num_gpu_blocks_override is None):
            available = self.runner.profile_free_memory(
                args.gpu_memory_utilization, args.max_num_batched_tokens, max_model_len)
        return determine_num_blocks(
            bytes_per_block, args.block_size, max_model_len,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes, available_bytes=available,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            max_useful_blocks=args.max_num_seqs * -(-max_model_len // args.block_size))

    def _eos_token_ids(self) -> list[int]:
        # generation_config is what transformers' generate stops on; the model config otherwise.
        eos = self.loaded.config.eos_token_id
        gen_eos = getattr(getattr(self.loaded.model, "generation_config", None), "eos_token_id", None)
        eos = gen_eos if gen_eos is not None else eos
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    # ---- requests --------------------------------------------------------------------------------

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass {'prompt_token_ids': [...]} instead of text")
        return list(self.tokenizer.encode(prompt))

    def check_token_ids(self, token_ids: list) -> None:
        """Raise ValueError naming the ids that are not ints in [0, vocab)."""
        vocab = self.model_info.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            text = " (text where token ids go: tokenize it first)" if any(isinstance(t, str) for t in bad) else ""
            raise ValueError(f"prompt token ids {bad[:5]} are not ints in [0, {vocab}){text}")

    def add_request(self, request_id: Hashable, prompt: str | dict | list[int],
                    params: SamplingParams | None = None) -> None:
        params = params or SamplingParams()
        text = None
        if isinstance(prompt, str):
            text, token_ids = prompt, self.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            token_ids, text = list(prompt["prompt_token_ids"]), prompt.get("prompt")
        elif isinstance(prompt, dict) and "prompt" in prompt:
            text = prompt["prompt"]
            token_ids = self.encode(text)
        else:
            raise ValueError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
        try:
            self.check_token_ids(token_ids)
        except ValueError as e:
            raise RequestError(request_id, str(e)) from None
        if not token_ids:
            raise RequestError(request_id, "the prompt is empty")
        if request_id in self.requests:
            raise ValueError(f"a request with id {request_id!r} is already running")
        seq = Sequence(token_ids, params, seq_id=request_id)
        generator = make_generator(params.seed, self.device)
        self.scheduler.add(seq)  # validates lengths against max_model_len and the cache
        self.requests[request_id] = _Request(
            request_id, text, seq, params, RequestMetrics(arrival_time=time.perf_counter()), generator)

    def abort_request(self, request_id: Hashable) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.abort(request_id)
        return True

    def abort_all(self) -> int:
        """Abort every request, and any sequence the scheduler holds without one; how many."""
        ids = set(self.requests) | set(self.scheduler.seqs)
        for rid in ids:
            self.requests.pop(rid, None)
            self.scheduler.abort(rid)
        return len(ids)

    def request_progress(self, request_id: Hashable) -> tuple[list[int], str] | None:
        """A running request's output so far: (token ids, decoded text), or None if it is not
        running. With async scheduling the token of the step in flight is not included."""
        ids = self.request_token_ids(request_id)
        if ids is None:
            return None
        return ids, self._decode_ids(ids, self.requests[request_id].params)

    def request_token_ids(self, request_id: Hashable, start: int = 0) -> list[int] | None:
        """A running request's output token ids from index ``start`` on (as request_progress's),
        or None if it is not running; costs only the new ids."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        seq = req.seq
        ids = seq.token_ids[seq.num_prompt_tokens + start:]
        if ids and ids[-1] == PLACEHOLDER:
            ids.pop()
        return ids

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight_is_live()

    def _is_live(self, seq: Sequence) -> bool:
        req = self.requests.get(seq.seq_id)
        return req is not None and req.seq is seq  # not aborted (its id may run again since)

    def _inflight_is_live(self) -> bool:
        """Whether the step in flight holds an output or tokens of a live request."""
        s = self._inflight
        return s is not None and (any(map(self._is_live, s.finished))
                                  or any(self._is_live(x.seq) for x in s.out.scheduled))

    def flush(self) -> None:
        """Read a step still in flight whose requests have all gone (a finished or abandoned
        stream's next decode, launched before its last token was read): the engine is idle."""
        if self._inflight is not None and not self.has_unfinished_requests():
            self.step()

    # ---- scoring ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def score(self, token_ids: list[int], chunk_size: int, logprobs_start: int) -> torch.Tensor:
        """Next-token log-probs at positions logprobs_start.. of token_ids (see LLM.score).

        The tokens are prefilled as one sequence in consecutive chunks of chunk_size, one
        model-runner step per chunk through the same metadata, cache writes and attention
        backends as a generate() prefill; the prefix cache is neither read nor written, and
        the blocks are freed before returning (also on error).
        """
        n, bm = len(token_ids), self.block_manager
        seq = Sequence(token_ids, SamplingParams(temperature=0.0, max_tokens=1),
                       seq_id=("score", id(token_ids)))
        out = None  # (n - logprobs_start, LM-head width), allocated at the first scored chunk
        try:
            for pos in range(0, n, chunk_size):
                m = min(chunk_size, n - pos)
                if not bm.allocate_slots(seq, m):
                    raise RuntimeError(f"the KV cache has no free blocks for {n} tokens "
                                       f"({bm.num_free_blocks()} free blocks of {bm.block_size})")
                rows = list(range(max(logprobs_start - pos, 0), m))
                sched = ScheduledSeq(seq, m, False, pos)
                logits = self.runner.logits_at([sched], rows)  # no rows: no LM head
                if rows:
                    if out is None:
                        out = torch.empty(n - logprobs_start, logits.shape[-1], dtype=torch.float32)
                    a = pos + rows[0] - logprobs_start
                    out[a:a + len(rows)] = torch.log_softmax(logits.float(), -1).cpu()
                seq.num_computed_tokens += m
        finally:
            bm.free(seq)
        return out

    # ---- step ------------------------------------------------------------------------------------

    def record_steps(self, enable: bool = True) -> None:
        """Start (or stop) recording a StepRecord per step in ``step_records`` (a fresh list)."""
        self.step_records = [] if enable else None
        self.runner.time_steps = enable
        self._last_ended = None

    def stats(self) -> dict:
        """Scheduler counters: preemptions, recomputed tokens, computed tokens, peak running."""
        return self.scheduler.stats.as_dict()

    def reset_stats(self) -> None:
        self.scheduler.stats = SchedulerStats()

    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; return the outputs of the requests that finished.

        With async scheduling the step is launched before the tokens of the step before it are
        read (module docstring), so a request's output comes from the call after the one that
        computed its last token."""
        start = time.perf_counter()
        out = self.scheduler.schedule()
        prev, launched = self._inflight, None
        if not out.is_empty:
            for s in out.scheduled:
                m = self.requests[s.seq.seq_id].metrics
                m.first_scheduled_time = m.first_scheduled_time or start
            generators = {r.request_id: r.generator for r in self.requests.values()
                          if r.generator is not None}
            tokens = self.runner.launch(out.scheduled, generators, prev.tokens if prev else None)
            launched = _Inflight(out, tokens, graph_bucket=self.runner.last_graph_bucket)
        self._inflight = None  # after the launch: a launch that raises leaves prev to read
        finished, wait = [], 0.0
        if prev is not None:  # its tokens before this step's placeholders
            wait = self._complete(prev, finished)
        if launched is not None:
            launched.start = start
            launched.finished = self.scheduler.update_from_output(
                out, dict.fromkeys(launched.tokens.seq_ids, PLACEHOLDER))
            if self.async_scheduling:
                self._inflight = launched
            else:
                wait += self._complete(launched, finished)
        outputs = []
        now = time.perf_counter()
        for seq in finished:
            if self._is_live(seq):  # else aborted while its last step ran
                req = self.requests.pop(seq.seq_id)
                req.metrics.finished_time = now
                outputs.append(self._output(req))
        if launched is not None:
            launched.host_s = time.perf_counter() - start - wait
        for s in (prev, launched):
            if s is not None and s.done_at is not None:
                self._record_step(s)
        return outputs

    def _complete(self, step: _Inflight, finished: list[Sequence]) -> float:
        """Put a launched step's sampled tokens in place of its placeholders and apply what
        depends on their values (stop tokens, stop strings); extend ``finished`` with the
        sequences it finished. Returns the seconds spent waiting for the device."""
        t = time.perf_counter()
        values = step.tokens.host()
        now = step.done_at = time.perf_counter()
        finished.extend(step.finished)
        seqs = {s.seq.seq_id: s.seq for s in step.out.scheduled}
        for seq_id, token in zip(step.tokens.seq_ids, values):
            req = self.requests.get(seq_id)
            if req is None or req.seq is not seqs.get(seq_id):  # aborted meanwhile
                continue
            seq = req.seq
            if seq.token_ids[-1] != PLACEHOLDER:  # not advanced by the step (finished before it)
                continue
            seq.token_ids[-1] = token
            req.metrics.first_token_time = req.metrics.first_token_time or now
            if self.scheduler.stop_on_token(seq, token):
                finished.append(seq)
            if req.params.stop and req.stop_string is None:
                self._check_stop_strings(req, finished)
        return now - t

    def _record_step(self, step: _Inflight) -> None:
        """A completed step's record: wall time from the completion of the step before (or its
        own launch, if later) to its tokens on the host — with async scheduling, what it kept
        the device busy; host time: the call that launched it, less its waits for the device."""
        wall = step.done_at - max(step.start, self._last_done)
        self._last_done = step.done_at
        if self.step_records is None:
            return
        gpu_ms = idle_ms = None
        t = step.tokens
        if t.started is not None:
            gpu_ms = t.started.elapsed_time(t.ended)
            # the device's gap between the previous step's last kernel and this step's first
            if self._last_ended is not None:
                idle_ms = max(0.0, self._last_ended.elapsed_time(t.started))
            self._last_ended = t.ended
        out = step.out
        n, nd = len(out.scheduled), out.num_decodes
        kind = "decode" if nd == n else "prefill" if nd == 0 else "mixed"
        self.step_records.append(StepRecord(
            kind=kind, num_tokens=out.num_batched_tokens, num_seqs=n, num_decodes=nd,
            graph_bucket=step.graph_bucket, wall_ms=wall * 1e3, host_ms=step.host_s * 1e3,
            num_preempted=len(out.preempted), device_ms=gpu_ms, device_idle_ms=idle_ms))

    def _decode(self, req: _Request) -> str:
        return self._decode_ids(req.seq.output_token_ids, req.params)

    def _decode_ids(self, token_ids: list[int], params: SamplingParams) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens)

    def _check_stop_strings(self, req: _Request, finished: list[Sequence]) -> None:
        text = self._decode(req)
        # Only the new tail can hold a stop string that was not there before.
        start = max(0, len(req.text) - max(len(s) for s in req.params.stop))
        req.text = text
        hits = [(i, s) for s in req.params.stop if (i := text.find(s, start)) >= 0]
        if not hits:
            return
        idx, stop = min(hits)
        req.text, req.stop_string = text[:idx], stop
        if self.scheduler.finish(req.request_id):  # still running: finish it now
            finished.append(req.seq)
        req.seq.status = SequenceStatus.FINISHED_STOPPED

    def _output(self, req: _Request) -> RequestOutput:
        seq = req.seq
        text = req.text if req.stop_string is not None else self._decode(req)
        m = req.metrics
        m.num_preemptions, m.num_cached_tokens = seq.num_preemptions, seq.num_cached_tokens
        completion = CompletionOutput(
            index=0, text=text, token_ids=seq.output_token_ids,
            finish_reason=_FINISH_REASONS.get(seq.status),
            stop_reason=req.stop_string if req.stop_string is not None else seq.stop_reason)
        return RequestOutput(request_id=req.request_id, prompt=req.prompt,
                             prompt_token_ids=seq.prompt_token_ids, outputs=[completion],
                             finished=True, metrics=m)


def _stop_workers(workers) -> None:
    if workers is not None:
        workers.shutdown()


def format_startup(times: dict[str, float], compiled: bool, graphs: bool) -> str:
    """One line: the start-up parts' seconds."""
    parts = ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in times.items() if k != "total")
    return (f"{times['total']:.1f} s ({parts}); model {'compiled' if compiled else 'eager'}, "
            f"decode CUDA graphs {'on' if graphs else 'off'}")


def format_plan(plan: dict) -> str:
    """A few human lines describing the per-layer KV-cache plan."""
    backends = ", ".join(f"{n} x{c}" for n, c in plan["backends"].items())
    dtypes = ", ".join(f"{d} x{c}" for d, c in plan["kv_cache_dtypes"].items())
    lines = [f"KV-cache plan: {plan['num_layers']} layers: {backends}; kv_cache_dtype: {dtypes}"]
    for g in plan["groups"]:
        padded = (f" (head size {g['head_size']} stored zero-padded to {g['cache_head_size']})"
                  if g.get("cache_head_size", g.get("head_size")) != g.get("head_size") else "")
        lines.append(f"  group {g['group']}: {g['backend']} {g['kv_cache_dtype']} layers {g['layers']}{padded}")
    if plan.get("calibration"):
        lines.append(f"  {plan['calibration']}")
    if plan.get("auto_routing"):
        lines.append(f"  {plan['auto_routing']}")
    tp = plan.get("tensor_parallel_size", 1)
    per_rank = " per rank" if tp > 1 else ""
    if tp > 1:
        how = (f"each KV head on {plan['kv_head_replicas']} ranks" if plan["kv_head_replicas"] > 1
               else "KV heads sharded")
        lines.append(f"  tensor parallel: {tp} ranks, {plan['q_heads_per_rank']} of {plan['num_q_heads']} "
                     f"attention heads and {plan['kv_heads_per_rank']} of {plan['num_kv_heads']} KV heads "
                     f"per rank ({how}); all ranks' cache: {tp * plan['cache_bytes'] / 2**20:.1f} MiB")
    lines.append(f"  {plan['bytes_per_token']:.1f} bytes/token{per_rank} (bf16: {plan['bf16_bytes_per_token']}), "
                 f"{plan['capacity_vs_bf16']:.2f}x the tokens of bf16; cache{per_rank}: {plan['num_blocks']} blocks "
                 f"x {plan['block_size']} = {plan['cache_tokens']} tokens in {plan['cache_bytes'] / 2**20:.1f} MiB "
                 f"(bf16 would hold {plan['bf16_cache_tokens']})")
    return "\n".join(lines)
