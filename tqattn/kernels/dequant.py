"""Dequantize kernel: paged compressed prefix → bf16/fp16 K/V in the original basis (Triton).

Math = :func:`tqattn.quant.paged.dequant_ref`. For long chunked-prefill continuations: the
compressed prefix is expanded once and handed to FlashAttention with the raw chunk. One program
per (tile of tokens, sequence, KV head); rotated keys/values are un-rotated in-kernel with a
``tl.dot`` against the rotation rows gathered in the tile's coordinate order; outlier-split keys
add their stored outliers to the un-rotated tile before the cast.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant.codec import TQCodec
from ..quant.paged import cache_block_size
from . import _tl
from ._spec import interpreted, kernel_spec


@triton.jit
def _centroids(cache_ptr, lut_ptr, pbase, tip, ok, BS: tl.constexpr, OFF: tl.constexpr,
               BITS: tl.constexpr, W: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
               CPW: tl.constexpr, LUT: tl.constexpr, CM: tl.constexpr):
    codes = _tl.load_codes(cache_ptr, pbase, tip, ok, OFF, BS, BITS, W, G, GP, CPW, CM)
    col = _tl.coords(GP, CPW)
    c = tl.load(lut_ptr + LUT + codes, mask=ok[:, None] & (col < G * CPW)[None, :], other=0.0)
    return c


@triton.jit
def _unrotate_store(c0, c1, out_rows, ok, out_ptr, rot_ptr, oidx, oval, D: tl.constexpr,
                    DP: tl.constexpr, BD: tl.constexpr, HAS_1: tl.constexpr, NOUT: tl.constexpr,
                    GP0: tl.constexpr, CPW0: tl.constexpr, START0: tl.constexpr, COUNT0: tl.constexpr,
                    GP1: tl.constexpr, CPW1: tl.constexpr, START1: tl.constexpr, COUNT1: tl.constexpr):
    """out[:, :D] = Σ_f c_f [N, GP·CPW] (rotated coords START_f + col) @ Rᵀ (+ the outliers
    oval at channels oidx [N, NOUTP] when NOUT > 0), BD columns at a time."""
    col0 = _tl.coords(GP0, CPW0)
    col1 = _tl.coords(GP1, CPW1)
    for d0 in tl.static_range(0, DP, BD):
        dd = d0 + tl.arange(0, BD)
        rt = tl.load(rot_ptr + dd[None, :] * D + START0 + col0[:, None],
                     mask=(col0 < COUNT0)[:, None] & (dd < D)[None, :], other=0.0)
        part = tl.dot(c0, rt)
        if HAS_1:
            rt1 = tl.load(rot_ptr + dd[None, :] * D + START1 + col1[:, None],
                          mask=(col1 < COUNT1)[:, None] & (dd < D)[None, :], other=0.0)
            part += tl.dot(c1, rt1)
        if NOUT > 0:
            hit = dd[None, None, :] == oidx[:, :, None]
            part += tl.sum(tl.where(hit, oval[:, :, None], 0.0), axis=1)
        tl.store(out_ptr + out_rows[:, None] + dd[None, :], part.to(out_ptr.dtype.element_ty),
                 mask=ok[:, None] & (dd < D)[None, :])


@triton.jit
def _dequant_kernel(
        cache_ptr, sc_b, sc_h, bt_ptr, sbt, seqlen_ptr, cu_ptr, k_ptr, sk_n, sk_h, v_ptr, sv_n,
        sv_h, lut_ptr, rot_ptr, kfac, vfac,
        HK: tl.constexpr, BLOCK_N: tl.constexpr, BD: tl.constexpr, FP8_NATIVE: tl.constexpr,
        BS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
        K_FP8: tl.constexpr, K_CORR: tl.constexpr, KN_OFF: tl.constexpr, K_NOUT: tl.constexpr,
        K_NOUTP: tl.constexpr, KOI_OFF: tl.constexpr, KOV_OFF: tl.constexpr,
        HAS_K1: tl.constexpr,
        K0_OFF: tl.constexpr, K0_BITS: tl.constexpr, K0_W: tl.constexpr, K0_G: tl.constexpr,
        K0_GP: tl.constexpr, K0_CPW: tl.constexpr, K0_START: tl.constexpr,
        K0_COUNT: tl.constexpr, K0_LUT: tl.constexpr, K0_BND: tl.constexpr, K0_CM: tl.constexpr,
        K1_OFF: tl.constexpr, K1_BITS: tl.constexpr, K1_W: tl.constexpr, K1_G: tl.constexpr,
        K1_GP: tl.constexpr, K1_CPW: tl.constexpr, K1_START: tl.constexpr,
        K1_COUNT: tl.constexpr, K1_LUT: tl.constexpr, K1_BND: tl.constexpr, K1_CM: tl.constexpr,
        V_TQ: tl.constexpr, V_CORR: tl.constexpr, V_LEVELS: tl.constexpr, VN_OFF: tl.constexpr,
        VS_OFF: tl.constexpr, VZ_OFF: tl.constexpr, HAS_V1: tl.constexpr,
        V0_OFF: tl.constexpr, V0_BITS: tl.constexpr, V0_W: tl.constexpr, V0_G: tl.constexpr,
        V0_GP: tl.constexpr, V0_CPW: tl.constexpr, V0_START: tl.constexpr,
        V0_COUNT: tl.constexpr, V0_LUT: tl.constexpr, V0_BND: tl.constexpr, V0_CM: tl.constexpr,
        V1_OFF: tl.constexpr, V1_BITS: tl.constexpr, V1_W: tl.constexpr, V1_G: tl.constexpr,
        V1_GP: tl.constexpr, V1_CPW: tl.constexpr, V1_START: tl.constexpr,
        V1_COUNT: tl.constexpr, V1_LUT: tl.constexpr, V1_BND: tl.constexpr, V1_CM: tl.constexpr,
        PAD_OFF: tl.constexpr, PAD_N: tl.constexpr):
    tile = tl.program_id(0)
    b = tl.program_id(1)
    kvh = tl.program_id(2)
    seq_len = tl.load(seqlen_ptr + b)
    if tile * BLOCK_N < seq_len:
        tok = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = tok < seq_len
        blk = tl.load(bt_ptr + b.to(tl.int64) * sbt + tok // BS, mask=ok, other=0).to(tl.int64)
        pbase = blk * sc_b + kvh * sc_h
        tip = tok % BS
        row = (tl.load(cu_ptr + b) + tok).to(tl.int64)
        k_rows = row * sk_n + kvh * sk_h
        v_rows = row * sv_n + kvh * sv_h
        if K_NOUT > 0:
            oidx, oval = _tl.load_outliers(cache_ptr, pbase, tip, ok, KOI_OFF, KOV_OFF, K_NOUT,
                                           K_NOUTP)
        else:
            oidx = tl.zeros([BLOCK_N, K_NOUTP], tl.int32)
            oval = tl.zeros([BLOCK_N, K_NOUTP], tl.float32)

        if K_FP8:
            codes = _tl.load_codes(cache_ptr, pbase, tip, ok, K0_OFF, BS, K0_BITS, K0_W, K0_G,
                                   K0_GP, K0_CPW, K0_CM)
            if FP8_NATIVE:
                kv = codes.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
            else:
                kv = tl.load(lut_ptr + K0_LUT + codes, mask=ok[:, None], other=0.0)
            d = tl.arange(0, K0_GP)
            tl.store(k_ptr + k_rows[:, None] + d[None, :], kv.to(k_ptr.dtype.element_ty),
                     mask=ok[:, None] & (d < D)[None, :])
        else:
            c0 = _centroids(cache_ptr, lut_ptr, pbase, tip, ok, BS, K0_OFF, K0_BITS, K0_W,
                            K0_G, K0_GP, K0_CPW, K0_LUT, K0_CM)
            if HAS_K1:
                c1 = _centroids(cache_ptr, lut_ptr, pbase, tip, ok, BS, K1_OFF, K1_BITS,
                                K1_W, K1_G, K1_GP, K1_CPW, K1_LUT, K1_CM)
            f = _tl.load_fp16(cache_ptr, pbase, tip, ok, KN_OFF)  # "nc": folded into the norm
            if K_CORR == 2:
                f = f * kfac
            if not HAS_K1:
                c1 = c0
            _unrotate_store(c0 * f[:, None], c1 * f[:, None], k_rows, ok, k_ptr, rot_ptr, oidx,
                            oval, D, DP, BD, HAS_K1, K_NOUT, K0_GP, K0_CPW, K0_START, K0_COUNT,
                            K1_GP, K1_CPW, K1_START, K1_COUNT)

        if V_TQ:
            c0 = _centroids(cache_ptr, lut_ptr, pbase, tip, ok, BS, V0_OFF, V0_BITS, V0_W,
                            V0_G, V0_GP, V0_CPW, V0_LUT, V0_CM)
            if HAS_V1:
                c1 = _centroids(cache_ptr, lut_ptr, pbase, tip, ok, BS, V1_OFF, V1_BITS,
                                V1_W, V1_G, V1_GP, V1_CPW, V1_LUT, V1_CM)
            f = _tl.load_fp16(cache_ptr, pbase, tip, ok, VN_OFF)  # "nc": folded into the norm
            if V_CORR == 2:
                f = f * vfac
            if not HAS_V1:
                c1 = c0
            _unrotate_store(c0 * f[:, None], c1 * f[:, None], v_rows, ok, v_ptr, rot_ptr, oidx,
                            oval, D, DP, BD, HAS_V1, 0, V0_GP, V0_CPW, V0_START, V0_COUNT,
                            V1_GP, V1_CPW, V1_START, V1_COUNT)
        else:
            codes = _tl.load_codes(cache_ptr, pbase, tip, ok, V0_OFF, BS, V0_BITS, V0_W, V0_G,
                                   V0_GP, V0_CPW, V0_CM)
            sc = _tl.load_fp16(cache_ptr, pbase, tip, ok, VS_OFF)
            zr = _tl.load_fp16(cache_ptr, pbase, tip, ok, VZ_OFF)
            val = codes.to(tl.float32) * sc[:, None] + zr[:, None]
            col = _tl.coords(V0_GP, V0_CPW)
            tl.store(v_ptr + v_rows[:, None] + col[None, :], val.to(v_ptr.dtype.element_ty),
                     mask=ok[:, None] & (col < D)[None, :])


# tokens per program and warps (bench/store_dequant.py sweeps them)
BLOCK_N, NUM_WARPS = 128, 4


def dequant_kv_triton(codec: TQCodec, kv_cache: torch.Tensor, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                      max_seq_len: int | None = None, dtype: torch.dtype = torch.bfloat16,
                      out: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Paged cache → (K, V) (total_tokens, Hk, D) of ``dtype`` in the original basis, sequence b at
    rows ``cu_seqlens[b]:cu_seqlens[b] + seq_lens[b]``.

    Without ``max_seq_len`` / ``out`` (and ``cu_seqlens``) the sizes are read from the device (a
    host sync).
    """
    nb, hk, _ = kv_cache.shape
    bs = cache_block_size(codec, kv_cache)
    spec = kernel_spec(codec, bs)
    d = codec.head_dim
    dev = kv_cache.device
    if cu_seqlens is None:
        cu_seqlens = torch.zeros(seq_lens.numel() + 1, dtype=torch.int32, device=dev)
        cu_seqlens[1:] = torch.cumsum(seq_lens, 0)
    if out is None:
        total = int(cu_seqlens[-1].item())
        out = (torch.empty(total, hk, d, dtype=dtype, device=dev),
               torch.empty(total, hk, d, dtype=dtype, device=dev))
    k_out, v_out = out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item()) if seq_lens.numel() else 0
    if max_seq_len == 0 or seq_lens.numel() == 0:
        return k_out, v_out
    lut, rot = spec.tables_on(dev)
    grid = (triton.cdiv(max_seq_len, BLOCK_N), seq_lens.numel(), hk)
    _dequant_kernel[grid](
        kv_cache, kv_cache.stride(0), kv_cache.stride(1), block_table, block_table.stride(0),
        seq_lens, cu_seqlens, k_out, k_out.stride(0), k_out.stride(1), v_out, v_out.stride(0),
        v_out.stride(1), lut, rot, spec.kfac, spec.vfac,
        HK=hk, BLOCK_N=BLOCK_N, BD=min(32, spec.meta["DP"]), FP8_NATIVE=not interpreted(dev),
        num_warps=NUM_WARPS, **spec.meta)
    return k_out, v_out
