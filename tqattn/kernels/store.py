"""Store kernel: quantize new K/V and write them into the paged TurboQuant cache (Triton).

Math = :func:`tqattn.quant.paged.store_ref` (= ``TQCodec.encode`` with ``on_nonfinite=
"propagate", fold_nc=True)`` + the page layout). One program per ``HB`` consecutive (token, KV
head) rows of the step's flattened ``N·Hk`` rows and role (keys / values: two programs per row
block run in parallel), one launch per layer per step, no host sync. The rotation
is an fp32-accurate ``tl.dot`` inside the kernel (K-chunked): on the GPU three TF32 tensor-core
dots on a hi/lo split of both operands ("tf32x3", ~2^-22 relative error); IEEE fp32 dots on the
FMA units under the interpreter. Division and square root use IEEE rounding, so codes match the
reference except where the different summation order / the dropped lo·lo term moves a value
across a bucket boundary (rare, bounded in the tests). Outlier-split keys: the m largest-|k|
channels are picked by m arg-max passes (ties → the lower channel, as the reference's stable
sort); the rotation of k − Σ o_c e_c is the rotation of k minus Σ o_c R[c, :] (rows gathered
after the dots, so nothing sits between the load and the TF32 split).

At decode sizes a step's time includes the store's slowest program (a key program: the decode
launches when it ends), so that program's latency chain is kept short: the table scalars and
the rotation (one chunk) are loaded first, next to the rows, the three TF32 dots accumulate
in separate chains, and a key row block's coordinates may be split over several programs
(auto_key_splits). Launch sizes are module constants (ROWS_PER_PROGRAM, DECODE_*); how they
were chosen: bench/results/README.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant.codec import TQCodec
from ..quant.paged import cache_block_size
from . import _tl
from ._args import check_float, check_index
from ._spec import interpreted, kernel_spec, num_sms


@triton.jit
def _fp8_e4m3(x):
    """fp32 → e4m3fn byte, round-to-nearest-even, ±448 saturation, non-finite → 0x7F."""
    fin = (x == x) & (tl.abs(x) != float("inf"))
    xc = tl.minimum(tl.maximum(x, -448.0), 448.0)
    sign = (xc.to(tl.int32, bitcast=True) >> 31) & 1
    ab = tl.abs(xc).to(tl.int32, bitcast=True)
    e = (ab >> 23) - 127
    m23 = ab & 0x7FFFFF
    q = m23 >> 20
    rem = m23 & 0xFFFFF
    up = ((rem > 0x80000) | ((rem == 0x80000) & ((q & 1) == 1))).to(tl.int32)
    normal = ((e + 7) << 3) + q + up
    # below 2^-6: multiples of 2^-9, rounded to nearest even from the integer mantissa
    sh = tl.minimum(14 - e, 31)
    mant = m23 | 0x800000
    k = mant >> sh
    r2 = mant & ((1 << sh) - 1)
    half = 1 << (sh - 1)
    sub = k + ((r2 > half) | ((r2 == half) & ((k & 1) == 1))).to(tl.int32)
    r = tl.where(e < -6, sub, normal) | (sign << 7)
    return tl.where(fin, r, 0x7F)


@triton.jit
def _store_codes(code, cache_ptr, base, off, h_ok, HB: tl.constexpr, BS: tl.constexpr,
                 OFF: tl.constexpr, BITS: tl.constexpr, W: tl.constexpr, G: tl.constexpr,
                 GP: tl.constexpr, CPW: tl.constexpr, CM: tl.constexpr, g0=0, NG: tl.constexpr = 0):
    """Pack codes [HB, GP·CPW] (natural coordinate order) into the field's page plane; with
    NG > 0, codes of the field's words [g0, g0 + NG) only (a key split's part)."""
    if CPW == 1:
        word = code
    else:
        c = tl.reshape(code, (HB, GP, CPW))
        i = tl.arange(0, CPW)[None, None, :]
        if W == 3:  # page bit order (tqattn.quant.paged): codes 0-5 in nibbles, 6-7 bit-spread
            spread = (c & 1) | ((c & 2) << 7) | ((c & 4) << 14)
            bits = tl.where(i < 6, c << (4 * i), spread << tl.maximum(4 * i - 21, 0))
        else:
            bits = c << (i * BITS)
        word = tl.sum(bits, axis=2)
    g = tl.arange(0, GP)[None, :]
    if NG > 0:
        m = h_ok[:, None] & (g < NG)
        g = g + g0
    else:
        m = h_ok[:, None] & (g < G)
    ptr = _tl.row_ptr(cache_ptr, base, off, OFF, G, CM) + (g * BS if CM else g)
    for s in tl.static_range(W):
        tl.store(ptr + s * BS * G, ((word >> (8 * s)) & 255).to(tl.uint8), mask=m)


@triton.jit
def _scalar(ptr, i: tl.constexpr, N: tl.constexpr):
    if i < N:
        v = tl.load(ptr + i)
    else:
        v = 0.0
    return v


@triton.jit
def _table16(ptr, N: tl.constexpr):
    """The first N (<= 16) fp32 scalars at ptr as a 16-tuple (the rest 0.0), loaded where this
    is called: at the start of a program, so the loads overlap its first memory round trip
    instead of adding their own in the middle of its latency chain (a load written at its use
    is issued there, after the rotation)."""
    tl.static_assert(N <= 16, "a code field of more than 4 bits")
    return (_scalar(ptr, 0, N), _scalar(ptr, 1, N), _scalar(ptr, 2, N), _scalar(ptr, 3, N),
            _scalar(ptr, 4, N), _scalar(ptr, 5, N), _scalar(ptr, 6, N), _scalar(ptr, 7, N),
            _scalar(ptr, 8, N), _scalar(ptr, 9, N), _scalar(ptr, 10, N), _scalar(ptr, 11, N),
            _scalar(ptr, 12, N), _scalar(ptr, 13, N), _scalar(ptr, 14, N),
            _scalar(ptr, 15, N))


@triton.jit
def _centroid_ss(code, cen, BITS: tl.constexpr, COUNT: tl.constexpr):
    """Σĉ² [HB] in fp64 over the first COUNT columns (exact up to the last bits: the folded
    norm's fp16 rounding then matches the reference whatever the summation order). Centroids
    by selects from the table's scalars (cen: :func:`_table16`)."""
    j = tl.arange(0, code.shape[1])[None, :]
    c = tl.zeros(code.shape, tl.float32)
    for i in tl.static_range(1 << BITS):
        c = tl.where(code == i, cen[i], c)
    c = tl.where(j < COUNT, c, 0.0).to(tl.float64)
    return tl.sum(c * c, axis=1)


@triton.jit
def _split_outliers(x, h_ok, cache_ptr, base, off, D: tl.constexpr, DP: tl.constexpr,
                    HB: tl.constexpr, IDX_OFF: tl.constexpr, VAL_OFF: tl.constexpr,
                    NOUT: tl.constexpr, NOUTP: tl.constexpr):
    """Pick and store the NOUT largest-|x| channels of rows x [HB, DP] (bad rows zeroed) as
    (channel byte, e4m3 byte); return their channels [HB, NOUTP] int32 and e4m3 values fp32."""
    d = tl.arange(0, DP)[None, :]
    j = tl.arange(0, NOUTP)[None, :]
    a = tl.where(d < D, tl.abs(x), -1.0)
    idx = tl.zeros([HB, NOUTP], tl.int32)
    byte = tl.zeros([HB, NOUTP], tl.int32)
    for i in tl.static_range(NOUT):
        c = tl.argmax(a, axis=1, tie_break_left=True).to(tl.int32)
        sel = d == c[:, None]
        b8 = _fp8_e4m3(tl.sum(tl.where(sel, x, 0.0), axis=1))
        idx = tl.where(j == i, c[:, None], idx)
        byte = tl.where(j == i, b8[:, None], byte)
        a = tl.where(sel, -1.0, a)
    at = (base + off * NOUT)[:, None] + j
    m = h_ok[:, None] & (j < NOUT)
    tl.store(cache_ptr + IDX_OFF + at, idx.to(tl.uint8), mask=m)
    tl.store(cache_ptr + VAL_OFF + at, byte.to(tl.uint8), mask=m)
    return idx, tl.where(j < NOUT, _tl.fp8_e4m3_value(byte), 0.0)


@triton.jit
def _outlier_rows(oidx, oval, rot_ptr, D: tl.constexpr, START: tl.constexpr,
                  COUNT: tl.constexpr, FDP: tl.constexpr):
    """Σ_c o_c · R[c, START + j] for j < COUNT: [HB, FDP] fp32 (the outliers' rotation)."""
    j = tl.arange(0, FDP)[None, None, :]
    r = tl.load(rot_ptr + oidx[:, :, None] * D + START + j, mask=j < COUNT, other=0.0)
    return tl.sum(oval[:, :, None] * r, axis=1)


@triton.jit
def _rot_chunk(rot_ptr, k0, D: tl.constexpr, BK: tl.constexpr, START: tl.constexpr,
               COUNT: tl.constexpr, FDP: tl.constexpr):
    """Rows [k0, k0+BK) of R's columns [START, START+COUNT): [BK, FDP] fp32."""
    kk = k0 + tl.arange(0, BK)
    j = tl.arange(0, FDP)
    return tl.load(rot_ptr + kk[:, None] * D + START + j[None, :],
                   mask=(kk < D)[:, None] & (j < COUNT)[None, :], other=0.0)


@triton.jit
def _rotate(x_ptr, rows, ld_ok, bad, den, rot_ptr, corr, r_all, D: tl.constexpr,
            DP: tl.constexpr, BK: tl.constexpr, HB: tl.constexpr, START: tl.constexpr,
            COUNT: tl.constexpr, FDP: tl.constexpr, TF32X3: tl.constexpr,
            HAS_CORR: tl.constexpr, PRELOADED: tl.constexpr, UNIT: tl.constexpr = True):
    """Rotated unit vectors restricted to coordinates [START, START+COUNT): [HB, FDP] fp32;
    with HAS_CORR, of x minus the vectors whose rotation is ``corr`` (outlier channels).
    PRELOADED: ``r_all`` is the whole column block (BK = DP, loaded by the caller). UNIT=False
    (TF32X3 only): the rotated vectors, not divided by ``den``."""
    y = tl.zeros([HB, FDP], tl.float32)
    for k0 in tl.static_range(0, DP, BK):
        kk = k0 + tl.arange(0, BK)
        if PRELOADED:
            r = r_all
        else:
            r = _rot_chunk(rot_ptr, k0, D, BK, START, COUNT, FDP)
        if TF32X3:
            # fp32 accuracy on the tensor cores: x·r ≈ x_hi·r_hi + x_hi·r_lo + x_lo·r_hi with
            # v_hi = v truncated to TF32's 10 mantissa bits (exact in a TF32 dot) and
            # v_lo = v − v_hi; the dropped x_lo·r_lo is ~2^-22 of the product. (Triton 3.6's own
            # "tf32x3" fails to compile here, and so does any select or division between the
            # load and the split: bad rows are masked at the load and the division by the norm
            # follows the dots.)
            xk = tl.load(x_ptr + rows[:, None] + kk[None, :],
                         mask=(ld_ok & (bad == 0))[:, None] & (kk < D)[None, :],
                         other=0.0).to(tl.float32)
            xh, xl = _tf32_split(xk)
            rh, rl = _tf32_split(r)
            # three independent accumulation chains, not one three times as long: the
            # (always true) selects keep the compiler from folding the sum back into one
            # dot's accumulator
            live = (den > 0.0)[:, None]
            y = (tl.dot(xh, rh, y, input_precision="tf32")
                 + tl.where(live, tl.dot(xl, rh, input_precision="tf32"), 0.0)
                 + tl.where(live, tl.dot(xh, rl, input_precision="tf32"), 0.0))
        else:  # IEEE fp32 on the FMA units (the interpreter's path: it has no TF32)
            xk = tl.load(x_ptr + rows[:, None] + kk[None, :],
                         mask=ld_ok[:, None] & (kk < D)[None, :], other=0.0).to(tl.float32)
            uk = tl.math.div_rn(tl.where(bad[:, None], 0.0, xk), den[:, None])
            y += tl.dot(uk, r, input_precision="ieee")
    if TF32X3:
        if HAS_CORR:
            y = y - corr
        if UNIT:
            y = tl.math.div_rn(y, den[:, None])
    elif HAS_CORR:
        y = y - tl.math.div_rn(corr, den[:, None])
    return y


@triton.jit
def _tf32_split(x):
    hi = (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)  # 13 low bits off
    return hi, x - hi


@triton.jit
def _bucketize(y, bnd, BITS: tl.constexpr, SM: tl.constexpr = False):
    """Lloyd–Max codes of y against the boundaries bnd (:func:`_table16`); SM: in
    sign-and-magnitude order (tqattn.quant.codec.sign_magnitude)."""
    code = tl.zeros(y.shape, tl.int32)
    for i in tl.static_range((1 << BITS) - 1):
        code += (y > bnd[i]).to(tl.int32)
    if SM:
        code = code ^ tl.where(code < 8, 7, 0)
    return code


@triton.jit
def _row_stats(x_ptr, rows, ld_ok, D: tl.constexpr, DP: tl.constexpr):
    """(row is non-finite [HB], x with bad rows zeroed [HB, DP], mask [HB, DP])."""
    d = tl.arange(0, DP)
    m = ld_ok[:, None] & (d < D)[None, :]
    x = tl.load(x_ptr + rows[:, None] + d[None, :], mask=m, other=0.0).to(tl.float32)
    nonfin = (x != x) | (tl.abs(x) == float("inf"))
    bad = tl.max(nonfin.to(tl.int32), axis=1) > 0
    return bad, tl.where(bad[:, None], 0.0, x), m


@triton.jit
def _head_rows(ptr, hrow, D: tl.constexpr, START: tl.constexpr, COUNT: tl.constexpr,
               FDP: tl.constexpr):
    """Coordinates [START, START+COUNT) of each row's head's row of an fp32 (Hk, D) table (the
    key offset μ or its rotation μR): [HB, FDP]. Callers issue these loads first, so that they
    overlap the rows' loads and reductions."""
    j = tl.arange(0, FDP)[None, :]
    return tl.load(ptr + hrow[:, None] * D + START + j, mask=j < COUNT, other=0.0)


@triton.jit
def _encode_unit(x_ptr, rows, ld_ok, h_ok, cache_ptr, base, off, rot_ptr, tab_ptr,
                 D: tl.constexpr, DP: tl.constexpr, BK: tl.constexpr, HB: tl.constexpr,
                 TF32X3: tl.constexpr, BS: tl.constexpr, N_OFF: tl.constexpr, FOLD: tl.constexpr,
                 NOUT: tl.constexpr, NOUTP: tl.constexpr, OI_OFF: tl.constexpr,
                 OV_OFF: tl.constexpr, HAS_F1: tl.constexpr, F0: tl.constexpr, F1: tl.constexpr,
                 hrow=0, mu_ptr=0, mur_ptr=0, CENTER: tl.constexpr = False):
    """Norm + rotation + Lloyd–Max codes of x rows (the codec's _encode_unit), after taking
    NOUT outlier channels out (the codec's _split_outliers). CENTER: of x − μ[hrow] (key
    centering; the rotation of μ comes precomputed as ``mur_ptr``, as the outliers' does)."""
    # one rotation chunk (decode-size steps): R's loads are issued first, with the table's, so
    # they overlap the rows' loads and reductions
    PRE: tl.constexpr = BK == DP
    # centered on the tensor cores, one field: ‖x − μ‖ = ‖xR − μR‖ (R orthogonal) is taken
    # after the rotation, so μ itself is neither loaded nor subtracted
    RNORM: tl.constexpr = CENTER and TF32X3 and NOUT == 0 and not HAS_F1
    if PRE:
        r0 = _rot_chunk(rot_ptr, 0, D, BK, F0.start, F0.count, F0.gp * F0.cpw)
        if HAS_F1:
            r1 = _rot_chunk(rot_ptr, 0, D, BK, F1.start, F1.count, F1.gp * F1.cpw)
        else:
            r1 = r0
    else:
        r0 = 0.0
        r1 = 0.0
    if CENTER:  # μ, and μR of each field, 0 for bad rows (whose codes the NaN norm voids)
        if not RNORM:
            mu = _head_rows(mu_ptr, hrow, D, 0, D, DP)
        mur0 = _head_rows(mur_ptr, hrow, D, F0.start, F0.count, F0.gp * F0.cpw)
        if HAS_F1:
            mur1 = _head_rows(mur_ptr, hrow, D, F1.start, F1.count, F1.gp * F1.cpw)
    bnd0 = _table16(tab_ptr + F0.bnd, (1 << F0.bits) - 1)
    cen0 = _table16(tab_ptr + F0.lut, (1 << F0.bits) if FOLD else 0)
    bnd1 = _table16(tab_ptr + F1.bnd, (1 << F1.bits) - 1 if HAS_F1 else 0)
    cen1 = _table16(tab_ptr + F1.lut, (1 << F1.bits) if FOLD and HAS_F1 else 0)
    bad, x, _ = _row_stats(x_ptr, rows, ld_ok, D, DP)
    if CENTER and not RNORM:
        x = tl.where(bad[:, None], 0.0, x - mu)
    if NOUT > 0:
        oidx, oval = _split_outliers(x, h_ok, cache_ptr, base, off, D, DP, HB, OI_OFF, OV_OFF,
                                     NOUT, NOUTP)
        d = tl.arange(0, DP)[None, None, :]
        x = x - tl.sum(tl.where(d == oidx[:, :, None], oval[:, :, None], 0.0), axis=1)
        corr0 = _outlier_rows(oidx, oval, rot_ptr, D, F0.start, F0.count, F0.gp * F0.cpw)
    else:
        F0_DP: tl.constexpr = F0.gp * F0.cpw   # shapes take constexprs, not plain ints
        corr0 = tl.zeros([HB, F0_DP], tl.float32)
    if CENTER:
        corr0 += tl.where(bad[:, None], 0.0, mur0)
    if RNORM:
        one = tl.full([HB], 1.0, tl.float32)  # the rows' divisor, applied after the norm
        y = _rotate(x_ptr, rows, ld_ok, bad, one, rot_ptr, corr0, r0, D, DP, BK, HB, F0.start,
                    F0.count, F0.gp * F0.cpw, TF32X3, True, PRE, False)
        nrm = tl.math.sqrt_rn(tl.sum(y * y, axis=1))
        den = nrm + 1e-8
        y = tl.math.div_rn(y, den[:, None])
    else:
        nrm = tl.math.sqrt_rn(tl.sum(x * x, axis=1))
        den = nrm + 1e-8
        y = _rotate(x_ptr, rows, ld_ok, bad, den, rot_ptr, corr0, r0, D, DP, BK, HB, F0.start,
                    F0.count, F0.gp * F0.cpw, TF32X3, NOUT > 0 or CENTER, PRE)
    code = _bucketize(y, bnd0, F0.bits, F0.sm)
    _store_codes(code, cache_ptr, base, off, h_ok, HB, BS, F0.off, F0.bits, F0.w, F0.g, F0.gp,
                 F0.cpw, F0.cm)
    if FOLD:
        ss = _centroid_ss(code, cen0, F0.bits, F0.count)
    if HAS_F1:
        if NOUT > 0:
            corr1 = _outlier_rows(oidx, oval, rot_ptr, D, F1.start, F1.count, F1.gp * F1.cpw)
        else:
            F1_DP: tl.constexpr = F1.gp * F1.cpw
            corr1 = tl.zeros([HB, F1_DP], tl.float32)
        if CENTER:
            corr1 += tl.where(bad[:, None], 0.0, mur1)
        y1 = _rotate(x_ptr, rows, ld_ok, bad, den, rot_ptr, corr1, r1, D, DP, BK, HB, F1.start,
                     F1.count, F1.gp * F1.cpw, TF32X3, NOUT > 0 or CENTER, PRE)
        code1 = _bucketize(y1, bnd1, F1.bits, F1.sm)
        _store_codes(code1, cache_ptr, base, off, h_ok, HB, BS, F1.off, F1.bits, F1.w, F1.g,
                     F1.gp, F1.cpw, F1.cm)
        if FOLD:
            ss += _centroid_ss(code1, cen1, F1.bits, F1.count)
    if FOLD:  # "nc": the page stores n / ‖ĉ‖ (tqattn.quant.paged)
        nrm = (nrm.to(tl.float64) / tl.sqrt(ss)).to(tl.float32)  # fp64: IEEE div and sqrt
    _tl.store_fp16(cache_ptr, base, off, tl.where(bad, float("nan"), nrm), h_ok, N_OFF)


@triton.jit
def _encode_key_part(x_ptr, rows, r, ld_ok, h_ok, cache_ptr, base, off, rot_ptr,
                     tab_ptr, part, rb, ss_ptr, cnt_ptr, D: tl.constexpr, DP: tl.constexpr,
                     HB: tl.constexpr, TF32X3: tl.constexpr, BS: tl.constexpr, N_OFF: tl.constexpr,
                     FOLD: tl.constexpr, F: tl.constexpr, KS: tl.constexpr, hrow=0, mu_ptr=0,
                     mur_ptr=0, CENTER: tl.constexpr = False):
    """Part ``part`` of KS of a single-field key's encoding (no outliers): the rotated
    coordinates of words [part·G/KS, (part+1)·G/KS) of F and their codes. Every part computes the
    row norm; with FOLD the parts' Σĉ² meet in ``ss_ptr`` (fp64 atomics) and the last part of
    the row block to finish (``cnt_ptr``) writes the folded norm and resets both."""
    NG: tl.constexpr = F.g // KS
    PC: tl.constexpr = NG * F.cpw
    kk = tl.arange(0, DP)
    j = tl.arange(0, PC)
    rp = tl.load(rot_ptr + kk[:, None] * D + (F.start + part * PC) + j[None, :],
                 mask=(kk < D)[:, None], other=0.0)
    if CENTER:
        mu = _head_rows(mu_ptr, hrow, D, 0, D, DP)
        mur = _head_rows(mur_ptr, hrow, D, F.start + part * PC, PC, PC)
    bnd = _table16(tab_ptr + F.bnd, (1 << F.bits) - 1)
    cen = _table16(tab_ptr + F.lut, (1 << F.bits) if FOLD else 0)
    bad, x, _ = _row_stats(x_ptr, rows, ld_ok, D, DP)
    if CENTER:
        x = tl.where(bad[:, None], 0.0, x - mu)
        corr = tl.where(bad[:, None], 0.0, mur)
    else:
        corr = 0.0
    nrm = tl.math.sqrt_rn(tl.sum(x * x, axis=1))
    den = nrm + 1e-8
    y = _rotate(x_ptr, rows, ld_ok, bad, den, rot_ptr, corr, rp, D, DP, DP, HB, 0, PC, PC,
                TF32X3, CENTER, True)
    code = _bucketize(y, bnd, F.bits, F.sm)
    _store_codes(code, cache_ptr, base, off, h_ok, HB, BS, F.off, F.bits, F.w, F.g, NG, F.cpw, F.cm,
                 part * NG, NG)
    if FOLD:
        tl.atomic_add(ss_ptr + r, _centroid_ss(code, cen, F.bits, PC), mask=ld_ok, sem="relaxed")
        tl.debug_barrier()  # every thread's add before the counter's release
        if tl.atomic_add(cnt_ptr + rb, 1, sem="acq_rel") == KS - 1:
            ss = tl.atomic_add(ss_ptr + r, 0.0, mask=ld_ok, sem="acquire")
            tl.store(ss_ptr + r, tl.zeros([HB], tl.float64), mask=ld_ok)
            tl.store(cnt_ptr + rb, 0)
            nrm = (nrm.to(tl.float64) / tl.sqrt(ss)).to(tl.float32)
            _tl.store_fp16(cache_ptr, base, off, tl.where(bad, float("nan"), nrm), h_ok, N_OFF)
    elif part == 0:
        _tl.store_fp16(cache_ptr, base, off, tl.where(bad, float("nan"), nrm), h_ok, N_OFF)


@triton.jit(do_not_specialize=["N_ROWS"])  # the step's row count is no specialization key
def _store_kernel(k_ptr, sk_n, sk_h, v_ptr, sv_n, sv_h, slot_ptr, cache_ptr, sc_b, sc_h,
                  rot_ptr, tab_ptr, N_ROWS, HK: tl.constexpr, HB: tl.constexpr, BK: tl.constexpr,
                  TF32X3: tl.constexpr, L: tl.constexpr, K0: tl.constexpr, K1: tl.constexpr,
                  V0: tl.constexpr, V1: tl.constexpr, ss_ptr, cnt_ptr, KS: tl.constexpr,
                  mu_ptr, mur_ptr, CENTER: tl.constexpr):
    # programs: [0, KS·n_kv) keys of row block pid // KS (part pid % KS of its coordinates),
    # [KS·n_kv, (KS+1)·n_kv) values
    pid = tl.program_id(0)
    n_kv = tl.maximum(tl.cdiv(N_ROWS, HB), 1)
    n_k = KS * n_kv
    # true for every program of the grid; without the test ptxas schedules the whole kernel
    # differently (not measured), so the timed build is kept
    if pid < n_k + n_kv:
        is_key = pid < n_k
        rb = tl.where(is_key, pid // KS, pid - n_k)
        part = pid % KS
        r = rb * HB + tl.arange(0, HB)
        n = r // HK
        h = r % HK
        # rows are loaded as they exist (ld_ok), so the input loads do not wait for the slot
        # load; padding tokens (negative slots) and rows past the end write nothing (h_ok)
        ld_ok = r < N_ROWS
        slot = tl.load(slot_ptr + n, mask=ld_ok, other=-1).to(tl.int64)
        h_ok = slot >= 0
        blk = tl.where(h_ok, slot, 0) // L.bs
        off = tl.where(h_ok, slot, 0) % L.bs
        base = blk * sc_b + h.to(tl.int64) * sc_h
        k_rows = n.to(tl.int64) * sk_n + h * sk_h
        v_rows = n.to(tl.int64) * sv_n + h * sv_h

        if is_key:
            if L.k_fp8:
                d = tl.arange(0, L.dp)
                x = tl.load(k_ptr + k_rows[:, None] + d[None, :],
                            mask=ld_ok[:, None] & (d < L.d)[None, :], other=0.0).to(tl.float32)
                if CENTER:
                    x -= tl.load(mu_ptr + h[:, None] * L.d + d[None, :], mask=(d < L.d)[None, :],
                                 other=0.0)
                tl.store(_tl.row_ptr(cache_ptr, base, off, K0.off, K0.g, K0.cm)
                         + (d[None, :] * L.bs if K0.cm else d[None, :]),
                         _fp8_e4m3(x).to(tl.uint8), mask=h_ok[:, None] & (d < L.d)[None, :])
            elif KS > 1:
                _encode_key_part(k_ptr, k_rows, r, ld_ok, h_ok, cache_ptr, base, off, rot_ptr,
                                 tab_ptr, part, rb, ss_ptr, cnt_ptr, L.d, L.dp, HB, TF32X3, L.bs,
                                 L.kn_off, L.k_corr == 1, K0, KS, h, mu_ptr, mur_ptr, CENTER)
            else:
                _encode_unit(k_ptr, k_rows, ld_ok, h_ok, cache_ptr, base, off, rot_ptr, tab_ptr,
                             L.d, L.dp, BK, HB, TF32X3, L.bs, L.kn_off, L.k_corr == 1, L.k_nout,
                             L.k_noutp, L.koi_off, L.kov_off, L.has_k1, K0, K1, h, mu_ptr,
                             mur_ptr, CENTER)
        else:
            if L.v_tq:
                _encode_unit(v_ptr, v_rows, ld_ok, h_ok, cache_ptr, base, off, rot_ptr, tab_ptr,
                             L.d, L.dp, BK, HB, TF32X3, L.bs, L.vn_off, L.v_corr == 1, 0, 1, 0, 0,
                             L.has_v1, V0, V1)
            else:
                bad, v, m = _row_stats(v_ptr, v_rows, ld_ok, L.d, V0.gp * V0.cpw)
                vmin = tl.min(tl.where(m, v, float("inf")), axis=1)
                vmax = tl.max(tl.where(m, v, float("-inf")), axis=1)
                levels = tl.full(vmax.shape, L.v_levels, tl.float32)
                scale = tl.maximum(tl.math.div_rn(vmax - vmin, levels), 1e-8)
                qv = tl.floor(tl.math.div_rn(v - vmin[:, None], scale[:, None]) + 0.5)
                qv = tl.minimum(tl.maximum(qv, 0.0), L.v_levels * 1.0).to(tl.int32)
                _store_codes(qv, cache_ptr, base, off, h_ok, HB, L.bs, V0.off, V0.bits, V0.w, V0.g,
                             V0.gp, V0.cpw, V0.cm)
                _tl.store_fp16(cache_ptr, base, off, tl.where(bad, float("nan"), scale), h_ok,
                               L.vs_off)
                _tl.store_fp16(cache_ptr, base, off, vmin, h_ok, L.vz_off)
        if L.pad_n > 0:
            tl.store(cache_ptr + base + L.pad_off + off, tl.zeros([HB], tl.uint8),
                     mask=h_ok & is_key & (part == 0))


ROWS_PER_PROGRAM = 16  # (token, KV head) rows per program
# decode-size steps (few rows: every program's latency chain is the kernel's time) load the
# whole rotation at once with 8 warps; larger steps rotate in 32-wide K chunks with 4 warps
DECODE_ROWS, DECODE_BLOCK_K, DECODE_WARPS = 1024, 128, 8
BLOCK_K, WARPS = 32, 4


def store_kv_triton(codec: TQCodec, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    key_offset: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Quantize key/value (N, Hk, D) into kv_cache at slot_mapping (N,), in place.

    The rotation runs as three TF32 tensor-core dots on CUDA ("tf32x3") and as IEEE fp32 dots
    under the interpreter, which has no TF32. ``key_offset`` = (μ, μ·R), each fp32 (Hk, D):
    the keys are stored centered, k − μ (computed in fp32 inside the kernel).
    """
    check_float("key", key)
    check_float("value", value)
    n, hk, d = key.shape
    check_index("slot_mapping", slot_mapping, min_len=n)
    if value.shape != key.shape or d != codec.head_dim or kv_cache.shape[1] != hk:
        raise ValueError(f"key {tuple(key.shape)} / value {tuple(value.shape)} do not fit a cache "
                         f"of {kv_cache.shape[1]} KV heads at head size {codec.head_dim}")
    if n == 0:
        return
    bs = cache_block_size(codec, kv_cache)
    spec = kernel_spec(codec, bs)
    tab, rot = spec.tables_on(key.device)
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    if key_offset is not None:
        mu, mu_rot = key_offset
        # the kernel reads both as dense fp32 rows on the key's device
        if any(t.shape != (hk, d) or t.dtype != torch.float32 or not t.is_contiguous()
               or t.device != key.device for t in (mu, mu_rot)):
            raise ValueError(f"key_offset: contiguous fp32 (μ, μ·R) of shape {(hk, d)} on "
                             f"{key.device} expected, got {mu.dtype} {tuple(mu.shape)} on "
                             f"{mu.device} / {mu_rot.dtype} {tuple(mu_rot.shape)} on "
                             f"{mu_rot.device}")
    else:
        mu = mu_rot = tab  # not read
    rows = n * hk
    bk, num_warps, ks = _launch_variant(spec, rows, key.device)
    n_kv = max(triton.cdiv(rows, ROWS_PER_PROGRAM), 1)
    ss_buf, cnt_buf = _split_scratch(key.device, rows if ks > 1 else 1, n_kv if ks > 1 else 1)
    _store_kernel[((ks + 1) * n_kv,)](
        key, key.stride(0), key.stride(1), value, value.stride(0), value.stride(1), slot_mapping,
        kv_cache, kv_cache.stride(0), kv_cache.stride(1), rot, tab,
        rows, HK=hk, HB=ROWS_PER_PROGRAM, BK=bk, TF32X3=not interpreted(key.device),
        num_warps=num_warps, **spec.constexprs, ss_ptr=ss_buf, cnt_ptr=cnt_buf, KS=ks,
        mu_ptr=mu, mur_ptr=mu_rot, CENTER=key_offset is not None)


def _launch_variant(spec, rows: int, device) -> tuple[int, int, int]:
    """(BK, num_warps, KS) of a launch over ``rows`` (token, KV head) rows: what, besides the
    cache layout, selects the kernel build."""
    dp = spec.layout.dp
    small = rows <= DECODE_ROWS
    bk = min(DECODE_BLOCK_K if small else BLOCK_K, dp)
    n_kv = max(triton.cdiv(rows, ROWS_PER_PROGRAM), 1)
    m = spec.layout
    g = spec.key_fields[0].g
    key_splits = auto_key_splits(n_kv, device)
    ks = key_splits if (spec.key_fields[0].bits > 0 and not m.k_fp8 and m.k_nout == 0
                        and not m.has_k1 and bk == dp and g % key_splits == 0
                        and (g // key_splits) & (g // key_splits - 1) == 0) else 1
    return bk, DECODE_WARPS if small else WARPS, ks


def warmup_token_counts(codec: TQCodec, num_kv_heads: int, block_size: int, device,
                        max_tokens: int) -> list[int]:
    """The fewest tokens of each store build a step of 1..max_tokens tokens can launch."""
    spec = kernel_spec(codec, block_size)
    first: dict = {}
    for n in range(1, max_tokens + 1):
        first.setdefault(_launch_variant(spec, n * num_kv_heads, device), n)
    return sorted(first.values())


def auto_key_splits(n_kv: int, device) -> int:
    """Key splits for a launch of n_kv key and n_kv value row blocks: the most (4, else 2) whose
    programs (one 8-warp program per SM at decode sizes) still fit one wave, else 1."""
    for ks in (4, 2):
        if (ks + 1) * n_kv <= num_sms(device):
            return ks
    return 1


_SCRATCH: dict = {}


def _split_scratch(device, rows: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 Σĉ² per row and int32 counters per row block for key splits: zero between launches
    (the last part of each block resets its own); one pair per device, grown by replacement
    (replaced buffers stay alive for captured graphs). Launches on different streams must not
    run concurrently."""
    key = str(device)
    bufs = _SCRATCH.setdefault(key, [])
    if not bufs or bufs[-1][0].numel() < rows or bufs[-1][1].numel() < blocks:
        n = max(rows, 2 * bufs[-1][0].numel() if bufs else 4096)
        bufs.append((torch.zeros(n, dtype=torch.float64, device=device),
                     torch.zeros(max(blocks, n // 16), dtype=torch.int32, device=device)))
    return bufs[-1]
