"""Full-precision cache write (Triton): a step's K/V rows into the FLASH_ATTN paged cache.

Math = :func:`tqattn.attention.flash_attn.scatter_rows` on the cache's (2, slots, Hk·D) view:
``cache[0, slot] = key[i]`` and ``cache[1, slot] = value[i]`` cast to the cache dtype, skipping
negative (padding) slots. One launch per layer per step instead of the ~10 small torch kernels
the reference needs without a host sync (vLLM's ``reshape_and_cache_flash`` does this in CUDA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_row(src, s_h, dst, W: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    # one token's Hk·D elements: head h's D at src + h·s_h (any head stride), contiguous in dst
    for c in tl.static_range(0, W, BLOCK):
        col = c + tl.arange(0, BLOCK)
        ok = col < W
        x = tl.load(src + (col // D) * s_h + col % D, mask=ok)
        tl.store(dst + col, x.to(dst.dtype.element_ty), mask=ok)


@triton.jit
def _write_kv_kernel(k_ptr, sk_n, sk_h, v_ptr, sv_n, sv_h, slot_ptr, cache_ptr, plane,
                     W: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    # one program per (token, role): even programs keys, odd values
    pid = tl.program_id(0)
    tok = pid // 2
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        if pid % 2 == 0:
            _copy_row(k_ptr + tok.to(tl.int64) * sk_n, sk_h, cache_ptr + slot * W, W, D, BLOCK)
        else:
            _copy_row(v_ptr + tok.to(tl.int64) * sv_n, sv_h, cache_ptr + plane + slot * W, W, D,
                      BLOCK)


def write_kv_triton(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """key/value (≥ N, Hk, D), any token and head strides → kv_cache (2, num_blocks, block_size,
    Hk, D) at slot_mapping (N,), in place; negative slots write nothing. No host sync (CUDA-graph
    safe)."""
    n = slot_mapping.shape[0]
    _, num_blocks, block_size, hk, d = kv_cache.shape
    if key.shape[1:] != (hk, d) or value.shape[1:] != (hk, d):
        raise ValueError(f"key {tuple(key.shape)} / value {tuple(value.shape)} do not match the "
                         f"cache's (Hk, D) = {(hk, d)}")
    if not kv_cache.is_contiguous():
        raise ValueError("the full-precision KV cache must be contiguous")
    if n == 0:
        return
    k, v = (x if x.stride(2) == 1 else x.contiguous() for x in (key, value))
    w = hk * d
    block = min(triton.next_power_of_2(w), 4096)
    _write_kv_kernel[(2 * n,)](k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
                               slot_mapping, kv_cache, num_blocks * block_size * w, W=w, D=d,
                               BLOCK=block, num_warps=4 if block >= 1024 else 1)
