"""Runs one scheduled step through the transformers model: inputs, metadata, forward, sampling.

All scheduled tokens of a step are flattened into one (1, T) batch with their positions
(decodes first, then prefill chunks). Per KV-cache group, a CommonAttentionMetadata describes the
batch (the block tables and slots differ between groups), and the group's backend builder turns
it into the backend's metadata. The attention calls find both in the forward context.

CUDA graphs (CUDA only, unless enforce_eager): pure-decode steps replay a graph captured per
batch-size bucket, the batch padded to the bucket (padding rows: seq_len 0, slot −1). The graph
reads static input buffers that each step overwrites; the backends' metadata is built once per
bucket at capture, over those buffers. That needs every KV-cache group's backend to declare
``cudagraph_decode`` (its pure-decode metadata is only views of the CommonAttentionMetadata
device tensors and its decode kernels never sync with the host: TURBOQUANT, FLASH_ATTN); a model
with a layer on any other backend runs decode eagerly (logged).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable

import torch

from tqattn.attention.backend import AttentionLayer, CommonAttentionMetadata
from tqattn.attention.forward_context import ForwardContext, set_forward_context

from .input_batch import InputBatch
from .kv_cache import KVCacheGroup, allocate_kv_caches
from .sampling import Sampler, SamplingParams
from .scheduler import ScheduledSeq
from .sequence import Sequence

logger = logging.getLogger(__name__)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.device == device:
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, layers: list[AttentionLayer],
                 groups: list[KVCacheGroup], block_size: int, device: torch.device, seed: int = 0):
        self.model = model
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
        # When set (the engine's step timeline), each step waits for the device before sampling
        # and records how long: the rest of the step's wall time is host time.
        self.measure_device_wait = False
        self.last_device_wait_s = 0.0

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
        if not scheduled:
            return {}
        self.last_graph_bucket = self._graph_bucket(scheduled)
        if self.last_graph_bucket is not None:
            logits = self._replay(scheduled)
        else:
            input_ids, positions, metadata, sample_idx = self._prepare(scheduled)
            logits = self.forward(input_ids, positions, metadata, sample_idx)
        if self.measure_device_wait and self.device.type == "cuda":
            t = time.perf_counter()
            torch.cuda.current_stream(self.device).synchronize()
            self.last_device_wait_s = time.perf_counter() - t
        sampling = [s.seq for s in scheduled if s.samples]
        if not sampling:
            return {}
        generators = generators or {}
        tokens = self.sampler(logits, [seq.sampling_params for seq in sampling],
                              [generators.get(seq.seq_id) for seq in sampling])
        return {seq.seq_id: t for seq, t in zip(sampling, tokens)}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: list,
                sample_idx: list[int]) -> torch.Tensor:
        """Logits (len(sample_idx), vocab) at the given flattened token indices."""
        dev = self.device
        keep = torch.tensor(sample_idx, dtype=torch.int64, device=dev)
        with set_forward_context(ForwardContext(self.layers, self.kv_caches, metadata)):
            out = self.model(input_ids=_to_device(input_ids, dev)[None],
                             position_ids=_to_device(positions, dev)[None],
                             use_cache=False, logits_to_keep=keep)
        return out.logits[0]

    # ---- memory profiling (CUDA) -----------------------------------------------------------------

    @torch.inference_mode()
    def profile_free_memory(self, gpu_memory_utilization: float, num_tokens: int,
                            max_model_len: int) -> int:
        """Bytes the KV cache may take: utilization x total memory, minus what is in use now and
        the activation peak of a prefill step of num_tokens tokens (vLLM's profile run)."""
        self.allocate_kv_cache(1)  # the attention calls need a cache; every slot maps to block 0
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        lens = [min(max_model_len, num_tokens - i) for i in range(0, num_tokens, max_model_len)]
        scheduled = []
        for n in lens:
            seq = Sequence([0] * n, SamplingParams(temperature=0))
            seq.block_tables = [[0] * -(-n // self.block_size) for _ in self.groups]
            scheduled.append(ScheduledSeq(seq, n, False, 0))
        self.execute_model(scheduled)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        self.kv_caches = {}
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
                    return self.model(input_ids=st["input_ids"][:bs][None],
                                      position_ids=st["positions"][:bs][None], use_cache=False,
                                      logits_to_keep=0).logits[0]
            run()  # warm-up: lazy initialisation happens outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = run()
            pool = graph.pool()
            self.graphs[bs] = (graph, logits)
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", buckets)

    def _replay(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        bucket, n = self._graph_bucket(scheduled), len(scheduled)
        self.input_batch.prepare_decode(scheduled, bucket, self.static)
        graph, logits = self.graphs[bucket]
        graph.replay()
        return logits[:n]
