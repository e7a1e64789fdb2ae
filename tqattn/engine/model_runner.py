"""Runs one scheduled step through the transformers model: inputs, metadata, forward, sampling.

All scheduled tokens of a step are flattened into one (1, T) batch with their positions
(decodes first, then prefill chunks). Per KV-cache group, a CommonAttentionMetadata describes the
batch (the block tables and slots differ between groups), and the group's backend builder turns
it into the backend's metadata. The attention calls find both in the forward context.

Compiled model (``compile_model``): the decoder layers run through ``torch.compile`` with the
token dimension dynamic (:func:`tqattn.engine.compilation.compile_layers`), compiled by the
first forward and, for one-token steps, by the first of those (start-up makes both calls);
prefill and mixed steps run it directly.

CUDA graphs (CUDA only, unless enforce_eager): pure-decode steps replay a graph captured per
batch-size bucket over the (compiled or eager) forward, the batch padded to the bucket (padding
rows: seq_len 0, slot −1). The graph reads static input buffers that each step overwrites; the
backends' metadata is built once per bucket at capture, over those buffers. That needs every
KV-cache group's backend to declare ``cudagraph_decode`` (its pure-decode metadata is only views
of the CommonAttentionMetadata device tensors and its decode kernels never sync with the host:
TURBOQUANT, FLASH_ATTN); a model with a layer on any other backend runs decode eagerly (logged).

Tensor parallelism (``tp``, :mod:`tqattn.engine.parallel`): every rank has a runner over its shard
of the model. Rank 0's runner fills each step's host arrays, sends them to the other ranks and
runs the step; they run it from the arrays (:meth:`ModelRunner.worker_step`). The start-up calls
(``@_on_every_rank``) are sent by name and run on every rank. Only rank 0 samples.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Hashable

import torch

from tqattn.attention.backend import AttentionLayer, CommonAttentionMetadata
from tqattn.attention.forward_context import ForwardContext, set_forward_context

from . import compilation
from .input_batch import InputBatch, StepHost, StepInputs
from .sampled import SampledTokens, apply_feed
from .kv_cache import KVCacheGroup, allocate_kv_caches
from .sampling import Sampler, SamplingParams
from .scheduler import ScheduledSeq
from .sequence import Sequence

logger = logging.getLogger(__name__)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.device.type != "cpu":  # already on a device (cuda vs cuda:0 compare unequal)
        return t.to(device)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _on_every_rank(method):
    """A start-up call every tensor-parallel rank runs: rank 0 sends it to the others first (the
    steps it makes inside are not sent: each rank makes them itself)."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if self.tp is None or not self.tp.is_driver or self._in_call:
            return method(self, *args, **kwargs)
        with self.tp.collective():
            self.tp.send(("call", method.__name__, args, kwargs))
            self._in_call = True
            try:
                return method(self, *args, **kwargs)
            finally:
                self._in_call = False
    return call


class ModelRunner:
    def __init__(self, model: torch.nn.Module, layers: list[AttentionLayer],
                 groups: list[KVCacheGroup], block_size: int, device: torch.device, seed: int = 0,
                 compile_model: bool = False, tp=None):
        self.model = model
        self.tp = tp  # a parallel.TensorParallelGroup, or None
        self._in_call = False  # rank 0 inside an @_on_every_rank call: its steps are not sent
        self.share_sampled_tokens = False  # rank 0 sends each step's tokens (async scheduling)
        self._shared_tokens = None  # other ranks: the last step's tokens from rank 0
        self.compile_model = compile_model
        self._logits = compilation.model_logits
        if compile_model:  # compiled by the first forward (the start-up's "compile" part)
            compilation.compile_layers(model)
        self.compile_mark = None  # set when start-up ends: compilations after it are logged
        self._compiles_seen = (0, 0)
        self.layers = {layer.spec.layer_idx: layer for layer in layers}
        self.groups = groups
        self.block_size = block_size
        self.device = device
        impls = {layer.spec.name: layer.impl for layer in layers}
        self.builders = [g.backend.builder_cls(impls, device) for g in groups]
        self.sampler = Sampler(seed)
        self.kv_caches: dict[int, torch.Tensor] = {}
        self.num_blocks = 0
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # bucket -> (graph, logits)
        self.input_batch = InputBatch(len(groups), block_size, device)
        self.last_graph_bucket: int | None = None  # of the last step; None: it ran without a graph
        self.time_steps = False  # CUDA events around each step's device work (record_steps)

    @_on_every_rank
    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.graphs = {}  # captured over the old tensors
        self.kv_caches = {}  # free the old tensors first
        self.kv_caches = allocate_kv_caches(list(self.layers.values()), num_blocks,
                                            self.block_size, self.device)
        self.num_blocks = num_blocks

    # ---- inputs ----------------------------------------------------------------------------------

    def _prepare(self, scheduled: list[ScheduledSeq]):
        """(input_ids, positions, per-group metadata, token index of each sampling request)."""
        x = self.input_batch.prepare(scheduled)
        return x.input_ids, x.positions, self._metadata(x), x.sample_idx

    def _metadata(self, x: StepInputs) -> list:
        """Each KV-cache group's backend metadata of a step."""
        shared = dict(
            query_start_loc=x.query_start_loc, seq_lens=x.seq_lens, num_computed_tokens=x.num_computed_tokens,
            query_start_loc_cpu=x.query_start_loc_cpu, seq_lens_cpu=x.seq_lens_cpu,
            num_computed_tokens_cpu=x.num_computed_tokens_cpu, num_reqs=x.num_reqs,
            num_actual_tokens=x.num_tokens, max_query_len=x.max_query_len, max_seq_len=x.max_seq_len,
            num_decodes=x.num_decodes, num_decode_tokens=x.num_decodes, block_size=self.block_size)
        metadata = [builder.build(CommonAttentionMetadata(block_table=x.block_tables[g],
                                                          slot_mapping=x.slot_mappings[g], **shared))
                    for g, builder in enumerate(self.builders)]
        self.input_batch.copies_issued()  # the builders may have copied from the host buffers too
        return metadata

    # ---- step ------------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduled: list[ScheduledSeq],
                      generators: dict[Hashable, torch.Generator] | None = None) -> dict[Hashable, int]:
        """Run one step; return the sampled token of each request whose chunk reached its end."""
        sampled = self.launch(scheduled, generators)
        return dict(zip(sampled.seq_ids, sampled.host()))

    @torch.inference_mode()
    def launch(self, scheduled: list[ScheduledSeq],
               generators: dict[Hashable, torch.Generator] | None = None,
               pending: SampledTokens | None = None) -> SampledTokens:
        """Queue one step on the device: inputs, forward, sampling, the copy of the tokens to the
        host; nothing waits for the device. ``pending``: the tokens of the step before, still in
        flight, that this step's placeholders stand for (module sampled.py)."""
        sampling = [s.seq for s in scheduled if s.samples]
        if not scheduled:
            return SampledTokens([], None)
        started = None
        if self.time_steps and self.device.type == "cuda":
            started = torch.cuda.Event(enable_timing=True)
            started.record()
        bucket = self._graph_bucket(scheduled)
        host = (self.input_batch.fill(scheduled) if bucket is None
                else self.input_batch.fill_decode(scheduled, bucket))
        feed = pending.feed_index(scheduled) if pending is not None else None
        sends = self._sends()
        share = len(sampling) if self.share_sampled_tokens and sends else 0
        with self.tp.collective() if sends else contextlib.nullcontext():
            if sends:
                self.tp.send(("step", host, host.sample_idx, feed, share))
            logits = self.run_step(host, host.sample_idx, feed, pending.device if pending is not None else None)
            if not sampling or (self.tp is not None and not self.tp.is_driver):
                return SampledTokens([], None, started)
            generators = generators or {}
            tokens = self.sampler.sample(logits, [seq.sampling_params for seq in sampling],
                                         [generators.get(seq.seq_id) for seq in sampling])
            if share:
                self.tp.share_tokens(tokens)
        return SampledTokens([seq.seq_id for seq in sampling], tokens, started)

    @torch.inference_mode()
    def logits_at(self, scheduled: list[ScheduledSeq], rows: list[int]) -> torch.Tensor:
        """Run one step without sampling: the logits (len(rows), vocab) at the given flattened
        token indices (no LM head when rows is empty)."""
        host = self.input_batch.fill(scheduled)
        if not self._sends():
            return self.run_step(host, rows)
        with self.tp.collective():
            self.tp.send(("step", host, rows, None, 0))
            return self.run_step(host, rows)

    def _sends(self) -> bool:
        """Whether this runner sends its steps to other ranks (rank 0, outside a start-up call)."""
        return self.tp is not None and self.tp.is_driver and not self._in_call

    def run_step(self, host: StepHost, logits_index: list[int], feed=None,
                 tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The device half of a step: inputs to the device, forward (or graph replay), logits at
        logits_index. feed/tokens: the placeholders' tokens of the step before (sampled.py)."""
        self.last_graph_bucket = host.bucket
        if host.bucket is not None:
            self.input_batch.to_static(host, self.static)
            apply_feed(self.static["input_ids"], feed, tokens)
            graph, logits = self.graphs[host.bucket]
            graph.replay()
            return logits[:host.num_reqs]
        x = self.input_batch.upload(host)
        metadata = self._metadata(x)
        input_ids = x.input_ids
        if feed is not None:
            input_ids = _to_device(input_ids, self.device)
            apply_feed(input_ids, feed, tokens)
        return self.forward(input_ids, x.positions, metadata, logits_index)

    @torch.inference_mode()
    def worker_step(self, host: StepHost, logits_index: list[int], feed, share: int) -> None:
        """A rank other than 0: run the step rank 0 sent (its logits are rank 0's to sample)."""
        self.run_step(self.input_batch.load(host), logits_index, feed, self._shared_tokens)
        if share:
            self._shared_tokens = self.tp.receive_tokens(share)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: list,
                sample_idx: list[int]) -> torch.Tensor:
        """Logits (len(sample_idx), vocab) at the given flattened token indices."""
        dev = self.device
        # A step that samples nothing still takes the logits of one token (the LM head on one
        # row costs next to nothing), so the model never sees an empty index.
        keep = torch.tensor(sample_idx or [len(input_ids) - 1], dtype=torch.int64)
        with set_forward_context(ForwardContext(self.layers, self.kv_caches, metadata)):
            logits = self._call_model(_to_device(input_ids, dev), _to_device(positions, dev),
                                      _to_device(keep, dev))
        return logits[:len(sample_idx)]

    def _call_model(self, input_ids: torch.Tensor, positions: torch.Tensor,
                    logits_index: torch.Tensor) -> torch.Tensor:
        logits = self._logits(self.model, input_ids, positions, logits_index)
        if self.compile_mark is not None:
            self._compiles_seen = compilation.warn_new(self.compile_mark, self._compiles_seen)
        return logits

    # ---- dummy steps (start-up) ------------------------------------------------------------------

    def dummy_batch(self, chunks: list[tuple[int, int]]) -> list[ScheduledSeq]:
        """One scheduled chunk per (num_computed_tokens, num_scheduled_tokens) pair, of dummy
        sequences (token 0, greedy) whose block tables wrap around the allocated cache: no block
        manager, no prefix cache. Run before any request, what they write is never read (a
        request writes each slot before it reads it)."""
        batch, next_block = [], 0
        for computed, n in chunks:
            total = computed + n
            table = [(next_block + j) % self.num_blocks for j in range(-(-total // self.block_size))]
            next_block += len(table)
            seq = Sequence([0] * total, SamplingParams(temperature=0))
            seq.block_tables = [list(table) for _ in self.groups]
            batch.append(ScheduledSeq(seq, n, computed > 0 and n == 1, computed))
        return batch

    @_on_every_rank
    @torch.inference_mode()
    def dummy_prefill(self, num_tokens: int, max_model_len: int) -> None:
        """A prefill step of num_tokens tokens (prompts of at most max_model_len) on a one-block
        cache that every slot maps to, freed after: the first call of a compiled model compiles
        it; on CUDA it also shows the activation peak of the largest step."""
        self.allocate_kv_cache(1)
        lens = [min(max_model_len, num_tokens - i) for i in range(0, num_tokens, max_model_len)]
        self.execute_model(self.dummy_batch([(0, n) for n in lens]))
        self.kv_caches = {}
        self.num_blocks = 0

    # ---- memory profiling (CUDA) -----------------------------------------------------------------

    @_on_every_rank
    @torch.inference_mode()
    def profile_free_memory(self, gpu_memory_utilization: float, num_tokens: int,
                            max_model_len: int) -> int:
        """Bytes the KV cache may take: utilization x total memory, minus what is in use now and
        the activation peak of a prefill step of num_tokens tokens (vLLM's profile run)."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.dummy_prefill(num_tokens, max_model_len)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        activations = peak - torch.cuda.memory_allocated()
        available = int(gpu_memory_utilization * total - (total - free) - activations)
        if self.tp is not None:  # one cache size on every rank: what the fullest GPU leaves
            available = self.tp.min(available)
        logger.info("memory profile: %.2f GiB total, %.2f GiB in use, %.2f GiB activation peak "
                    "-> %.2f GiB for the KV cache at gpu_memory_utilization=%.2f", total / 2**30,
                    (total - free) / 2**30, activations / 2**30, available / 2**30,
                    gpu_memory_utilization)
        return available

    # ---- CUDA graphs -----------------------------------------------------------------------------

    def _graph_bucket(self, scheduled: list[ScheduledSeq]) -> int | None:
        if not self.graphs or not all(s.num_scheduled_tokens == 1 and s.is_decode for s in scheduled):
            return None
        return next((b for b in sorted(self.graphs) if b >= len(scheduled)), None)

    @_on_every_rank
    @torch.inference_mode()
    def capture_cudagraphs(self, max_num_seqs: int, max_model_len: int) -> None:
        eager = sorted({g.backend.name for g in self.groups if not g.backend.cudagraph_decode})
        if eager:
            logger.info("CUDA graphs off: the %s backend's decode is not graph-safe; decode runs "
                        "eagerly", ", ".join(eager))
            return
        buckets = [b for b in (1, 2, 4, 8, *range(16, 513, 16)) if b < max_num_seqs] + [max_num_seqs]
        max_bs, max_blocks, dev = buckets[-1], -(-max_model_len // self.block_size), self.device
        self.static = {
            "input_ids": torch.zeros(max_bs, dtype=torch.int64, device=dev),
            "logits_index": torch.arange(max_bs, dtype=torch.int64, device=dev),
            "positions": torch.zeros(max_bs, dtype=torch.int64, device=dev),
            "query_start_loc": torch.arange(max_bs + 1, dtype=torch.int32, device=dev),
            "seq_lens": torch.zeros(max_bs, dtype=torch.int32, device=dev),
            "num_computed_tokens": torch.zeros(max_bs, dtype=torch.int32, device=dev),
            "block_tables": [torch.zeros(max_bs, max_blocks, dtype=torch.int32, device=dev)
                             for _ in self.groups],
            "slot_mappings": [torch.full((max_bs,), -1, dtype=torch.int64, device=dev)
                              for _ in self.groups],
        }
        pool = None
        for bs in reversed(buckets):  # largest first, so smaller graphs reuse its memory pool
            st = self.static
            ones = torch.ones(bs, dtype=torch.int32)
            metadata = [builder.build(CommonAttentionMetadata(
                query_start_loc=st["query_start_loc"][:bs + 1], seq_lens=st["seq_lens"][:bs],
                num_computed_tokens=st["num_computed_tokens"][:bs],
                block_table=st["block_tables"][g][:bs], slot_mapping=st["slot_mappings"][g][:bs],
                query_start_loc_cpu=torch.arange(bs + 1, dtype=torch.int32), seq_lens_cpu=ones,
                num_computed_tokens_cpu=ones, num_reqs=bs, num_actual_tokens=bs, max_query_len=1,
                max_seq_len=max_model_len, num_decodes=bs, num_decode_tokens=bs,
                block_size=self.block_size)) for g, builder in enumerate(self.builders)]
            ctx = ForwardContext(self.layers, self.kv_caches, metadata)

            def run():
                with set_forward_context(ctx):
                    return self._call_model(st["input_ids"][:bs], st["positions"][:bs],
                                            st["logits_index"][:bs])
            run()  # warm-up: lazy initialisation (and any compilation) happens outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = run()
            pool = graph.pool()
            self.graphs[bs] = (graph, logits)
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", buckets)
