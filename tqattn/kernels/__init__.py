"""Kernel entry points: the Triton kernel for CUDA tensors, the PyTorch reference otherwise.

``store_kv``, ``decode_attention`` and ``dequant_kv`` take the same arguments as their references
in :mod:`tqattn.quant.paged`. On CUDA they run the Triton kernels (``tqattn.kernels.store`` /
``decode`` / ``dequant``, imported lazily so this package imports without triton). On CPU they
run the reference, unless ``TQATTN_FORCE_TRITON=1`` (the kernels then run under triton's
interpreter — which needs ``TRITON_INTERPRET=1`` set before they are first imported; the CPU
tests use it to run the backends through the kernels). Configurations without a Triton kernel
(QJL presets, odd block sizes or field widths) fall back to the reference on CUDA too, logged
once. Which kernels run a decode call, and where its new K/V are written: kernels/step.py.
"""

from __future__ import annotations

import torch

from ..quant import paged
from . import step


def store_kv(codec, key, value, kv_cache, slot_mapping, key_offset=None) -> None:
    """Quantize key/value (N, Hk, D) into the paged cache at slot_mapping (negative = skip).
    ``key_offset`` = (μ, μ·R) fp32 (Hk, D): store the keys centered, k − μ, computed in fp32
    (:meth:`tqattn.attention.key_centering.KeyOffset.for_store`)."""
    if step.use_triton(key):
        mod = step.triton_module("store")
        if mod is not None:
            try:
                return mod.store_kv_triton(codec, key, value, kv_cache, slot_mapping, key_offset)
            except NotImplementedError as e:
                step.fallback(f"store {codec.preset.name}", e)
    if key_offset is not None:
        key = key.float() - key_offset[0]
    return paged.store_ref(codec, key, value, kv_cache, slot_mapping)


def decode_attention(codec, q, kv_cache, block_table, seq_lens, query_start_loc=None,
                     query_pos_start=None, scale=None, window=None, softcap=0.0,
                     return_lse=False, max_query_len=None, new_kv=None, num_splits=None,
                     out=None):
    """Attention over the compressed paged cache; row semantics in :mod:`tqattn.quant.paged`.

    ``new_kv`` = (key, value, slot_mapping): stored before the decode reads the cache, where
    :func:`tqattn.kernels.step.plan_decode_store` says (inside the tensor-core decode kernel
    where it runs). ``num_splits`` / ``out``: as :func:`tqattn.kernels.decode.
    decode_attention_triton` (the reference path ignores them). Returns q.dtype output on the
    Triton path, fp32 on the reference path.
    """
    if step.triton_spec(codec, q, kv_cache) is not None:  # the Triton call plans the store
        return step.triton_module("decode").decode_attention_triton(
            codec, q, kv_cache, block_table, seq_lens, query_start_loc, query_pos_start, scale,
            window, softcap, return_lse, max_query_len=max_query_len, num_splits=num_splits,
            out=out, new_kv=new_kv)
    if new_kv is not None:
        store_kv(codec, new_kv[0], new_kv[1], kv_cache, new_kv[2])
    return paged.decode_attention_ref(codec, q, kv_cache, block_table, seq_lens, query_start_loc,
                                      query_pos_start, scale, window, softcap, return_lse)


def dequant_kv(codec, kv_cache, block_table, seq_lens, cu_seqlens=None, max_seq_len=None,
               dtype=torch.bfloat16, out=None):
    """Compressed prefix → (K, V) (sum(seq_lens), Hk, D) of dtype, original basis."""
    if step.use_triton(kv_cache):
        mod = step.triton_module("dequant")
        if mod is not None:
            try:
                return mod.dequant_kv_triton(codec, kv_cache, block_table, seq_lens, cu_seqlens,
                                             max_seq_len, dtype, out)
            except NotImplementedError as e:
                step.fallback(f"dequant {codec.preset.name}", e)
    k, v = paged.dequant_ref(codec, kv_cache, block_table, seq_lens, dtype)
    if out is not None:
        out[0].copy_(k)
        out[1].copy_(v)
        return out
    return k, v


def store_warmup_token_counts(codec, num_kv_heads: int, block_size: int, device,
                              max_tokens: int) -> list[int]:
    """Step token counts that, between them, launch every build of the store kernel a run on
    ``device`` can reach (none where the store is not a Triton kernel)."""
    if torch.device(device).type != "cuda":
        return []
    mod = step.triton_module("store")
    if mod is None:
        return []
    try:
        return mod.warmup_token_counts(codec, num_kv_heads, block_size, device, max_tokens)
    except NotImplementedError:  # no Triton store for this layout: the reference runs
        return []


__all__ = ["store_kv", "decode_attention", "dequant_kv", "store_warmup_token_counts"]
