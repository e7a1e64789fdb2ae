"""TURBOQUANT: attention over a TurboQuant-compressed paged KV cache.

What a query sees — one rule for every path:

* K/V of tokens stored by EARLIER steps are read compressed (as the codec decodes their slots);
* K/V of the tokens in the current step's own chunk are read raw (full precision);
* a one-token chunk (a decode, or a one-token prompt chunk) is the exception: its K/V are
  stored first and the decode kernel reads the whole cache, so the token attends to its own
  K/V compressed too. (vLLM's order: store, then attend; it keeps decode a single kernel over
  the cache, which is what CUDA graphs capture.)

Paths. The builder classifies every request on the CPU copies of the batch — per request, never
per batch (vLLM's batch-level "no cached prefix" test drops the prefix of continuations batched
with a fresh prompt, bug #46460) — and plans index tensors, so ``forward`` runs a fixed sequence
of kernels with no per-request loop and no host sync:

* decode (query length 1): the decode kernel over the cache. One-token requests come first;
  a batch that has one after a longer chunk is permuted once (and back) by ``token_perm``.
* prefill chunks, all in ONE causal :func:`~tqattn.attention.fa_utils.flash_attn_varlen` call
  with the layer's ``fa_version``:

  - first chunk (``num_computed_tokens == 0``): the raw chunk only;
  - short continuation (``num_computed_tokens > 0``, chunk ≤ :data:`CONTINUATION_DEQUANT_THRESHOLD`
    tokens — including a prefix-cache hit on the first scheduled chunk): FlashAttention over the
    raw chunk (returning its LSE), plus the decode kernel with one query row per chunk token
    over the compressed prefix (``seq_lens = query_pos_start = num_computed_tokens``, LSE),
    merged by LSE (:func:`~tqattn.attention.merge.merge_attn_states`);
  - long continuation (chunk > threshold): the prefix is dequantized by the dequant kernel and
    packed in front of the raw chunk, so FlashAttention sees [prefix ‖ chunk] (bottom-right
    causal). The decode kernel re-reads the prefix for every query row block, so its cost grows
    with the chunk; dequantizing once and letting FlashAttention do the rest wins for longer
    chunks. Threshold 32: on the H200 decode rows win up to 32 tokens, dequant + FA from 64 on
    (bench/continuation_threshold.py; its result: bench/results/README.md). (vLLM uses 128,
    with the chunk itself read back compressed.)

Sliding window W: a query at position p sees keys at positions > p − W. The window goes to the
decode kernel (its rows know their positions) and to FlashAttention (bottom-right aligned), and
the dequant path only dequantizes the prefix keys some query of the chunk can see. Logit
soft-cap goes to both kernels; LSE merging stays exact under it. ALiBi and attention sinks are
refused (``unsupported_reason``).

Key centering (:mod:`~tqattn.attention.key_centering`, set by :meth:`TurboQuantImpl.
set_key_offset`): the cache holds k − μ (the store subtracts μ inside its kernel; a decode step
centers its new keys before the decode kernel stores them), and FlashAttention reads the raw
chunk centered wherever it shares a softmax with the compressed prefix, so all scores of a query
shift by the same q·μ and outputs and LSE merges stay exact.

Padded cache (``spec.kv_cache_head_size``, the engine's ``kv_cache_pad_head_size``, on by
default where :func:`tensor_core_padding` finds the kernel would run): a head size the
tensor-core decode kernel lacks (80, 96) is stored zero-padded to the next one it runs (128).
The store and the decode get padded K/V and queries, the outputs and the dequantized prefix are
cut back to the head size; zero query coordinates leave every score as it was.

Rotation seed: one :class:`~tqattn.quant.codec.TQCodec` per (preset, head size, device), shared
by every layer, seed :data:`ROTATION_SEED`. A randomized Hadamard is already independent of the
data it rotates, so per-layer seeds buy nothing measurable, while one shared codec means one
D×D rotation in memory, one set of codebooks, and a reference that rebuilds the exact codec
from (preset, head size) alone. (vLLM's presets use no random signs at all.)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import fa_utils
from .backend import (AUTO, AttentionBackend, AttentionImpl, AttentionLayerSpec,
                      AttentionMetadataBuilder, CommonAttentionMetadata, token_rows)
from .key_centering import KeyOffset
from .merge import merge_attn_states
from .plan import KVGather, cumsum0, pack_kv, plan_kv_gather, segment_arange, to_device, window_start
from .registry import register_backend
from ..kernels import step
from ..kernels._spec import MMA_HEAD_SIZES, kernel_spec
from ..quant.codec import TQCodec
from ..quant.presets import PRESETS

CONTINUATION_DEQUANT_THRESHOLD = 32   # chunk tokens; see the module docstring
ROTATION_SEED = 0
MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def padded_head_size(head_size: int) -> int | None:
    """The cache head size a padded layout stores ``head_size`` at (the smallest tensor-core
    head size above it), None where none is needed or none fits."""
    if head_size in MMA_HEAD_SIZES or head_size > MMA_HEAD_SIZES[-1]:
        return None
    return min(d for d in MMA_HEAD_SIZES if d > head_size)


def tensor_core_padding(preset: str, head_size: int, num_q_heads: int, num_kv_heads: int,
                        block_size: int, device, logits_soft_cap: float = 0.0) -> int | None:
    """The padded cache head size at which the tensor-core decode kernel would run this layer
    on ``device`` where it cannot at ``head_size``; None where padding would not reach it."""
    padded = padded_head_size(head_size)
    if padded is None or logits_soft_cap or not step.tensor_cores(device):
        return None
    try:
        spec = kernel_spec(get_codec(preset, padded), block_size)
    except NotImplementedError:  # a layout without Triton kernels
        return None
    return padded if step.tensor_core_layout(spec, num_q_heads // num_kv_heads, device) else None


@functools.lru_cache(maxsize=None)
def get_codec(preset: str, head_size: int, device: str = "cpu", seed: int = ROTATION_SEED) -> TQCodec:
    """The codec every TurboQuant layer of this (preset, head size) uses on ``device``."""
    return TQCodec(preset, head_size, device=device, seed=seed)


def _kernels():
    from .. import kernels
    return kernels


# ----------------------------------------------------------------------------------------------
# Metadata
# ----------------------------------------------------------------------------------------------


@dataclass
class ContinuationRows:
    """Short continuation chunks: their query rows, for the decode kernel over the prefix."""
    token_idx: torch.Tensor          # (Ns,) int64 rows among the prefill tokens
    query_start_loc: torch.Tensor    # (S + 1,) int32 offsets into token_idx
    seq_lens: torch.Tensor           # (S,) int32 = num_computed_tokens (the compressed prefix)
    block_table: torch.Tensor        # (S, max_blocks)
    max_query_len: int


@dataclass
class LongContinuations:
    """Long continuation chunks: their prefixes, dequantized and packed before the raw chunks."""
    gather: KVGather                 # packed [prefix ‖ chunk] layout of every prefill request
    block_table: torch.Tensor        # (L, max_blocks) rows of the long requests, from their
    seq_lens: torch.Tensor           # (L,) int32   first visible block on: what to dequantize
    cu_seqlens: torch.Tensor         # (L + 1,) int32 rows of each request in the dequant output
    max_seq_len: int
    num_tokens: int                  # sum of seq_lens (rows the dequant writes)


@dataclass
class TurboQuantMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    token_perm: torch.Tensor | None           # decodes-first order of the tokens, if not already
    num_decodes: int                          # the first num_decodes requests/tokens (ordered)
    decode_seq_lens: torch.Tensor
    decode_block_table: torch.Tensor
    num_prefills: int
    prefill_query_start_loc: torch.Tensor     # (P + 1,) int32, relative to the first prefill token
    prefill_max_query_len: int
    short: ContinuationRows | None = None
    long: dict[int | None, LongContinuations] = field(default_factory=dict)  # by sliding window


class TurboQuantMetadataBuilder(AttentionMetadataBuilder):
    def __init__(self, layers, device):
        super().__init__(layers, device)
        tq_layers = [impl for impl in layers.values() if isinstance(impl, TurboQuantImpl)]
        # Only our own layers' windows; a builder that knows none plans the unwindowed gather.
        self.gather_windows = {impl.window for impl in tq_layers} if tq_layers else {None}
        self.dequant_threshold = CONTINUATION_DEQUANT_THRESHOLD

    def build(self, common: CommonAttentionMetadata) -> TurboQuantMetadata:
        qsl = common.query_start_loc_cpu.long()
        q_lens = qsl[1:] - qsl[:-1]
        num_computed = common.num_computed_tokens_cpu.long()
        seq_lens, block_table = common.seq_lens, common.block_table

        is_decode = q_lens == 1
        nd = int(is_decode.sum())
        token_perm = None
        if not bool(is_decode[:nd].all()):
            order = torch.argsort((~is_decode).to(torch.int8), stable=True)
            req, off = segment_arange(q_lens[order])
            token_perm = to_device(qsl[order][req] + off, self.device)
            q_lens, num_computed = q_lens[order], num_computed[order]
            order_d = to_device(order, block_table.device)
            seq_lens, block_table = seq_lens[order_d], block_table[order_d]

        p_lens, p_computed = q_lens[nd:], num_computed[nd:]
        md = TurboQuantMetadata(
            num_actual_tokens=common.num_actual_tokens, slot_mapping=common.slot_mapping,
            token_perm=token_perm, num_decodes=nd, decode_seq_lens=seq_lens[:nd],
            decode_block_table=block_table[:nd],
            num_prefills=len(p_lens),
            prefill_query_start_loc=to_device(cumsum0(p_lens), self.device),
            prefill_max_query_len=int(p_lens.max()) if len(p_lens) else 0)
        if not len(p_lens):
            return md

        cont = p_computed > 0
        long = cont & (p_lens > self.dequant_threshold)
        short = cont & ~long
        if bool(short.any()):
            idx = short.nonzero().flatten()
            req, off = segment_arange(p_lens[idx])
            rows = cumsum0(p_lens)[:-1].long()[idx][req] + off
            idx_d = to_device(idx + nd, block_table.device)
            md.short = ContinuationRows(
                token_idx=to_device(rows, self.device),
                query_start_loc=to_device(cumsum0(p_lens[idx]), self.device),
                seq_lens=to_device(p_computed[idx].to(torch.int32), self.device),
                block_table=block_table[idx_d], max_query_len=int(p_lens[idx].max()))
        if bool(long.any()):
            lidx = long.nonzero().flatten()
            bs = common.block_size
            rows = block_table[to_device(lidx + nd, block_table.device)]
            for window in self.gather_windows:
                # Dequantize whole blocks from the first one any chunk query can see: FA's
                # bottom-right alignment keeps positions right after dropping leading keys.
                first_block = window_start(p_computed, window) // bs
                start = torch.where(long, first_block * bs, p_computed)
                cols = first_block[lidx, None] + torch.arange(rows.shape[1])
                lens = (p_computed - start)[lidx]
                md.long[window] = LongContinuations(
                    gather=plan_kv_gather(p_lens, start, p_computed, self.device),
                    block_table=rows.gather(1, to_device(cols.clamp_max(rows.shape[1] - 1),
                                                         rows.device)),
                    seq_lens=to_device(lens.to(torch.int32), self.device),
                    cu_seqlens=to_device(cumsum0(lens), self.device),
                    max_seq_len=int(lens.max()), num_tokens=int(lens.sum()))
        return md


# ----------------------------------------------------------------------------------------------
# Impl
# ----------------------------------------------------------------------------------------------


class TurboQuantImpl(AttentionImpl):
    def __init__(self, spec: AttentionLayerSpec, *, fa_version: int | None | str = AUTO):
        reason = TurboQuantBackend.unsupported_reason(spec)
        if reason is not None:
            raise ValueError(f"{spec.name}: {reason}")
        super().__init__(spec, fa_version=fa_version)
        self.preset = spec.kv_cache_dtype
        self.window = spec.sliding_window
        self.softcap = spec.logits_soft_cap
        self.key_offset: KeyOffset | None = None
        # zero coordinates the cache's vectors carry past the head size (spec.kv_cache_head_size)
        self.pad = spec.cache_head_size - spec.head_size

    def set_key_offset(self, offset: torch.Tensor | None,
                       device: torch.device | str | None = None) -> None:
        """Center this layer's keys by ``offset`` (Hk, D) from now on (None: stop). Only before
        the cache holds anything: stored keys keep the offset they were stored with."""
        self.key_offset = None if offset is None else KeyOffset(offset, self.spec, device)

    def _center(self, key: torch.Tensor) -> torch.Tensor:
        return key if self.key_offset is None else self.key_offset.center(key)

    def codec(self, device: torch.device | str = "cpu") -> TQCodec:
        return get_codec(self.preset, self.spec.cache_head_size, str(torch.device(device)))

    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., head_size) as the cache's vectors: zeros appended up to its head size (q·k
        and the kept output coordinates are unchanged by them)."""
        return F.pad(x, (0, self.pad)) if self.pad else x

    def store(self, key, value, kv_cache, metadata) -> None:
        self._store(key, value, kv_cache, metadata)

    def forward(self, query, key, value, kv_cache, metadata: TurboQuantMetadata):
        return self._forward(query, self._center(key), value, kv_cache, metadata)

    def _store(self, key, value, kv_cache, metadata) -> None:
        """Store the step's K/V; with a key offset, the store centers the keys itself."""
        n = metadata.num_actual_tokens
        codec = self.codec(kv_cache.device)
        offset = self.key_offset
        _kernels().store_kv(codec, self._padded(key[:n]), self._padded(value[:n]), kv_cache,
                            metadata.slot_mapping[:n],
                            key_offset=None if offset is None else offset.for_store(codec.rotation))

    def store_and_forward(self, query, key, value, kv_cache, metadata: TurboQuantMetadata):
        md = metadata
        n = md.num_actual_tokens
        if md.num_prefills or md.token_perm is not None or md.num_decodes != n:
            self._store(key, value, kv_cache, md)
            if md.num_prefills and (md.long or md.short is not None):
                key = self._center(key)  # the chunk shares a softmax with the centered prefix
            return self._forward(query, key, value, kv_cache, md)
        # a decode-only step: the decode call writes the new K/V (where: kernels/step.py),
        # centered here
        key = self._center(key)
        out = query.new_empty(query.shape)
        out[n:].zero_()
        o = self._decode(self.codec(query.device), query[:n], kv_cache, md.decode_block_table,
                         md.decode_seq_lens, out=out[:n],
                         new_kv=(key[:n], value[:n], md.slot_mapping[:n]))
        if o.data_ptr() != out.data_ptr():  # the reference path returns a new fp32 tensor
            out[:n].copy_(o)
        return out

    def _forward(self, query, key, value, kv_cache, metadata: TurboQuantMetadata):
        md = metadata
        n, nd = md.num_actual_tokens, md.num_decodes
        codec = self.codec(query.device)
        out = query.new_empty(query.shape)
        out[n:].zero_()
        if md.num_prefills:  # prefill paths index token rows (FlashAttention, gathers)
            query, key, value = token_rows(query), token_rows(key), token_rows(value)
        q, k, v = query[:n], key[:n], value[:n]
        if md.token_perm is not None:
            q, k, v = q[md.token_perm], k[md.token_perm], v[md.token_perm]
            res = q.new_empty(q.shape)
        else:
            res = out[:n]
        if nd:
            dst = res[:nd]
            o = self._decode(codec, q[:nd], kv_cache, md.decode_block_table, md.decode_seq_lens,
                             out=dst)
            if o is not dst:  # the reference path returns a new fp32 tensor
                dst.copy_(o)
        if md.num_prefills:
            res[nd:] = self._prefill(codec, q[nd:], k[nd:], v[nd:], kv_cache, md)
        if md.token_perm is not None:
            out[:n].index_copy_(0, md.token_perm, res)
        return out

    def _decode(self, codec, q, kv_cache, block_table, seq_lens, **rows):
        if self.pad:  # padded cache: padded query and new K/V, the output's head_size kept
            rows.pop("out", None)
            if rows.get("new_kv") is not None:
                k, v, slots = rows["new_kv"]
                rows["new_kv"] = (self._padded(k), self._padded(v), slots)
            q = self._padded(q)
        res = _kernels().decode_attention(
            codec, q, kv_cache, block_table, seq_lens, scale=self.spec.scale, window=self.window,
            softcap=self.softcap, **rows)
        if not self.pad:
            return res
        if rows.get("return_lse"):
            return res[0][..., :self.spec.head_size], res[1]
        return res[..., :self.spec.head_size]

    def _prefill(self, codec, q, k, v, kv_cache, md: TurboQuantMetadata):
        cu_q, max_q = md.prefill_query_start_loc, md.prefill_max_query_len
        if md.long:
            long = md.long.get(self.window, md.long.get(None))
            prefix = q.new_empty((2, long.num_tokens, k.shape[1], self.spec.cache_head_size))
            k_prefix, v_prefix = _kernels().dequant_kv(
                codec, kv_cache, long.block_table, long.seq_lens, cu_seqlens=long.cu_seqlens,
                max_seq_len=long.max_seq_len, dtype=q.dtype, out=prefix)
            k_prefix, v_prefix = k_prefix[..., :k.shape[-1]], v_prefix[..., :k.shape[-1]]
            k, v = pack_kv(long.gather, k_prefix, k), pack_kv(long.gather, v_prefix, v)
            cu_k, max_k = long.gather.cu_seqlens_k, long.gather.max_seqlen_k
        else:
            cu_k, max_k = cu_q, max_q
        short = md.short
        res = fa_utils.flash_attn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, self.spec.scale, True,
                                         window=self.window, fa_version=self.fa_version,
                                         softcap=self.softcap, return_lse=short is not None)
        if short is None:
            return res
        out, lse = res
        rows = short.token_idx
        o_prefix, lse_prefix = self._decode(
            codec, q.index_select(0, rows), kv_cache, short.block_table, short.seq_lens,
            query_start_loc=short.query_start_loc, query_pos_start=short.seq_lens,
            return_lse=True, max_query_len=short.max_query_len)
        merged, _ = merge_attn_states(out.index_select(0, rows), lse.t().index_select(0, rows),
                                      o_prefix, lse_prefix)
        return out.index_copy_(0, rows, merged)


@register_backend
class TurboQuantBackend(AttentionBackend):
    name = "TURBOQUANT"
    supports_sliding_window = True
    supports_softcap = True
    cudagraph_decode = True  # decode metadata: views of seq_lens / block_table; one Triton kernel
    impl_cls = TurboQuantImpl
    builder_cls = TurboQuantMetadataBuilder

    @classmethod
    def accepts_kv_cache_dtype(cls, kv_cache_dtype: str) -> bool:
        return kv_cache_dtype in PRESETS

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size > 0  # what a preset can encode is checked in unsupported_reason

    @classmethod
    def kv_cache_shape(cls, num_blocks: int, block_size: int, spec: AttentionLayerSpec):
        from ..quant.paged import kv_cache_shape
        return tuple(kv_cache_shape(num_blocks, block_size, spec.num_kv_heads,
                                    get_codec(spec.kv_cache_dtype, spec.cache_head_size)))

    @classmethod
    def kv_cache_torch_dtype(cls, spec: AttentionLayerSpec) -> torch.dtype:
        return torch.uint8

    @classmethod
    def warmup_token_counts(cls, spec, block_size, device, max_tokens):
        # the store kernel's build follows the step's row count (kernels/store.py)
        return _kernels().store_warmup_token_counts(get_codec(spec.kv_cache_dtype,
                                                              spec.cache_head_size),
                                                    spec.num_kv_heads, block_size, device,
                                                    max_tokens)

    @classmethod
    def unsupported_reason(cls, spec: AttentionLayerSpec) -> str | None:
        if spec.dtype not in MODEL_DTYPES:
            return f"model dtype {spec.dtype} not supported by {cls.name} (fp16, bf16, fp32)"
        reason = super().unsupported_reason(spec)
        if reason is None and spec.cache_head_size < spec.head_size:
            return (f"kv_cache_head_size={spec.kv_cache_head_size} is below the head size "
                    f"{spec.head_size} (the cache pads vectors, it does not cut them)")
        if reason is None and spec.kv_cache_dtype in PRESETS:
            d = spec.cache_head_size
            why = PRESETS[spec.kv_cache_dtype].head_dim_unsupported_reason(d)
            if why is not None:
                return f"{spec.kv_cache_dtype} cannot encode head size {d}: {why}"
        return reason
