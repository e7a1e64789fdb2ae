"""Split-KV decode attention over the paged TurboQuant cache (Triton).

Math = :func:`tqattn.quant.paged.decode_attention_ref`. One program per (sequence, KV head,
split, row block): all query heads of the KV group (and, for multi-row calls, several rows) form
the ``BLOCK_M`` rows of the ``tl.dot`` calls, so each compressed byte is read once per group.
The query is rotated once on the host side (one fp32 GEMM) and scored against centroid tiles in
the rotated basis: ``score_j = scale · n_j · ⟨q R, ĉ_j⟩`` (pages store "nc" norms folded,
n/‖ĉ‖) — the per-token factor scales the score column, never K. Uniform values enter as their
codes (``p·v = (p·scale) @ codes + p·zero``); rotated ("tq") values as centroids with ``p``
scaled by ``n/‖ĉ‖`` — accumulated in the rotated basis and un-rotated once after the merge.
Outlier-split keys add ``⟨q, o_j⟩`` per token: per stored outlier, the unrotated query rows
gathered at its channel (L1 hits) times its value.

Inner loop: a packed word holds CPW codes (8 for 3-bit, 2 for 4-bit); code i of every word
forms its own ``[BLOCK_N, G]`` tile and its own ``tl.dot`` with the matching query columns
(``g·CPW + i``, gathered once before the loop), so codes are never interleaved back into
coordinate order. The raw bytes of tile t+1 are loaded into registers while tile t is computed.
Splits write a normalised partial output and its LSE; a second small kernel
merges them. The grid depends only on the batch size (and ``max_query_len``); the tiles each
split walks come from ``seq_lens`` on the device: CUDA-graph safe, no host sync.

The rotated query (the raw one for fp8 keys) enters the dots in fp16, as in both kernels: a
coordinate past ±65504 overflows (the row's output is lost), and score errors grow with |q|.

Code → fp16 conversion: 3-bit codes (keys, tq or uniform values) and 4-bit uniform values go
through inline-asm register ``prmt`` tables (kernels/_asm.py) fed by int32 word loads; other
widths through byte loads, shifts and centroid gathers (also the interpreter's path).

Dispatch (kernels/step.py): the layouts of ``_spec.mma_layout`` (the main presets at head sizes
64, 128 and 256) at one row per sequence, no window / soft-cap go to the Gluon tensor-core
kernel (kernels/decode_mma.py), which also stores a step's new K/V itself at head sizes 128 and
256; everything else runs this kernel, after the store kernel for new K/V. This kernel is
latency-bound, well below the copy bandwidth (bench/results/README.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant.codec import TQCodec
from ..quant.paged import cache_block_size
from . import _asm, _tl, step, store
from ._args import check_decode_args, check_float, check_index
from ._asm import U4_VALUES  # by name, so that it is part of the kernels' cache key
from ._spec import default_scale, interpreted, kernel_spec, next_pow2, num_sms


@triton.jit
def _raw_field(cache_ptr, pbase, tip, ok, BS: tl.constexpr, OFF: tl.constexpr, W: tl.constexpr,
               G: tl.constexpr, GP: tl.constexpr, CM: tl.constexpr):
    """Raw bytes [N, GP] of a code field's W sub-planes (unused planes alias plane 0)."""
    ptr = _tl.row_ptr(cache_ptr, pbase, tip, OFF, G, CM)
    b0 = _tl.load_bytes(ptr, ok[:, None], BS, 0, G, GP, CM)
    if W == 3:
        b1 = _tl.load_bytes(ptr, ok[:, None], BS, 1, G, GP, CM)
        b2 = _tl.load_bytes(ptr, ok[:, None], BS, 2, G, GP, CM)
    else:
        b1 = b0
        b2 = b0
    return b0, b1, b2


@triton.jit
def _raw_words(cache_ptr, pbase4, tip4, okp4, BS: tl.constexpr, OFF: tl.constexpr,
               G: tl.constexpr, GP: tl.constexpr):
    """int32 [GP, N/4] of the three sub-planes of a column-major 3-bit field: word (g, r) holds
    byte position g of tokens 4r..4r+3 (pbase4/tip4/okp4: page base, offset and page mask of
    token 4r)."""
    g = tl.arange(0, GP)[:, None]
    m = okp4[None, :] & (g < G)
    # in words: pages and planes start 16-byte aligned, so the 4 words of a page's 16 tokens
    # are contiguous and aligned (the hint lets the load vectorise along tokens)
    off = ((pbase4 + OFF + tip4) // 4)[None, :] + g * (BS // 4)
    off = tl.max_contiguous(tl.multiple_of(off, [1, 4]), [1, 4])
    p = cache_ptr.to(tl.pointer_type(tl.int32)) + off
    w0 = tl.load(p, mask=m, other=0)
    w1 = tl.load(p + BS * G // 4, mask=m, other=0)
    w2 = tl.load(p + BS * G // 2, mask=m, other=0)
    return w0, w1, w2


@triton.jit
def _raw_row_words(cache_ptr, pbase, tip, ok, OFF: tl.constexpr, G: tl.constexpr,
                   GP: tl.constexpr, S: tl.constexpr, BS: tl.constexpr):
    """int32 [N, GP/4] of sub-plane S of a token-major plane (G % 4 == 0): word w = bytes
    4w..4w+3."""
    w = tl.arange(0, GP // 4)[None, :]
    off = ((pbase + OFF + S * BS * G) // 4 + tip * (G // 4))[:, None] + w
    return tl.load(cache_ptr.to(tl.pointer_type(tl.int32)) + off,
                   mask=ok[:, None] & (w < G // 4), other=0)


@triton.jit
def _raw_fp16(cache_ptr, pbase, tip, ok, OFF: tl.constexpr):
    return tl.load((cache_ptr + pbase + OFF).to(tl.pointer_type(tl.float16)) + tip, mask=ok,
                   other=0.0)


@triton.jit
def _words(b0, b1, b2, W: tl.constexpr):
    w = b0.to(tl.int32)
    if W == 3:
        w = w | (b1.to(tl.int32) << 8) | (b2.to(tl.int32) << 16)
    return w


@triton.jit
def _phase_tile(w, I: tl.constexpr, lut_ptr, cm, LUT_ON: tl.constexpr, FP8: tl.constexpr,
                FP8_NATIVE: tl.constexpr, BITS: tl.constexpr, W: tl.constexpr, LUT: tl.constexpr):
    """Code I of every word → fp16 tile [N, GP] (centroid / fp8 key / uniform code)."""
    code = _tl.code_of(w, I, BITS, W)
    if FP8 and FP8_NATIVE:
        v = code.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    elif LUT_ON:
        v = tl.load(lut_ptr + LUT + code, mask=cm, other=0.0).to(tl.float16)
    else:
        # the code as fp16 without an int→float conversion (quarter-rate): the bits 0x6400 | code
        # are the fp16 1024 + code, and subtracting 1024 in fp16 is exact (a 1024·Σp taken off
        # the fp32 accumulator instead is lost to the tensor cores' truncating accumulation
        # over long splits)
        v = (code | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
    return v


@triton.jit
def _key_phase(w, I: tl.constexpr, q, s, lut_ptr, cm, FP8: tl.constexpr,
               FP8_NATIVE: tl.constexpr, BITS: tl.constexpr, W: tl.constexpr,
               LUT: tl.constexpr):
    k = _phase_tile(w, I, lut_ptr, cm, True, FP8, FP8_NATIVE, BITS, W, LUT)
    return s + tl.dot(q, tl.trans(k))


@triton.jit
def _key_field(w, q0, q1, q2, q3, q4, q5, q6, q7, s, lut_ptr, cm, FP8: tl.constexpr,
               FP8_NATIVE: tl.constexpr, BITS: tl.constexpr, CPW: tl.constexpr, W: tl.constexpr,
               LUT: tl.constexpr):
    """s += Σ_i q_i · tile_iᵀ over the CPW codes of each word."""
    s = _key_phase(w, 0, q0, s, lut_ptr, cm, FP8, FP8_NATIVE, BITS, W, LUT)
    if CPW > 1:
        s = _key_phase(w, 1, q1, s, lut_ptr, cm, FP8, FP8_NATIVE, BITS, W, LUT)
    if CPW > 2:
        s = _key_phase(w, 2, q2, s, lut_ptr, cm, FP8, FP8_NATIVE, BITS, W, LUT)
        s = _key_phase(w, 3, q3, s, lut_ptr, cm, FP8, FP8_NATIVE, BITS, W, LUT)
    if CPW > 4:
        s = _key_phase(w, 4, q4, s, lut_ptr, cm, FP8, FP8_NATIVE, BITS, W, LUT)
        s = _key_phase(w, 5, q5, s, lut_ptr, cm, FP8, FP8_NATIVE, BITS, W, LUT)
        s = _key_phase(w, 6, q6, s, lut_ptr, cm, FP8, FP8_NATIVE, BITS, W, LUT)
        s = _key_phase(w, 7, q7, s, lut_ptr, cm, FP8, FP8_NATIVE, BITS, W, LUT)
    return s


@triton.jit
def _quad_tile(p01, p23):
    """fp16 pairs of elements (4r, 4r+1) and (4r+2, 4r+3), int32 [C, R] each → fp16 [C, 4R]
    (element 4r + i in column 4r + i)."""
    lo = tl.join((p01 & 0xFFFF).to(tl.int16), (p23 & 0xFFFF).to(tl.int16))
    hi = tl.join((p01 >> 16).to(tl.int16), (p23 >> 16).to(tl.int16))
    t = tl.join(lo, hi).to(tl.float16, bitcast=True)          # [C, R, 2, 2]
    return tl.reshape(t, (p01.shape[0], p01.shape[1] * 4))


@triton.jit
def _key_field_lut3(w0, w1, w2, q0, q1, q2, q3, q4, q5, q6, q7, s, KASM: tl.constexpr):
    """3-bit centroid keys straight from the page words: int32 [GP, BLOCK_N/4] of each byte
    sub-plane (4 consecutive tokens of one byte position per word, column-major planes). One
    inline-asm block per word triple turns them into the 32 centroids as fp16 pairs with
    register ``prmt`` table lookups (asm text: kernels/_asm.py)."""
    o = tl.inline_asm_elementwise(KASM, "=r," * 16 + "r,r,r", [w0, w1, w2], (tl.int32,) * 16,
                                  is_pure=True, pack=1)
    # two independent accumulation chains: more tensor-core work in flight per warp
    s2 = tl.zeros_like(s)
    s = tl.dot(q0, _quad_tile(o[0], o[1]), s)
    s2 = tl.dot(q1, _quad_tile(o[2], o[3]), s2)
    s = tl.dot(q2, _quad_tile(o[4], o[5]), s)
    s2 = tl.dot(q3, _quad_tile(o[6], o[7]), s2)
    s = tl.dot(q4, _quad_tile(o[8], o[9]), s)
    s2 = tl.dot(q5, _quad_tile(o[10], o[11]), s2)
    s = tl.dot(q6, _quad_tile(o[12], o[13]), s)
    s2 = tl.dot(q7, _quad_tile(o[14], o[15]), s2)
    return s + s2


@triton.jit
def _value_tiles_u4(w):
    """4-bit uniform value codes, int32 words [N, GP/4] (4 bytes = 4 columns) → the low-nibble
    and high-nibble tiles [N, GP] fp16, by inline asm."""
    o = tl.inline_asm_elementwise(U4_VALUES, "=r,=r,=r,=r,r", [w], (tl.int32,) * 4,
                                  is_pure=True, pack=1)
    return _quad_tile(o[0], o[1]), _quad_tile(o[2], o[3])


@triton.jit
def _value_tiles_lut3(w0, w1, w2, VASM: tl.constexpr):
    """3-bit value codes (centroids, or uniform codes as the table 0..7) from the column-major
    page words: int32 [GP, N/4] of the three sub-planes (4 consecutive tokens of one byte
    position per word) → the 8 code tiles [N, GP] fp16."""
    o = tl.inline_asm_elementwise(VASM, "=r," * 16 + "r,r,r", [w0, w1, w2], (tl.int32,) * 16,
                                  is_pure=True, pack=1)
    return (tl.trans(_quad_tile(o[0], o[1])), tl.trans(_quad_tile(o[2], o[3])),
            tl.trans(_quad_tile(o[4], o[5])), tl.trans(_quad_tile(o[6], o[7])),
            tl.trans(_quad_tile(o[8], o[9])), tl.trans(_quad_tile(o[10], o[11])),
            tl.trans(_quad_tile(o[12], o[13])), tl.trans(_quad_tile(o[14], o[15])))


@triton.jit
def _value_tiles(w, lut_ptr, cm, TQ: tl.constexpr, BITS: tl.constexpr, CPW: tl.constexpr,
                 W: tl.constexpr, LUT: tl.constexpr):
    """The CPW value tiles of a field (unused ones alias tile 0)."""
    t0 = _phase_tile(w, 0, lut_ptr, cm, TQ, False, False, BITS, W, LUT)
    t1, t2, t3, t4, t5, t6, t7 = t0, t0, t0, t0, t0, t0, t0
    if CPW > 1:
        t1 = _phase_tile(w, 1, lut_ptr, cm, TQ, False, False, BITS, W, LUT)
    if CPW > 2:
        t2 = _phase_tile(w, 2, lut_ptr, cm, TQ, False, False, BITS, W, LUT)
        t3 = _phase_tile(w, 3, lut_ptr, cm, TQ, False, False, BITS, W, LUT)
    if CPW > 4:
        t4 = _phase_tile(w, 4, lut_ptr, cm, TQ, False, False, BITS, W, LUT)
        t5 = _phase_tile(w, 5, lut_ptr, cm, TQ, False, False, BITS, W, LUT)
        t6 = _phase_tile(w, 6, lut_ptr, cm, TQ, False, False, BITS, W, LUT)
        t7 = _phase_tile(w, 7, lut_ptr, cm, TQ, False, False, BITS, W, LUT)
    return t0, t1, t2, t3, t4, t5, t6, t7


@triton.jit
def _outlier_scores(qo_ptr, qo_rows, row_ok, cache_ptr, bt_row, tok, ok, sc_b, kvh_off,
                    BS: tl.constexpr, D: tl.constexpr, IDX_OFF: tl.constexpr,
                    VAL_OFF: tl.constexpr, NOUT: tl.constexpr):
    """⟨q, o⟩ [M, N] fp32 of the tokens' stored outliers: per outlier, the unrotated query rows
    gathered at its channel (L1-resident loads) times its value. Channels >= D (bytes of a
    slot never written) add nothing."""
    blk = tl.load(bt_row + tok // BS, mask=ok, other=0).to(tl.int64)
    at = blk * sc_b + kvh_off + (tok % BS) * NOUT
    o = tl.zeros([qo_rows.shape[0], tok.shape[0]], tl.float32)
    for j in tl.static_range(NOUT):
        c = tl.load(cache_ptr + IDX_OFF + at + j, mask=ok, other=0).to(tl.int32)
        v = _tl.fp8_e4m3_value(tl.load(cache_ptr + VAL_OFF + at + j, mask=ok, other=0)
                               .to(tl.int32))
        qg = tl.load(qo_ptr + qo_rows[:, None] + c[None, :],
                     mask=row_ok[:, None] & (ok & (c < D))[None, :], other=0.0)
        o += qg.to(tl.float32) * v[None, :]
    return o


@triton.jit
def _pv(acc, alpha, pv, v):
    return acc * alpha[:, None] + tl.dot(pv, v)


@triton.jit
def _q_phase(q_ptr, q_rows, row_ok, I: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
             CPW: tl.constexpr, START: tl.constexpr):
    g = tl.arange(0, GP)
    return tl.load(q_ptr + q_rows[:, None] + START + (g * CPW + I)[None, :],
                   mask=row_ok[:, None] & (g < G)[None, :], other=0.0).to(tl.float16)


@triton.jit
def _q_phases(q_ptr, q_rows, row_ok, G: tl.constexpr, GP: tl.constexpr, CPW: tl.constexpr,
              START: tl.constexpr):
    """Query coordinates START + g·CPW + i, one [M, GP] fp16 tile per code i."""
    q0 = _q_phase(q_ptr, q_rows, row_ok, 0, G, GP, CPW, START)
    q1, q2, q3, q4, q5, q6, q7 = q0, q0, q0, q0, q0, q0, q0
    if CPW > 1:
        q1 = _q_phase(q_ptr, q_rows, row_ok, 1, G, GP, CPW, START)
    if CPW > 2:
        q2 = _q_phase(q_ptr, q_rows, row_ok, 2, G, GP, CPW, START)
        q3 = _q_phase(q_ptr, q_rows, row_ok, 3, G, GP, CPW, START)
    if CPW > 4:
        q4 = _q_phase(q_ptr, q_rows, row_ok, 4, G, GP, CPW, START)
        q5 = _q_phase(q_ptr, q_rows, row_ok, 5, G, GP, CPW, START)
        q6 = _q_phase(q_ptr, q_rows, row_ok, 6, G, GP, CPW, START)
        q7 = _q_phase(q_ptr, q_rows, row_ok, 7, G, GP, CPW, START)
    return q0, q1, q2, q3, q4, q5, q6, q7


@triton.jit
def _store_phase(po_ptr, po_rows, row_ok, acc, I: tl.constexpr, G: tl.constexpr,
                 GP: tl.constexpr, CPW: tl.constexpr, START: tl.constexpr):
    g = tl.arange(0, GP)
    tl.store(po_ptr + po_rows[:, None] + START + (g * CPW + I)[None, :], acc,
             mask=row_ok[:, None] & (g < G)[None, :])


@triton.jit
def _store_field(po_ptr, po_rows, row_ok, inv, z, a0, a1, a2, a3, a4, a5, a6, a7,
                 G: tl.constexpr, GP: tl.constexpr, CPW: tl.constexpr, START: tl.constexpr):
    """Normalised partial output (acc_i · inv + z) at the coordinates of code i."""
    _store_phase(po_ptr, po_rows, row_ok, a0 * inv[:, None] + z[:, None], 0, G, GP, CPW, START)
    if CPW > 1:
        _store_phase(po_ptr, po_rows, row_ok, a1 * inv[:, None] + z[:, None], 1, G, GP, CPW, START)
    if CPW > 2:
        _store_phase(po_ptr, po_rows, row_ok, a2 * inv[:, None] + z[:, None], 2, G, GP, CPW, START)
        _store_phase(po_ptr, po_rows, row_ok, a3 * inv[:, None] + z[:, None], 3, G, GP, CPW, START)
    if CPW > 4:
        _store_phase(po_ptr, po_rows, row_ok, a4 * inv[:, None] + z[:, None], 4, G, GP, CPW, START)
        _store_phase(po_ptr, po_rows, row_ok, a5 * inv[:, None] + z[:, None], 5, G, GP, CPW, START)
        _store_phase(po_ptr, po_rows, row_ok, a6 * inv[:, None] + z[:, None], 6, G, GP, CPW, START)
        _store_phase(po_ptr, po_rows, row_ok, a7 * inv[:, None] + z[:, None], 7, G, GP, CPW, START)


@triton.jit
def _load_tile(cache_ptr, bt_row, tok0, lim, sc_b, kvh_off, BLOCK_N: tl.constexpr,
               K0_ASM: tl.constexpr, K1_ASM: tl.constexpr, V_ASM: tl.constexpr, L: tl.constexpr,
               K0: tl.constexpr, K1: tl.constexpr, V0: tl.constexpr, V1: tl.constexpr):
    """Every raw byte / fp16 field of the tokens tok < lim of a tile (issued together, consumed
    later). Column-major key planes are read by whole pages (a mask constant over each run of
    block_size tokens lets the loads vectorise): the bytes of tokens past the end are real page
    memory, their scores are masked and their values weighted by 0 (their norms read as 0)."""
    tok = tok0 + tl.arange(0, BLOCK_N)
    ok = tok < lim
    okp = (tok // L.bs) * L.bs < lim
    blk = tl.load(bt_row + tok // L.bs, mask=okp, other=0).to(tl.int64)
    pbase = blk * sc_b + kvh_off
    tip = tok % L.bs
    if K0_ASM or K1_ASM or V_ASM == 3:
        tok4 = tok0 + tl.arange(0, BLOCK_N // 4) * 4
        okp4 = (tok4 // L.bs) * L.bs < lim
        blk4 = tl.load(bt_row + tok4 // L.bs, mask=okp4, other=0).to(tl.int64)
        pbase4 = blk4 * sc_b + kvh_off
        tip4 = tok4 % L.bs
    if K0_ASM:
        ka, kb, kc = _raw_words(cache_ptr, pbase4, tip4, okp4, L.bs, K0.off, K0.g, K0.gp)
    else:
        ka, kb, kc = _raw_field(cache_ptr, pbase, tip, okp if K0.cm else ok, L.bs, K0.off, K0.w,
                                K0.g, K0.gp, K0.cm)
    if L.has_k1:
        if K1_ASM:
            kd, ke, kf = _raw_words(cache_ptr, pbase4, tip4, okp4, L.bs, K1.off, K1.g, K1.gp)
        else:
            kd, ke, kf = _raw_field(cache_ptr, pbase, tip, okp if K1.cm else ok, L.bs, K1.off,
                                    K1.w, K1.g, K1.gp, K1.cm)
    else:
        kd, ke, kf = ka, kb, kc
    if V_ASM == 1:
        va = _raw_row_words(cache_ptr, pbase, tip, ok, V0.off, V0.g, V0.gp, 0, L.bs)
        vb, vc = va, va
    elif V_ASM == 3:
        va, vb, vc = _raw_words(cache_ptr, pbase4, tip4, okp4, L.bs, V0.off, V0.g, V0.gp)
    else:
        va, vb, vc = _raw_field(cache_ptr, pbase, tip, okp if V0.cm else ok, L.bs, V0.off, V0.w,
                                V0.g, V0.gp, V0.cm)
    if L.has_v1:
        vd, ve, vf = _raw_field(cache_ptr, pbase, tip, okp if V1.cm else ok, L.bs, V1.off, V1.w,
                                V1.g, V1.gp, V1.cm)
    else:
        vd, ve, vf = va, vb, vc
    if L.v_tq:
        n2 = _raw_fp16(cache_ptr, pbase, tip, ok, L.vn_off)
        n3 = n2
    else:
        n2 = _raw_fp16(cache_ptr, pbase, tip, ok, L.vs_off)
        n3 = _raw_fp16(cache_ptr, pbase, tip, ok, L.vz_off)
    if L.k_fp8:
        n1 = n2
    else:
        n1 = _raw_fp16(cache_ptr, pbase, tip, ok, L.kn_off)
    return ka, kb, kc, kd, ke, kf, va, vb, vc, vd, ve, vf, n1, n2, n3


# step-dependent integers (block-table width, split count and the strides it sets) are not
# specialization keys: one build serves every step (engine/warmup.py)
@triton.jit(do_not_specialize=["sbt", "spo_r", "spo_h", "spl_r", "spl_h", "NUM_SPLITS"])
def _decode_split_kernel(q_ptr, sq_r, sq_h, qo_ptr, sqo_r, sqo_h, cache_ptr, sc_b, sc_h,
                         bt_ptr, sbt, seqlen_ptr, qsl_ptr, qpos_ptr, lut_ptr, po_ptr, spo_r, spo_h,
                         spo_s, plse_ptr, spl_r, spl_h, scale, softcap, window, kfac, vfac,
                         HAS_QSL: tl.constexpr, HAS_QPOS: tl.constexpr, HAS_WINDOW: tl.constexpr,
                         HAS_SOFTCAP: tl.constexpr, GROUP: tl.constexpr, HK: tl.constexpr,
                         K0_ASM: tl.constexpr, K0_KASM: tl.constexpr, K1_ASM: tl.constexpr,
                         K1_KASM: tl.constexpr, V_ASM: tl.constexpr, V_VASM: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS,
                         FP8_NATIVE: tl.constexpr, L: tl.constexpr, K0: tl.constexpr,
                         K1: tl.constexpr, V0: tl.constexpr, V1: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    rb = tl.program_id(2)
    b = pid // HK
    kvh = pid % HK

    if HAS_QSL:
        r0 = tl.load(qsl_ptr + b)
        q_len = tl.load(qsl_ptr + b + 1) - r0
    else:
        r0 = b
        q_len = 1
    if rb * BLOCK_M < q_len * GROUP:
        seq_len = tl.load(seqlen_ptr + b)
        if HAS_QPOS:
            pos0 = tl.load(qpos_ptr + b)
        else:
            pos0 = seq_len - q_len

        m_idx = rb * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = m_idx < q_len * GROUP
        ri = m_idx // GROUP
        head = kvh * GROUP + m_idx % GROUP
        pos = pos0 + ri
        hi = tl.minimum(pos + 1, seq_len)
        if HAS_WINDOW:
            lo = tl.maximum(pos - window + 1, 0)
        else:
            lo = tl.zeros_like(pos)
        # key range of the whole row block: rows are consecutive positions
        i_first = (rb * BLOCK_M) // GROUP
        i_last = tl.minimum(q_len - 1, ((rb + 1) * BLOCK_M - 1) // GROUP)
        range_hi = tl.minimum(pos0 + i_last + 1, seq_len)
        if HAS_WINDOW:
            range_lo = tl.maximum(pos0 + i_first - window + 1, 0)
        else:
            range_lo = 0
        start = (range_lo // BLOCK_N) * BLOCK_N
        n_tiles = tl.maximum(tl.cdiv(range_hi - start, BLOCK_N), 0)
        per_split = tl.cdiv(n_tiles, NUM_SPLITS)
        t0 = split * per_split
        t1 = tl.minimum(t0 + per_split, n_tiles)

        q_rows = ((r0 + ri) * sq_r + head * sq_h).to(tl.int64)
        qo_rows = ((r0 + ri) * sqo_r + head * sqo_h).to(tl.int64)
        qa0, qa1, qa2, qa3, qa4, qa5, qa6, qa7 = _q_phases(q_ptr, q_rows, row_ok, K0.g, K0.gp,
                                                           K0.cpw, K0.start)
        if L.has_k1:
            qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7 = _q_phases(q_ptr, q_rows, row_ok, K1.g,
                                                               K1.gp, K1.cpw, K1.start)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        zacc = tl.zeros([BLOCK_M], tl.float32)
        # one accumulator per code of a value word (a: field 0, b: field 1 of fractional widths)
        # (shapes take constexprs: a dataclass attribute is a plain int)
        V0_GP: tl.constexpr = V0.gp
        V1_GP: tl.constexpr = V1.gp
        aa0 = tl.zeros([BLOCK_M, V0_GP], tl.float32)
        aa1, aa2, aa3, aa4, aa5, aa6, aa7 = aa0, aa0, aa0, aa0, aa0, aa0, aa0
        ab0 = tl.zeros([BLOCK_M, V1_GP], tl.float32)
        ab1, ab2, ab3, ab4, ab5, ab6, ab7 = ab0, ab0, ab0, ab0, ab0, ab0, ab0
        gk0 = tl.arange(0, K0.gp)[None, :] < K0.g
        gk1 = tl.arange(0, K1.gp)[None, :] < K1.g
        gv0 = tl.arange(0, V0.gp)[None, :] < V0.g
        gv1 = tl.arange(0, V1.gp)[None, :] < V1.g
        bt_row = bt_ptr + b.to(tl.int64) * sbt
        kvh_off = kvh.to(tl.int64) * sc_h
        qk_scale = scale * 1.4426950408889634
        ar = tl.arange(0, BLOCK_N)

        # software pipeline: the bytes of tile t+1 are in flight while tile t is computed
        ka, kb, kc, kd, ke, kf, va, vb, vc, vd, ve, vf, n1, n2, n3 = _load_tile(
            cache_ptr, bt_row, start + t0 * BLOCK_N, tl.where(t0 < t1, range_hi, 0), sc_b,
            kvh_off, BLOCK_N, K0_ASM, K1_ASM, V_ASM, L, K0, K1, V0, V1)
        for t in range(t0, t1):
            tok = start + t * BLOCK_N + ar
            ok = tok < range_hi
            (ka_n, kb_n, kc_n, kd_n, ke_n, kf_n, va_n, vb_n, vc_n, vd_n, ve_n, vf_n, n1_n,
             n2_n, n3_n) = _load_tile(
                cache_ptr, bt_row, start + (t + 1) * BLOCK_N, tl.where(t + 1 < t1, range_hi, 0),
                sc_b, kvh_off, BLOCK_N, K0_ASM, K1_ASM, V_ASM, L, K0, K1, V0, V1)

            s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            if K0_ASM:
                s = _key_field_lut3(ka, kb, kc, qa0, qa1, qa2, qa3, qa4, qa5, qa6, qa7, s,
                                    K0_KASM)
            else:
                s = _key_field(_words(ka, kb, kc, K0.w), qa0, qa1, qa2, qa3, qa4, qa5, qa6, qa7,
                               s, lut_ptr, ok[:, None] & gk0, L.k_fp8, FP8_NATIVE, K0.bits,
                               K0.cpw, K0.w, K0.lut)
            if L.has_k1:
                if K1_ASM:
                    s = _key_field_lut3(kd, ke, kf, qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7, s,
                                        K1_KASM)
                else:
                    s = _key_field(_words(kd, ke, kf, K1.w), qb0, qb1, qb2, qb3, qb4, qb5, qb6,
                                   qb7, s, lut_ptr, ok[:, None] & gk1, L.k_fp8, FP8_NATIVE,
                                   K1.bits, K1.cpw, K1.w, K1.lut)
            if L.k_fp8:
                s = s * qk_scale
            else:
                fk = n1.to(tl.float32)  # "nc" is folded into the stored norm
                if L.k_corr == 2:
                    fk = fk * kfac
                if L.k_nout > 0:
                    s = (s * fk[None, :] + _outlier_scores(
                        qo_ptr, qo_rows, row_ok, cache_ptr, bt_row, tok, ok, sc_b, kvh_off, L.bs,
                        L.d, L.koi_off, L.kov_off, L.k_nout)) * qk_scale
                else:
                    s = s * (fk * qk_scale)[None, :]
            if HAS_SOFTCAP:
                # cap·tanh(x/cap) on natural-log scores, written with exp (no tanh in tl)
                x = s * (1.0 / (1.4426950408889634 * softcap))
                s = (softcap * 1.4426950408889634) * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))
            vis = ((tok[None, :] >= lo[:, None]) & (tok[None, :] < hi[:, None])
                   & row_ok[:, None])
            s = tl.where(vis, s, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new

            if V_ASM == 1:
                va0, va1 = _value_tiles_u4(va)
                va2, va3, va4, va5, va6, va7 = va0, va0, va0, va0, va0, va0
            elif V_ASM == 3:
                va0, va1, va2, va3, va4, va5, va6, va7 = _value_tiles_lut3(va, vb, vc, V_VASM)
            else:
                va0, va1, va2, va3, va4, va5, va6, va7 = _value_tiles(
                    _words(va, vb, vc, V0.w), lut_ptr, ok[:, None] & gv0, L.v_tq, V0.bits, V0.cpw,
                    V0.w, V0.lut)
            if L.has_v1:
                vb0, vb1, vb2, vb3, vb4, vb5, vb6, vb7 = _value_tiles(
                    _words(vd, ve, vf, V1.w), lut_ptr, ok[:, None] & gv1, L.v_tq, V1.bits, V1.cpw,
                    V1.w, V1.lut)
            fv = n2.to(tl.float32)  # "nc" is folded into the stored norm
            if L.v_tq and L.v_corr == 2:
                fv = fv * vfac
            pv = (p * fv[None, :]).to(tl.float16)
            if not L.v_tq:
                zacc = zacc * alpha + tl.sum(p * n3.to(tl.float32)[None, :], axis=1)
            aa0 = _pv(aa0, alpha, pv, va0)
            if V0.cpw > 1:
                aa1 = _pv(aa1, alpha, pv, va1)
            if V0.cpw > 2:
                aa2 = _pv(aa2, alpha, pv, va2)
                aa3 = _pv(aa3, alpha, pv, va3)
            if V0.cpw > 4:
                aa4 = _pv(aa4, alpha, pv, va4)
                aa5 = _pv(aa5, alpha, pv, va5)
                aa6 = _pv(aa6, alpha, pv, va6)
                aa7 = _pv(aa7, alpha, pv, va7)
            if L.has_v1:
                ab0 = _pv(ab0, alpha, pv, vb0)
                if V1.cpw > 1:
                    ab1 = _pv(ab1, alpha, pv, vb1)
                if V1.cpw > 2:
                    ab2 = _pv(ab2, alpha, pv, vb2)
                    ab3 = _pv(ab3, alpha, pv, vb3)
                if V1.cpw > 4:
                    ab4 = _pv(ab4, alpha, pv, vb4)
                    ab5 = _pv(ab5, alpha, pv, vb5)
                    ab6 = _pv(ab6, alpha, pv, vb6)
                    ab7 = _pv(ab7, alpha, pv, vb7)
            ka, kb, kc, kd, ke, kf = ka_n, kb_n, kc_n, kd_n, ke_n, kf_n
            va, vb, vc, vd, ve, vf = va_n, vb_n, vc_n, vd_n, ve_n, vf_n
            n1, n2, n3 = n1_n, n2_n, n3_n

        has = l_i > 0.0
        inv = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
        lse = tl.where(has, m_i * 0.6931471805599453 + tl.log(tl.where(has, l_i, 1.0)),
                       float("-inf"))
        po_rows = ((r0 + ri) * spo_r + head * spo_h + split * spo_s).to(tl.int64)
        z = zacc * inv  # uniform values: Σ p·zero (0 for rotated values)
        _store_field(po_ptr, po_rows, row_ok, inv, z, aa0, aa1, aa2, aa3, aa4, aa5, aa6, aa7,
                     V0.g, V0.gp, V0.cpw, V0.start)
        if L.has_v1:
            _store_field(po_ptr, po_rows, row_ok, inv, z, ab0, ab1, ab2, ab3, ab4, ab5, ab6, ab7,
                         V1.g, V1.gp, V1.cpw, V1.start)
        tl.store(plse_ptr + (r0 + ri) * spl_r + head * spl_h + split, lse, mask=row_ok)


@triton.jit(do_not_specialize=["spo_r", "spo_h", "spl_r", "spl_h", "S"])
def _merge_kernel(po_ptr, spo_r, spo_h, spo_s, plse_ptr, spl_r, spl_h, out_ptr, so_r, so_h,
                  lse_ptr, sl_r, S, SP: tl.constexpr,
                  D: tl.constexpr, DP: tl.constexpr, WRITE_LSE: tl.constexpr):
    row = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SP)
    d = tl.arange(0, DP)
    lse = tl.load(plse_ptr + row * spl_r + h * spl_h + s, mask=s < S, other=float("-inf"))
    mx = tl.max(lse, axis=0)
    mx_use = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp(lse - mx_use)
    tot = tl.sum(w, axis=0)
    part = tl.load(po_ptr + row.to(tl.int64) * spo_r + h * spo_h + s[:, None] * spo_s + d[None, :],
                   mask=(s < S)[:, None] & (d < D)[None, :] & (w > 0.0)[:, None], other=0.0)
    o = tl.sum(part * w[:, None], axis=0) / tl.where(tot > 0.0, tot, 1.0)
    tl.store(out_ptr + row.to(tl.int64) * so_r + h * so_h + d, o.to(out_ptr.dtype.element_ty),
             mask=d < D)
    if WRITE_LSE:
        tl.store(lse_ptr + row * sl_r + h,
                 tl.where(tot > 0.0, mx_use + tl.log(tl.where(tot > 0.0, tot, 1.0)), float("-inf")))


# Programs per SM the split count aims at (several waves of short programs hide the tail).
TARGET_PROGRAMS = 8
# Most splits of the portable kernel; the merge is built for this many (masked), so every split
# count runs one merge build
MAX_SPLITS = 64


def launch_config(spec, interp: bool) -> tuple[int, int, dict]:
    """(BLOCK_N, num_warps, asm constexprs) of the portable kernel for a layout, per path: 3-bit
    keys through inline asm at 64 tokens / 2 warps (~235 registers: 4 programs per SM; 32 with
    outliers, whose gathers spill at 64), asm values with byte-wise keys at 32 tokens / 1 warp,
    the byte-wise paths at 4 warps and the largest tile that does not spill (_block_n). The
    kernel runs with num_stages=1: triton's pipelining routes the centroid gathers through
    shared memory and is several times slower."""
    asm = _asm_meta(spec, not interp)
    if asm["K0_ASM"]:
        return (32 if spec.layout.k_nout else 64), 2, asm
    if asm["V_ASM"]:
        return 32, 1, asm
    return _block_n(spec), 4, asm


def _asm_meta(spec, on: bool) -> dict:
    """Which fields take the inline-asm conversions (kernels/_asm.py; never under the
    interpreter): 3-bit key fields and single-field 3-bit values (tq centroids or uniform codes),
    both column-major words, and 4-bit uniform values whose token rows are whole int32 words.
    Cached on the spec:
    the asm texts are built once, not on every call."""
    if on not in spec.asm_meta:
        spec.asm_meta[on] = _build_asm_meta(spec, on)
    return spec.asm_meta[on]


def _build_asm_meta(spec, on: bool) -> dict:
    meta = {}
    keys = spec.key_fields + [None] * (2 - len(spec.key_fields))
    for i, f in enumerate(keys):
        lut3 = on and f is not None and f.cm and f.lut >= 0
        meta[f"K{i}_ASM"] = lut3
        meta[f"K{i}_KASM"] = _asm.lut3(spec.table[f.lut:f.lut + 8]) if lut3 else ""
    v = spec.value_fields
    one = on and len(v) == 1 and v[0].g % 4 == 0      # whole int32 words per token row
    meta["V_ASM"], meta["V_VASM"] = 0, ""
    if one and not spec.layout.v_tq and v[0].bits == 4 and v[0].w == 1:
        meta["V_ASM"] = 1                               # two 4-bit codes per byte
    elif one and v[0].bits == 3 and v[0].w == 3 and v[0].cm:
        meta["V_ASM"] = 3                               # centroids, or uniform codes 0..7
        table = spec.table[v[0].lut:v[0].lut + 8] if spec.layout.v_tq else range(8)
        meta["V_VASM"] = _asm.lut3(table)
    return meta


def _block_n(spec) -> int:
    """Largest tile that keeps the tile registers from spilling (ptxas reports, sm_90, 4 warps):
    a rough count of the per-token columns the loop keeps live."""
    kf, vf = spec.key_fields, spec.value_fields
    v_tq = spec.layout.v_tq
    cost = (sum(f.dp for f in kf) + sum(f.dp for f in vf) * (2 if v_tq else 1)
            + 16 * sum(f.cpw for f in vf))
    return 128 if cost <= 300 else 64 if cost <= 420 else 32


def _decode_mma(spec, q, kv_cache, block_table, seq_lens, scale, group, num_splits, out,
                return_lse, new_kv):
    """The tensor-core path (kernels/decode_mma.py): one launch that rotates the query, stores
    ``new_kv`` (if any) and merges the splits into ``out`` (and the LSE)."""
    from . import decode_mma  # imports only with Gluon: step.tensor_cores checked it

    rows, hq, d = q.shape
    batch, hk = seq_lens.numel(), kv_cache.shape[1]
    if new_kv is not None:
        new_kv = tuple(x if x.stride(-1) == 1 else x.contiguous() for x in new_kv[:2]) + (
            new_kv[2],)
    if num_splits is None:
        per_sm = decode_mma.programs_per_sm(spec, q, kv_cache, block_table, seq_lens, group,
                                            new_kv)
        num_splits = decode_mma.num_splits(per_sm * num_sms(q.device), batch * hk, d)
    part = torch.empty(rows, hq, num_splits, d, dtype=torch.float32, device=q.device)
    plse = torch.empty(rows, hq, num_splits, dtype=torch.float32, device=q.device)
    if out is None:
        out = torch.empty(rows, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(rows, hq, dtype=torch.float32, device=q.device) if return_lse else None
    decode_mma.launch(spec, q, kv_cache, block_table, seq_lens, part, plse, out, lse, group,
                      num_splits, scale, new_kv)
    return (out, lse) if return_lse else out


def decode_attention_triton(codec: TQCodec, q: torch.Tensor, kv_cache: torch.Tensor,
                            block_table: torch.Tensor, seq_lens: torch.Tensor,
                            query_start_loc: torch.Tensor | None = None,
                            query_pos_start: torch.Tensor | None = None,
                            scale: float | None = None, window: int | None = None,
                            softcap: float = 0.0, return_lse: bool = False,
                            max_query_len: int | None = None, num_splits: int | None = None,
                            out: torch.Tensor | None = None, new_kv: tuple | None = None):
    """Triton decode attention; arguments and row semantics as decode_attention_ref.

    ``new_kv`` = (key, value, slot_mapping): the step's new K/V (one token per sequence, at
    position seq_len − 1), stored before they are read (as
    :func:`tqattn.kernels.store.store_kv_triton`): by the tensor-core decode kernel itself, else
    by the store kernel first (:func:`tqattn.kernels.step.decode_kernel_store`).

    ``max_query_len`` (rows per sequence, 1 without ``query_start_loc``) fixes the grid; when
    omitted with ``query_start_loc`` it is read from the device (a host sync — pass it under CUDA
    graphs). ``num_splits`` overrides the split count (default: one wave of the tensor-core
    kernel's resident programs; the portable kernel's programs fill the GPU TARGET_PROGRAMS
    times over).
    """
    bs = cache_block_size(codec, kv_cache)
    rows, hq, d = q.shape
    nb, hk, _ = kv_cache.shape
    if d != codec.head_dim or hq % hk:
        raise ValueError(f"q shape {tuple(q.shape)} does not fit {hk} KV heads at head size "
                         f"{codec.head_dim}")
    check_float("q", q)
    check_decode_args(rows, block_table, seq_lens, query_start_loc, window)
    if new_kv is not None:
        check_float("new key", new_kv[0])
        check_float("new value", new_kv[1])
        check_index("slot_mapping", new_kv[2], min_len=new_kv[0].shape[0])
    spec = kernel_spec(codec, bs)
    if seq_lens.shape[0] == 0:  # no sequence: rows see no key (0, LSE -inf), nothing to store
        out = torch.zeros(rows, hq, d, dtype=q.dtype, device=q.device) if out is None else out.zero_()
        lse = torch.full((rows, hq), float("-inf"), device=q.device)
        return (out, lse) if return_lse else out
    if q.stride(-1) != 1:
        q = q.contiguous()
    group = hq // hk
    batch = seq_lens.numel()
    if query_start_loc is None:
        max_query_len = 1
    elif max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    max_query_len = max(1, int(max_query_len))
    block_m = max(16, min(64, next_pow2(max_query_len * group)))
    row_blocks = triton.cdiv(max_query_len * group, block_m)
    plain = step.plain(query_start_loc, query_pos_start, window, softcap)
    mma = step.tensor_core_decode(spec, q, hk, plain)
    if new_kv is not None and step.store_site(spec, mma) == step.STORE_KERNEL:
        store.store_kv_triton(codec, new_kv[0], new_kv[1], kv_cache, new_kv[2])
        new_kv = None
    if mma:
        return _decode_mma(spec, q, kv_cache, block_table, seq_lens, default_scale(codec, scale),
                           group, num_splits, out, return_lse, new_kv)
    interp = interpreted(q.device)
    block_n, num_warps, asm = launch_config(spec, interp)
    lut, rot = spec.tables_on(q.device)
    qk = q if spec.layout.k_fp8 else (q.reshape(rows * hq, d).float() @ rot).reshape(rows, hq, d)
    if num_splits is None:
        num_splits = max(1, min(MAX_SPLITS, triton.cdiv(TARGET_PROGRAMS * num_sms(q.device),
                                                        batch * hk * row_blocks)))
    elif not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits={num_splits}: the portable kernel merges 1..{MAX_SPLITS}")
    part = torch.empty(rows, hq, num_splits, d, dtype=torch.float32, device=q.device)
    plse = torch.empty(rows, hq, num_splits, dtype=torch.float32, device=q.device)
    dummy = seq_lens
    qsl = query_start_loc if query_start_loc is not None else dummy
    qpos = query_pos_start if query_pos_start is not None else dummy
    grid = (batch * hk, num_splits, row_blocks)
    _decode_split_kernel[grid](
        qk, qk.stride(0), qk.stride(1), q, q.stride(0), q.stride(1), kv_cache,
        kv_cache.stride(0), kv_cache.stride(1),
        block_table, block_table.stride(0), seq_lens, qsl, qpos, lut,
        part, part.stride(0), part.stride(1), part.stride(2), plse, plse.stride(0),
        plse.stride(1),
        default_scale(codec, scale), float(softcap or 0.0), int(window or 0),
        spec.kfac, spec.vfac,
        HAS_QSL=query_start_loc is not None, HAS_QPOS=query_pos_start is not None,
        HAS_WINDOW=bool(window), HAS_SOFTCAP=bool(softcap), GROUP=group, HK=hk,
        BLOCK_M=block_m, BLOCK_N=block_n, NUM_SPLITS=num_splits, **asm,
        FP8_NATIVE=not interp, num_warps=num_warps, num_stages=1, **spec.constexprs)

    v_rot = spec.layout.v_tq
    if out is None:
        out = torch.empty(rows, hq, d, dtype=q.dtype, device=q.device)
    dst = torch.empty(rows, hq, d, dtype=torch.float32, device=q.device) if v_rot else out
    lse = torch.empty(rows, hq, dtype=torch.float32, device=q.device) if return_lse else plse
    _merge_kernel[(rows, hq)](
        part, part.stride(0), part.stride(1), part.stride(2), plse, plse.stride(0),
        plse.stride(1), dst, dst.stride(0), dst.stride(1), lse, lse.stride(0) if return_lse else 0,
        S=num_splits, SP=MAX_SPLITS, D=d, DP=next_pow2(d),
        WRITE_LSE=return_lse, num_warps=4)
    if v_rot:
        out.copy_((dst.view(rows * hq, d) @ rot.T).view(rows, hq, d))
    return (out, lse) if return_lse else out
