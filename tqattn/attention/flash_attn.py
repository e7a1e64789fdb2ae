"""FLASH_ATTN: full-precision paged KV cache on FlashAttention (or torch SDPA).

Cache: one (2, num_blocks, block_size, Hk, D) tensor per layer (vLLM's layout), K at [0] and V
at [1], in the model dtype (``kv_cache_dtype="auto"``) or an explicit bfloat16/float16/float32.

Forward, per step:

* a pure-decode batch (every request has query length 1, ``num_decodes == num_reqs``): the
  paged FA3 call below when the layer has it, else :func:`paged_decode_attention` (torch ops over
  every column of the block table, chunked, fp32 online softmax). Its metadata is only views of
  the common metadata's device tensors, no CPU planning, and nothing reads a device value on the
  host, so decode is CUDA-graph safe (``cudagraph_decode``): the model runner builds the metadata
  once per batch-size bucket over static buffers and replays the captured step;
* every request starts its chunk fresh (no cached tokens): one causal
  :func:`~tqattn.attention.fa_utils.flash_attn_varlen` over the raw K/V, with the layer's
  ``fa_version``;
* otherwise (decodes mixed with continuation chunks, prefix-cache hits), when the layer runs
  FA3 and ``flash_attn_interface.flash_attn_with_kvcache`` is there: one paged call over the cache
  (``page_table`` = block table; the cache already holds this step's tokens);
* otherwise the builder plans a gather of each request's cached prefix (only the part its
  sliding window can see) and the varlen wrapper runs on [prefix from the cache ‖ raw chunk].

The metadata builder gathers the sliding-window/soft-cap configs of the FlashAttention layers
only (vLLM asserted every attention layer was FlashAttention and crashed on models mixing
backends); one config turns on FA3 ahead-of-time scheduling, several turn it off (vLLM's rule).
AOT scheduling depends on the step's sequence lengths, so the pure-decode metadata (which a CUDA
graph reuses across steps) goes without it.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import torch

from ..kernels import step as kernels_step
from . import fa_utils
from .backend import (AUTO, AttentionBackend, AttentionImpl, AttentionLayerSpec,
                      AttentionMetadataBuilder, CommonAttentionMetadata, token_rows)
from .plan import KVGather, pack_kv, plan_kv_gather, window_start
from .registry import register_backend

logger = logging.getLogger(__name__)

# Key/value elements (batch x keys x KV heads x head size) one chunk of paged_decode_attention
# gathers and upcasts to fp32: 2^24 elements = 64 MiB for K and as much for V.
DECODE_CHUNK_ELEMENTS = 1 << 24

KV_CACHE_DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float16": torch.float16,
                   "float32": torch.float32}
MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.lru_cache(maxsize=None)
def _fa3_kvcache_fns():
    """(flash_attn_with_kvcache, get_scheduler_metadata or None) of FA3, or None."""
    fn = fa_utils._import_attr("flash_attn_interface", "flash_attn_with_kvcache")
    if fn is None:
        return None
    return fn, fa_utils._import_attr("flash_attn_interface", "get_scheduler_metadata")


def scatter_rows(rows: torch.Tensor, slots: torch.Tensor, src: torch.Tensor, dim: int = 0) -> None:
    """``rows[slots[i]] = src[i]`` along ``dim`` for slots >= 0, skipping negative (padding) slots.

    No host sync and no boolean indexing: a skipped token is redirected to the first valid
    token's slot *with that token's data*, so the duplicate writes all carry the same bytes and
    their order does not matter. With no valid token at all, slot 0 is rewritten with itself.
    """
    # index_select with a 1-element index tensor, never ``t[first]``: indexing with a 0-d
    # tensor reads it on the host, which a CUDA-graph capture forbids.
    valid = slots >= 0
    first = valid.to(torch.int32).argmax().view(1)
    along = [1] * src.dim()
    along[dim] = -1
    any_valid = valid.index_select(0, first)
    fill_slot = torch.where(any_valid, slots.index_select(0, first), 0)
    fill_data = torch.where(any_valid.view([1] * src.dim()), src.index_select(dim, first),
                            rows.narrow(dim, 0, 1))
    idx = torch.where(valid, slots, fill_slot)
    rows.index_copy_(dim, idx, torch.where(valid.view(along), src, fill_data))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                           window: int | None = None, softcap: float = 0.0,
                           chunk_blocks: int | None = None) -> torch.Tensor:
    """Decode attention over a paged cache with torch ops only: q (B, Hq, D) is request b's
    query at position ``seq_lens[b] - 1``; k/v_cache (num_blocks, block_size, Hk, D).

    Reads every column of ``block_table`` (B, max_blocks), ``chunk_blocks`` blocks at a time
    with an online fp32 softmax, and masks keys by position against ``seq_lens`` (and the
    window: keys > p − W; soft-cap before the mask). Shapes depend only on the input shapes and
    nothing is read back to the host, so a CUDA graph can capture it. A row with seq_len 0 (a
    padding row of a graph bucket) attends to nothing and gives 0.
    """
    b, hq, d = q.shape
    num_blocks, block_size, hk, _ = k_cache.shape
    width = block_table.shape[1]
    if chunk_blocks is None:
        chunk_blocks = DECODE_CHUNK_ELEMENTS // max(1, b * block_size * hk * d)
    chunk_blocks = max(1, min(chunk_blocks, width))
    qf = q.float().reshape(b, hk, hq // hk, d) * scale
    # Columns past a request's last block may hold anything; keep the gather in bounds.
    table = block_table.long().clamp(0, num_blocks - 1)
    seq = seq_lens.long()[:, None]
    m = q.new_full((b, hk, hq // hk), float("-inf"), dtype=torch.float32)
    l = torch.zeros_like(m)
    acc = q.new_zeros((b, hk, hq // hk, d), dtype=torch.float32)
    for c0 in range(0, width, chunk_blocks):
        blocks = table[:, c0:c0 + chunk_blocks]
        k = k_cache[blocks].flatten(1, 2).float()         # (B, keys, Hk, D)
        v = v_cache[blocks].flatten(1, 2).float()
        s = torch.einsum("bhgd,bkhd->bhgk", qf, k)
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        pos = torch.arange(c0 * block_size, c0 * block_size + k.shape[1], device=q.device)
        visible = pos[None] < seq
        if window is not None:
            visible &= pos[None] >= seq - window
        s = s.masked_fill(~visible[:, None, None], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        # Nothing visible yet: a finite stand-in max so exp() gives 0, not NaN.
        m_safe = m_new.clamp_min(torch.finfo(torch.float32).min)
        p = torch.exp(s - m_safe[..., None])
        alpha = torch.exp(m - m_safe)
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.einsum("bhgk,bkhd->bhgd", p, v)
        m = m_new
    out = acc / l.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    return out.view(b, hq, d).to(q.dtype)


@dataclass
class FlashAttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    has_prefix: bool                                  # some request has cached tokens
    decode_only: bool = False                         # every request has query length 1
    kv_gathers: dict[int | None, KVGather] = field(default_factory=dict)  # by sliding window
    scheduler_metadata: torch.Tensor | None = None    # FA3 AOT scheduling (paged path)


class FlashAttentionImpl(AttentionImpl):
    def __init__(self, spec: AttentionLayerSpec, *, fa_version: int | None | str = AUTO):
        reason = FlashAttentionBackend.unsupported_reason(spec)
        if reason is not None:
            raise ValueError(f"{spec.name}: {reason}")
        super().__init__(spec, fa_version=fa_version)
        self.window = spec.sliding_window
        self.softcap = spec.logits_soft_cap
        self.cache_dtype = FlashAttentionBackend.kv_cache_torch_dtype(spec)
        # FA3's paged entry point reads the cache as it is, so it must hold the model dtype.
        self.paged_fns = (_fa3_kvcache_fns()
                          if self.fa_version == 3 and self.cache_dtype == spec.dtype else None)

    @property
    def uses_paged_kv(self) -> bool:
        return self.paged_fns is not None

    def aot_config(self) -> tuple:
        """What FA3's ahead-of-time scheduler depends on for this layer."""
        s = self.spec
        return (s.num_heads, s.num_kv_heads, s.head_size, s.dtype,
                fa_utils.fa_window_size(self.window, True), bool(self.softcap))

    def store(self, key, value, kv_cache, metadata) -> None:
        n = metadata.num_actual_tokens
        mod = kernels_step.triton_module("kv_write") if kernels_step.use_triton(key) else None
        if mod is not None:  # one launch a layer (the torch scatter below takes ~10 kernels)
            return mod.write_kv_triton(key, value, kv_cache, metadata.slot_mapping[:n])
        # K and V in one scatter (one set of slot kernels): (2, slots, Hk, D) rows along dim 1
        scatter_rows(kv_cache.flatten(1, 2), metadata.slot_mapping[:n],
                     torch.stack((key[:n], value[:n])).to(self.cache_dtype), dim=1)

    def forward(self, query, key, value, kv_cache, metadata: FlashAttentionMetadata):
        md, s = metadata, self.spec
        n = md.num_actual_tokens
        out = query.new_empty(query.shape)
        out[n:].zero_()
        if not md.decode_only:  # prefill paths index token rows; decodes take strides
            query, key, value = token_rows(query), token_rows(key), token_rows(value)
        q = query[:n]
        if md.decode_only:
            if self.uses_paged_kv:
                out[:n] = self._paged_fa3(q, kv_cache, md)
            else:
                out[:n] = paged_decode_attention(q, kv_cache[0], kv_cache[1], md.block_table,
                                                 md.seq_lens, s.scale, window=self.window,
                                                 softcap=self.softcap)
            return out
        common = dict(softmax_scale=s.scale, causal=True, window=self.window,
                      fa_version=self.fa_version, softcap=self.softcap)
        if not md.has_prefix:
            qsl = md.query_start_loc
            out[:n] = fa_utils.flash_attn_varlen(q, key[:n], value[:n], qsl, qsl, md.max_query_len,
                                                 md.max_query_len, **common)
        elif self.uses_paged_kv:
            out[:n] = self._paged_fa3(q, kv_cache, md)
        else:
            gather = md.kv_gathers.get(self.window, md.kv_gathers.get(None))
            if gather is None:
                raise RuntimeError(f"{s.name}: the metadata holds no K/V gather plan for sliding "
                                   f"window {self.window}; was it built with this layer?")
            k_full, v_full = (pack_kv(gather, cache.flatten(0, 1).index_select(0, gather.prefix_slots),
                                      x[:n])
                              for cache, x in ((kv_cache[0], key), (kv_cache[1], value)))
            out[:n] = fa_utils.flash_attn_varlen(q, k_full, v_full, md.query_start_loc,
                                                 gather.cu_seqlens_k, md.max_query_len,
                                                 gather.max_seqlen_k, **common)
        return out

    def _paged_fa3(self, q, kv_cache, md: FlashAttentionMetadata):
        fn = self.paged_fns[0]
        return fn(q, kv_cache[0], kv_cache[1], cache_seqlens=md.seq_lens,
                  page_table=md.block_table, cu_seqlens_q=md.query_start_loc,
                  max_seqlen_q=md.max_query_len, softmax_scale=self.spec.scale, causal=True,
                  window_size=fa_utils.fa_window_size(self.window, True), softcap=self.softcap,
                  scheduler_metadata=md.scheduler_metadata)


class FlashAttentionMetadataBuilder(AttentionMetadataBuilder):
    def __init__(self, layers, device):
        super().__init__(layers, device)
        # Only our own layers: another backend's impl has no sliding-window config for us.
        self.fa_layers = {name: impl for name, impl in layers.items()
                          if isinstance(impl, FlashAttentionImpl)}
        # One gather plan per distinct window of the layers without the paged FA3 path (a
        # builder that knows no layer plans the unwindowed gather, which serves any window).
        self.gather_windows = ({impl.window for impl in self.fa_layers.values()
                                if not impl.uses_paged_kv} if self.fa_layers else {None})
        paged = [impl for impl in self.fa_layers.values() if impl.uses_paged_kv]
        self.aot_configs = {impl.aot_config() for impl in paged}
        self.aot_schedule = (len(self.aot_configs) == 1
                             and paged[0].paged_fns[1] is not None)

    def sliding_window_configs(self) -> set[tuple[int, int]]:
        """FA window_size of every FlashAttention layer (and only those)."""
        return {fa_utils.fa_window_size(impl.window, True) for impl in self.fa_layers.values()}

    def build(self, common: CommonAttentionMetadata) -> FlashAttentionMetadata:
        md = FlashAttentionMetadata(
            num_actual_tokens=common.num_actual_tokens, max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len, query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens, block_table=common.block_table,
            slot_mapping=common.slot_mapping, has_prefix=False)
        if common.num_reqs and common.num_decodes == common.num_reqs:
            # Pure decode: views only, no planning on the step's values (CUDA-graph safe).
            md.decode_only = True
            return md
        num_computed = common.num_computed_tokens_cpu.long()
        md.has_prefix = bool((num_computed > 0).any())
        if not md.has_prefix:
            return md
        q_lens = (common.query_start_loc_cpu[1:] - common.query_start_loc_cpu[:-1]).long()
        for window in self.gather_windows:
            md.kv_gathers[window] = plan_kv_gather(
                q_lens, window_start(num_computed, window), num_computed,
                common.block_table.device, common.block_table, common.block_size)
        if self.aot_schedule:
            md.scheduler_metadata = self._scheduler_metadata(common)
        return md

    def _scheduler_metadata(self, common: CommonAttentionMetadata):
        hq, hk, d, dtype, window_size, has_softcap = next(iter(self.aot_configs))
        get_metadata = next(iter(self.fa_layers.values())).paged_fns[1]
        try:
            return get_metadata(
                common.num_reqs, common.max_query_len, common.max_seq_len, hq, hk, d,
                cache_seqlens=common.seq_lens, qkv_dtype=dtype,
                cu_seqlens_q=common.query_start_loc, page_size=common.block_size, causal=True,
                window_size=window_size, has_softcap=has_softcap)
        except (TypeError, RuntimeError) as e:  # an FA3 build with another signature
            logger.warning("FA3 ahead-of-time scheduling disabled: %s", e)
            self.aot_schedule = False
            return None


@register_backend
class FlashAttentionBackend(AttentionBackend):
    name = "FLASH_ATTN"
    supports_sliding_window = True
    supports_softcap = True
    cudagraph_decode = True  # pure decode: paged FA3 or paged_decode_attention over views
    impl_cls = FlashAttentionImpl
    builder_cls = FlashAttentionMetadataBuilder

    @classmethod
    def accepts_kv_cache_dtype(cls, kv_cache_dtype: str) -> bool:
        return kv_cache_dtype in KV_CACHE_DTYPES

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size > 0  # FA needs a multiple of 8; other sizes run torch SDPA

    @classmethod
    def kv_cache_shape(cls, num_blocks: int, block_size: int, spec: AttentionLayerSpec):
        return (2, num_blocks, block_size, spec.num_kv_heads, spec.head_size)

    @classmethod
    def kv_cache_torch_dtype(cls, spec: AttentionLayerSpec) -> torch.dtype:
        return KV_CACHE_DTYPES.get(spec.kv_cache_dtype) or spec.dtype

    @classmethod
    def unsupported_reason(cls, spec: AttentionLayerSpec) -> str | None:
        if spec.dtype not in MODEL_DTYPES:
            return f"model dtype {spec.dtype} not supported by {cls.name} (fp16, bf16, fp32)"
        return super().unsupported_reason(spec)
