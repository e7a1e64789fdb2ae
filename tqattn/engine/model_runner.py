"""Runs one scheduled step through the transformers model: inputs, metadata, forward, sampling.

All scheduled tokens of a step are flattened into one (1, T) batch with their positions
(decodes first, then prefill chunks). Per KV-cache group, a CommonAttentionMetadata describes the
batch (the block tables and slots differ between groups), and the group's backend builder turns
it into the backend's metadata. The attention calls find both in the forward context.

Compiled model (``compile_model``): the forward runs through ``torch.compile`` with the token
dimension unbacked (:mod:`tqattn.engine.compilation`), compiled by the first call (the engine
makes that call at start-up); prefill and mixed steps run it directly.

CUDA graphs (CUDA only, unless enforce_eager): pure-decode steps replay a graph captured per
batch-size bucket over the (compiled or eager) forward, the batch padded to the bucket (padding
rows: seq_len 0, slot −1). The graph reads static input buffers that each step overwrites; the
backends' metadata is built once per bucket at capture, over those buffers. That needs every
KV-cache group's backend to declare ``cudagraph_decode`` (its pure-decode metadata is only views
of the CommonAttentionMetadata device tensors and its decode kernels never sync with the host:
TURBOQUANT, FLASH_ATTN); a model with a layer on any other backend runs decode eagerly (logged).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable

import torch

from tqattn.attention.backend import AttentionLayer, CommonAttentionMetadata
from tqattn.attention.forward_context import ForwardContext, set_forward_context

from . import compilation
from .input_batch import InputBatch
from .sampled import SampledTokens
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


class ModelRunner:
    def __init__(self, model: torch.nn.Module, layers: list[AttentionLayer],
                 groups: list[KVCacheGroup], block_size: int, device: torch.device, seed: int = 0,
                 compile_model: bool = False):
        self.model = model
        self.compile_model = compile_model
        self._logits = compilation.compile_forward() if compile_model else compilation.model_logits
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
        return x.input_ids, x.positions, metadata, x.sample_idx

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
        self.last_graph_bucket = self._graph_bucket(scheduled)
        if self.last_graph_bucket is not None:
            logits = self._replay(scheduled, pending)
        else:
            input_ids, positions, metadata, sample_idx = self._prepare(scheduled)
            if pending is not None:
                input_ids = _to_device(input_ids, self.device)
                pending.feed(input_ids, scheduled)
            logits = self.forward(input_ids, positions, metadata, sample_idx)
        if not sampling:
            return SampledTokens([], None, started)
        generators = generators or {}
        tokens = self.sampler.sample(logits, [seq.sampling_params for seq in sampling],
                                     [generators.get(seq.seq_id) for seq in sampling])
        return SampledTokens([seq.seq_id for seq in sampling], tokens, started)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: list,
                sample_idx: list[int]) -> torch.Tensor:
        """Logits (len(sample_idx), vocab) at the given flattened token indices."""
        dev = self.device
        # A step that samples nothing still takes the logits of one token: the compiled graph
        # never sees an empty index (the LM head on one row costs next to nothing).
        keep = torch.tensor(sample_idx or [len(input_ids) - 1], dtype=torch.int64)
        with set_forward_context(ForwardContext(self.layers, self.kv_caches, metadata)):
            logits = self._call_model(_to_device(input_ids, dev), _to_device(positions, dev),
                                      _to_device(keep, dev))
        return logits[:len(sample_idx)]

    def _call_model(self, input_ids: torch.Tensor, positions: torch.Tensor,
                    logits_index: torch.Tensor) -> torch.Tensor:
        if self.compile_model:
            logits = compilation.call_compiled(self._logits, self.model, input_ids, positions,
                                               logits_index)
        else:
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

    def _replay(self, scheduled: list[ScheduledSeq], pending: SampledTokens | None = None) -> torch.Tensor:
        bucket, n = self._graph_bucket(scheduled), len(scheduled)
        self.input_batch.prepare_decode(scheduled, bucket, self.static)
        if pending is not None:
            pending.feed(self.static["input_ids"], scheduled)
        graph, logits = self.graphs[bucket]
        graph.replay()
        return logits[:n]
