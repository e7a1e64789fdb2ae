"""The attention backend interface (vLLM v1's split: backend / impl / metadata builder).

* An :class:`AttentionBackend` names itself, says what it supports (KV-cache dtypes, head
  sizes, sliding window, ALiBi, soft-cap, sinks) and gives the paged KV-cache shape of one layer.
* Its :class:`AttentionImpl` (one per layer) stores the step's new K/V into the cache and
  computes attention for the step's tokens.
* Its :class:`AttentionMetadataBuilder` (one per KV-cache group) turns the engine's
  :class:`CommonAttentionMetadata` into whatever the impl needs, once per step, on the CPU side.
  Nothing in ``store``/``forward`` synchronises with the host.
* A backend with ``cudagraph_decode`` (vLLM: "CUDA-graph support") promises that the metadata
  its builder makes for a pure-decode batch (``num_decodes == num_reqs``) is only views of the
  common metadata's device tensors, with shapes fixed by the batch size and the block table's
  width, so the model runner can build it once per batch-size bucket over static buffers,
  capture the decode step in a CUDA graph and replay it after rewriting those buffers in place.

Token batches are flattened: T tokens of B requests, decodes first, request b owning tokens
``query_start_loc[b]:query_start_loc[b+1]``; q is (T, Hq, D), k and v are (T, Hk, D).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from . import fa_utils


@dataclass(frozen=True)
class AttentionLayerSpec:
    """What one attention layer needs from its backend (the per-layer settings)."""
    layer_idx: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    dtype: torch.dtype                  # activation dtype of the model
    kv_cache_dtype: str = "auto"        # "auto" (= dtype) or a TurboQuant preset name
    sliding_window: int | None = None   # attend to the last W keys (incl. the query's own)
    logits_soft_cap: float = 0.0
    alibi: bool = False
    sinks: bool = False
    # the compressed cache's head size where it differs from head_size: vectors zero-padded to
    # it (a head size the tensor-core decode kernel runs); None: head_size
    kv_cache_head_size: int | None = None

    @property
    def name(self) -> str:
        return f"layers.{self.layer_idx}.attn"

    @property
    def cache_head_size(self) -> int:
        return self.kv_cache_head_size or self.head_size


@dataclass
class CommonAttentionMetadata:
    """Per-step batch description shared by every layer of one KV-cache group.

    ``seq_lens`` counts each request's tokens once this step's tokens are in the cache;
    ``num_computed_tokens`` those that were there before it (seq_lens − query lens). The
    ``*_cpu`` copies let builders plan without syncing; device tensors are what kernels read.
    """
    query_start_loc: torch.Tensor          # (B+1,) int32
    seq_lens: torch.Tensor                 # (B,) int32
    num_computed_tokens: torch.Tensor      # (B,) int32
    block_table: torch.Tensor              # (B, max_blocks) int32
    slot_mapping: torch.Tensor             # (T,) int64, −1 = padding (not stored)
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    num_computed_tokens_cpu: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    num_decodes: int = 0                   # the first num_decodes requests have query length 1
    num_decode_tokens: int = 0
    block_size: int = 16


AUTO = "auto"


def choose_fa_version(spec: AttentionLayerSpec) -> int | None:
    """The FlashAttention version a layer's prefill uses, chosen once and logged once.

    :func:`~tqattn.attention.fa_utils.get_flash_attn_version` decides from the device and the
    head size; FA kernels take only fp16/bf16, so an fp32 layer runs torch SDPA (logged once).
    """
    version = fa_utils.get_flash_attn_version(spec.head_size, spec.alibi,
                                              requires_softcap=bool(spec.logits_soft_cap))
    if version is not None and spec.dtype not in (torch.float16, torch.bfloat16):
        fa_utils._log_once(logging.INFO, ("fa_dtype", spec.dtype),
                           "FlashAttention takes fp16/bf16 only; %s layers run torch SDPA",
                           spec.dtype)
        version = None
    return version


def token_rows(x: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) with each token's H·D elements contiguous (its token stride may be anything):
    the layout of paths that index whole token rows; a copy only when x is not laid out so."""
    if x.stride(2) == 1 and (x.shape[1] == 1 or x.stride(1) == x.shape[2]):
        return x
    return x.contiguous()


class AttentionImpl(ABC):
    """One layer's attention on one backend.

    Queries, keys and values come as (T, H, D) with a contiguous last dimension; their token
    and head strides may be anything (the compiled model hands over its buffers as they are
    laid out, often head-major after RoPE). The output is a new contiguous (T, Hq, D).

    ``fa_version`` is the FlashAttention version every prefill call of this layer passes to
    :func:`~tqattn.attention.fa_utils.flash_attn_varlen`: ``"auto"`` (default) chooses it here
    with :func:`choose_fa_version`; an int or None (= torch SDPA) forces it.
    """

    def __init__(self, spec: AttentionLayerSpec, *, fa_version: int | None | str = AUTO):
        self.spec = spec
        self.fa_version = choose_fa_version(spec) if fa_version == AUTO else fa_version
        fa_utils.log_fa_choice(spec.name, self.fa_version)

    @abstractmethod
    def store(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
              metadata) -> None:
        """Write the step's new K/V (T, Hk, D) into the paged cache at ``slot_mapping``."""

    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata) -> torch.Tensor:
        """Attention output (T, Hq, D) in the query's dtype; called after :meth:`store`."""

    def store_and_forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          kv_cache: torch.Tensor, metadata) -> torch.Tensor:
        """:meth:`store` then :meth:`forward`; a backend may fuse the two (same result)."""
        self.store(key, value, kv_cache, metadata)
        return self.forward(query, key, value, kv_cache, metadata)


class AttentionMetadataBuilder(ABC):
    """Builds a backend's metadata for one KV-cache group, once per step.

    ``layers`` maps layer names to the impls of *every* attention layer in the model — a builder
    that gathers per-layer settings must look only at the impls of its own backend.
    """

    def __init__(self, layers: dict[str, AttentionImpl], device: torch.device):
        self.layers = layers
        self.device = device

    @abstractmethod
    def build(self, common: CommonAttentionMetadata):
        ...


class AttentionBackend(ABC):
    name: ClassVar[str]
    supports_sliding_window: ClassVar[bool] = False
    supports_alibi: ClassVar[bool] = False
    supports_softcap: ClassVar[bool] = False
    supports_sinks: ClassVar[bool] = False
    cudagraph_decode: ClassVar[bool] = False  # pure-decode steps are graph-safe (module docstring)
    impl_cls: ClassVar[type[AttentionImpl]]
    builder_cls: ClassVar[type[AttentionMetadataBuilder]]

    @classmethod
    @abstractmethod
    def accepts_kv_cache_dtype(cls, kv_cache_dtype: str) -> bool: ...

    @classmethod
    @abstractmethod
    def supports_head_size(cls, head_size: int) -> bool: ...

    @classmethod
    @abstractmethod
    def kv_cache_shape(cls, num_blocks: int, block_size: int, spec: AttentionLayerSpec) -> tuple[int, ...]: ...

    @classmethod
    @abstractmethod
    def kv_cache_torch_dtype(cls, spec: AttentionLayerSpec) -> torch.dtype: ...

    @classmethod
    def page_bytes(cls, block_size: int, spec: AttentionLayerSpec) -> int:
        """Bytes one cache block of one layer occupies."""
        n = 1
        for s in cls.kv_cache_shape(1, block_size, spec):
            n *= s
        return n * torch.empty((), dtype=cls.kv_cache_torch_dtype(spec)).element_size()

    @classmethod
    def warmup_token_counts(cls, spec: AttentionLayerSpec, block_size: int,
                            device: torch.device | str, max_tokens: int) -> list[int]:
        """Step token counts (<= max_tokens) the start-up warm-up should run, beyond its step
        kinds, so that every kernel build this layer can launch compiles before the run."""
        return []

    @classmethod
    def unsupported_reason(cls, spec: AttentionLayerSpec) -> str | None:
        """Why this backend cannot run the layer, or None if it can."""
        if not cls.accepts_kv_cache_dtype(spec.kv_cache_dtype):
            return f"KV-cache dtype {spec.kv_cache_dtype!r} not handled by {cls.name}"
        if not cls.supports_head_size(spec.head_size):
            return f"head size {spec.head_size} not supported by {cls.name}"
        for feature, wanted, ok in (
                ("sliding window", spec.sliding_window is not None, cls.supports_sliding_window),
                ("ALiBi", spec.alibi, cls.supports_alibi),
                ("logits soft-cap", bool(spec.logits_soft_cap), cls.supports_softcap),
                ("attention sinks", spec.sinks, cls.supports_sinks)):
            if wanted and not ok:
                return f"{feature} not supported by {cls.name}"
        return None


@dataclass
class AttentionLayer:
    """A layer bound to its backend: the spec, the impl and its KV-cache group index."""
    spec: AttentionLayerSpec
    backend: type[AttentionBackend]
    impl: AttentionImpl
    group: int = 0
    extra: dict = field(default_factory=dict)
