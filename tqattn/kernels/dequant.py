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
from ._args import FLOAT_DTYPES, check_index
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
def _dequant_rotated(cache_ptr, lut_ptr, pbase, tip, ok, out_rows, out_ptr, rot_ptr, oidx, oval,
                     fac, BD: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                     N_OFF: tl.constexpr, CORR: tl.constexpr, HAS_1: tl.constexpr,
                     NOUT: tl.constexpr, F0: tl.constexpr, F1: tl.constexpr):
    """Rotated keys or values (fields F0 and, with HAS_1, F1; norm plane N_OFF) → their rows of
    out in the original basis."""
    c0 = _centroids(cache_ptr, lut_ptr, pbase, tip, ok, BS, F0.off, F0.bits, F0.w, F0.g, F0.gp,
                    F0.cpw, F0.lut, F0.cm)
    if HAS_1:
        c1 = _centroids(cache_ptr, lut_ptr, pbase, tip, ok, BS, F1.off, F1.bits, F1.w, F1.g,
                        F1.gp, F1.cpw, F1.lut, F1.cm)
    else:
        c1 = c0
    f = _tl.load_fp16(cache_ptr, pbase, tip, ok, N_OFF)  # "nc": folded into the norm
    if CORR == 2:
        f = f * fac
    _unrotate_store(c0 * f[:, None], c1 * f[:, None], out_rows, ok, out_ptr, rot_ptr, oidx, oval,
                    D, DP, BD, HAS_1, NOUT, F0.gp, F0.cpw, F0.start, F0.count, F1.gp, F1.cpw,
                    F1.start, F1.count)


@triton.jit(do_not_specialize=["sbt"])  # the block-table width changes per step
def _dequant_kernel(cache_ptr, sc_b, sc_h, bt_ptr, sbt, seqlen_ptr, cu_ptr, k_ptr, sk_n,
                    sk_h, v_ptr, sv_n, sv_h, lut_ptr, rot_ptr, kfac, vfac, HK: tl.constexpr,
                    BLOCK_N: tl.constexpr, BD: tl.constexpr, FP8_NATIVE: tl.constexpr,
                    L: tl.constexpr, K0: tl.constexpr, K1: tl.constexpr, V0: tl.constexpr,
                    V1: tl.constexpr):
    tile = tl.program_id(0)
    b = tl.program_id(1)
    kvh = tl.program_id(2)
    seq_len = tl.load(seqlen_ptr + b)
    if tile * BLOCK_N < seq_len:
        tok = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = tok < seq_len
        blk = tl.load(bt_ptr + b.to(tl.int64) * sbt + tok // L.bs, mask=ok, other=0).to(tl.int64)
        pbase = blk * sc_b + kvh * sc_h
        tip = tok % L.bs
        row = (tl.load(cu_ptr + b) + tok).to(tl.int64)
        k_rows = row * sk_n + kvh * sk_h
        v_rows = row * sv_n + kvh * sv_h
        if L.k_nout > 0:
            oidx, oval = _tl.load_outliers(cache_ptr, pbase, tip, ok, L.koi_off, L.kov_off,
                                           L.k_nout, L.k_noutp)
        else:
            NOUTP: tl.constexpr = L.k_noutp   # shapes take constexprs, not plain ints
            oidx = tl.zeros([BLOCK_N, NOUTP], tl.int32)
            oval = tl.zeros([BLOCK_N, NOUTP], tl.float32)

        if L.k_fp8:
            codes = _tl.load_codes(cache_ptr, pbase, tip, ok, K0.off, L.bs, K0.bits, K0.w, K0.g,
                                   K0.gp, K0.cpw, K0.cm)
            if FP8_NATIVE:
                kv = codes.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
            else:
                kv = tl.load(lut_ptr + K0.lut + codes, mask=ok[:, None], other=0.0)
            d = tl.arange(0, K0.gp)
            tl.store(k_ptr + k_rows[:, None] + d[None, :], kv.to(k_ptr.dtype.element_ty),
                     mask=ok[:, None] & (d < L.d)[None, :])
        else:
            _dequant_rotated(cache_ptr, lut_ptr, pbase, tip, ok, k_rows, k_ptr, rot_ptr, oidx,
                             oval, kfac, BD, L.bs, L.d, L.dp, L.kn_off, L.k_corr, L.has_k1,
                             L.k_nout, K0, K1)

        if L.v_tq:
            _dequant_rotated(cache_ptr, lut_ptr, pbase, tip, ok, v_rows, v_ptr, rot_ptr, oidx,
                             oval, vfac, BD, L.bs, L.d, L.dp, L.vn_off, L.v_corr, L.has_v1, 0,
                             V0, V1)
        else:
            codes = _tl.load_codes(cache_ptr, pbase, tip, ok, V0.off, L.bs, V0.bits, V0.w, V0.g,
                                   V0.gp, V0.cpw, V0.cm)
            sc = _tl.load_fp16(cache_ptr, pbase, tip, ok, L.vs_off)
            zr = _tl.load_fp16(cache_ptr, pbase, tip, ok, L.vz_off)
            val = codes.to(tl.float32) * sc[:, None] + zr[:, None]
            col = _tl.coords(V0.gp, V0.cpw)
            tl.store(v_ptr + v_rows[:, None] + col[None, :], val.to(v_ptr.dtype.element_ty),
                     mask=ok[:, None] & (col < L.d)[None, :])


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
    bs = cache_block_size(codec, kv_cache)
    nb, hk, _ = kv_cache.shape
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be float16/bfloat16/float32, got {dtype}")
    check_index("seq_lens", seq_lens)
    check_index("block_table", block_table, dim=2, min_len=seq_lens.shape[0])
    if cu_seqlens is not None:
        check_index("cu_seqlens", cu_seqlens, length=seq_lens.shape[0] + 1)
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
        HK=hk, BLOCK_N=BLOCK_N, BD=min(32, spec.layout.dp), FP8_NATIVE=not interpreted(dev),
        num_warps=NUM_WARPS, **spec.constexprs)
    return k_out, v_out
