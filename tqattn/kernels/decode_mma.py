"""Decode attention on tensor cores with register-resident operands (Gluon, sm_80+).

Fast path of :func:`tqattn.kernels.decode.decode_attention_triton` for 3-bit centroid keys
(column-major key planes) with 4-bit uniform values (``turboquant_k3v4_nc``), head size 128,
GQA groups of up to 8 query heads, one query row per sequence, no window / soft-cap. Math =
:func:`tqattn.quant.paged.decode_attention_ref`; the split outputs and LSEs it writes are merged
by the Triton kernel's ``_merge_kernel``.

Why a second kernel: the Triton kernel feeds ``tl.dot`` from blocked layouts, so every decoded
tile makes a round trip through shared memory (plus barriers), and its ``[heads, tokens]`` dots
pad 4 heads to 16 rows. Here Gluon's explicit layouts let each thread load exactly the code
words whose decoded fp16 pairs form its own ``mma.sync`` fragments — no shared memory at all:

* scores are ``Sᵀ[64 tokens, 8 heads] = K·(q·scale)ᵀ`` (m16n8k16: tokens on M, heads on N);
  the K operand comes from :func:`_asm.lut3_rows` on three column-major page words (4 tokens
  × 8 codes); row ρ of a tile is token ``8·(ρ % 8) + ρ // 8`` and operand column κ is rotated
  coordinate ``8·cw + 2p + (κ & 1)`` with ``cw = (κ>>1 & 3) + 4·(κ>>5 & 3)``, ``p = κ>>3 & 3``;
* ``Oᵀ[128 dims, 8 heads] += Vᵀ·(p·scale)`` with ``Vᵀ`` from :data:`_asm.U4_PAIRS` (pairs of
  tokens τ, τ+8 of one dimension; row ρ of ``Vᵀ`` is dimension ``16·(ρ % 8) + ρ // 8``); the
  zero points enter as ``Σ p·zero``; ``p`` goes from the score layout to the operand layout
  in registers.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from . import _asm

TILE = gl.constexpr(64)
_MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1],
                                              instr_shape=[16, 8]))
_OP_A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_MMA.value, k_width=2))
_OP_B = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=_MMA.value, k_width=2))
# key words [16 token quads, 16 code words]: lane (g, t) holds quads 2g, 2g+1 of code words
# t, t+4, t+8, t+12 — the decoded pairs are its K-operand fragments
_KW = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 4], [0, 8], [1, 0]], lane_bases=[[0, 1], [0, 2], [2, 0], [4, 0], [8, 0]],
    warp_bases=[], block_bases=[], shape=[16, 16]))
# value words [16 = 2g + w, 32 = 8t + j]: word w of bytes 8g..8g+7 of token 16t + j (and of
# token 16t + 8 + j in the second tensor)
_VW = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[1, 0], [0, 1], [0, 2], [0, 4]],
    lane_bases=[[0, 8], [0, 16], [2, 0], [4, 0], [8, 0]], warp_bases=[], block_bases=[], shape=[16, 32]))
_QL = gl.constexpr(gl.BlockedLayout([1, 8], [32, 1], [1, 1], [1, 0]))
_LANE = gl.constexpr(gl.BlockedLayout([1], [32], [1], [0]))
_ROWS = gl.constexpr(gl.SliceLayout(1, _MMA.value))
_HEADS = gl.constexpr(gl.SliceLayout(0, _MMA.value))


@gluon.jit
def _halves(x):
    """int32 fp16 pairs [..] → fp16 [.., 2] (low half first)."""
    lo = (x & 0xFFFF).to(gl.int16)
    hi = (x >> 16).to(gl.int16)
    return gl.join(lo, hi).to(gl.float16, bitcast=True)


@gluon.jit
def _j4(a, b, c, d):
    return gl.join(gl.join(a, b), gl.join(c, d))


@gluon.jit
def _j8(o):
    return gl.join(_j4(o[0], o[1], o[2], o[3]), _j4(o[4], o[5], o[6], o[7]))


@gluon.jit
def _j16(o):
    return gl.join(gl.join(_j4(o[0], o[1], o[2], o[3]), _j4(o[4], o[5], o[6], o[7])),
                   gl.join(_j4(o[8], o[9], o[10], o[11]), _j4(o[12], o[13], o[14], o[15])))


@gluon.jit
def _lo_hi(x):
    """int64 [32] → its low and high int32 words."""
    return (x & 0xFFFFFFFF).to(gl.int32), (x >> 32).to(gl.int32)


@gluon.jit
def _key_words(kb, m: gl.constexpr, BS: gl.constexpr):
    """The three sub-plane words of code word t + 4m, tokens 8g..8g+3 and 8g+4..8g+7."""
    a0, a1 = _lo_hi(gl.load(kb + m * BS // 2))
    b0, b1 = _lo_hi(gl.load(kb + m * BS // 2 + 2 * BS))
    c0, c1 = _lo_hi(gl.load(kb + m * BS // 2 + 4 * BS))
    return a0, b0, c0, a1, b1, c1


@gluon.jit
def _key_calls(kb, m: gl.constexpr, BS: gl.constexpr, KASM: gl.constexpr):
    a0, b0, c0, a1, b1, c1 = _key_words(kb, m, BS)
    lo = gl.inline_asm_elementwise(KASM, "=r," * 16 + "r,r,r", [a0, b0, c0], (gl.int32,) * 16,
                                   is_pure=True, pack=1)
    hi = gl.inline_asm_elementwise(KASM, "=r," * 16 + "r,r,r", [a1, b1, c1], (gl.int32,) * 16,
                                   is_pure=True, pack=1)
    return _j16(lo), _j16(hi)


@gluon.jit
def _key_operand(kb, BS: gl.constexpr, KASM: gl.constexpr):
    """K [64 rows, 128 columns] fp16 A operand of the lane's code words (kb: int64 pointer to
    sub-plane 0 of code word t, tokens 8g..)."""
    l0, h0 = _key_calls(kb, 0, BS, KASM)
    l1, h1 = _key_calls(kb, 1, BS, KASM)
    l2, h2 = _key_calls(kb, 2, BS, KASM)
    l3, h3 = _key_calls(kb, 3, BS, KASM)
    x = gl.join(_j4(l0, l1, l2, l3), _j4(h0, h1, h2, h3))
    # [lane, e0, e1, p0, p1, m0, m1, r7] → halves → [g, t, e0, e1, p0, p1, m0, m1, r7, h]
    x = gl.reshape(_halves(x), [8, 4, 2, 2, 2, 2, 2, 2, 2, 2])
    # row = g + 8 e0 + 16 e1 + 32 r7; column = h + 2t + 8 p0 + 16 p1 + 32 m0 + 64 m1
    x = gl.permute(x, [8, 3, 2, 0, 7, 6, 5, 4, 1, 9])
    return gl.convert_layout(gl.reshape(x, [64, 128]), _OP_A)


@gluon.jit
def _value_calls(vb, j: gl.constexpr, VASM: gl.constexpr):
    a0, a1 = _lo_hi(gl.load(vb + 8 * j))
    b0, b1 = _lo_hi(gl.load(vb + 8 * j + 64))
    o0 = gl.inline_asm_elementwise(VASM, "=r," * 8 + "r,r", [a0, b0], (gl.int32,) * 8,
                                   is_pure=True, pack=1)
    o1 = gl.inline_asm_elementwise(VASM, "=r," * 8 + "r,r", [a1, b1], (gl.int32,) * 8,
                                   is_pure=True, pack=1)
    return gl.join(_j8(o0), _j8(o1))


@gluon.jit
def _value_operand(vb, VASM: gl.constexpr):
    """Vᵀ [128 rows, 64 columns] fp16 A operand (vb: int64 pointer to bytes 8g.. of token 16t)."""
    x = gl.join(_j4(_value_calls(vb, 0, VASM), _value_calls(vb, 1, VASM),
                    _value_calls(vb, 2, VASM), _value_calls(vb, 3, VASM)),
                _j4(_value_calls(vb, 4, VASM), _value_calls(vb, 5, VASM),
                    _value_calls(vb, 6, VASM), _value_calls(vb, 7, VASM)))
    # [lane, nib, b0, b1, w, j0, j1, j2] → halves → [g, t, nib, b0, b1, w, j0, j1, j2, h]
    x = gl.reshape(_halves(x), [8, 4, 2, 2, 2, 2, 2, 2, 2, 2])
    # row = g + 8 nib + 16 b0 + 32 b1 + 64 w; column = h + 2t + 8 j0 + 16 j1 + 32 j2
    x = gl.permute(x, [5, 4, 3, 2, 0, 8, 7, 6, 1, 9])
    return gl.convert_layout(gl.reshape(x, [128, 64]), _OP_A)


@gluon.jit
def _row_scalars(p):
    """fp16 of tokens 8g + i (i = 0..7) at p + i, per lane → fp32 [64, 8] in the score layout
    (row g + 8i, both heads of the lane)."""
    v0 = gl.load(p).to(gl.float32)
    v1 = gl.load(p + 1).to(gl.float32)
    v2 = gl.load(p + 2).to(gl.float32)
    v3 = gl.load(p + 3).to(gl.float32)
    v4 = gl.load(p + 4).to(gl.float32)
    v5 = gl.load(p + 5).to(gl.float32)
    v6 = gl.load(p + 6).to(gl.float32)
    v7 = gl.load(p + 7).to(gl.float32)
    x = gl.join(_j4(gl.join(v0, v0), gl.join(v1, v1), gl.join(v2, v2), gl.join(v3, v3)),
                _j4(gl.join(v4, v4), gl.join(v5, v5), gl.join(v6, v6), gl.join(v7, v7)))
    # [lane, h, i0, i1, i2] → [g, t, h, i0, i1, i2]; row = g + 8i, column = h + 2t
    x = gl.permute(gl.reshape(x, [8, 4, 2, 2, 2, 2]), [5, 4, 3, 0, 1, 2])
    return gl.convert_layout(gl.reshape(x, [64, 8]), _MMA)


@gluon.jit
def _decode_mma_kernel(q_ptr, sq_r, sq_h, cache_ptr, sc_b, sc_h, bt_ptr, sbt, seqlen_ptr,
                       po_ptr, spo_r, spo_h, spo_s, plse_ptr, spl_r, spl_h, qk_scale, NUM_SPLITS,
                       GROUP: gl.constexpr, HK: gl.constexpr, BS: gl.constexpr,
                       K_OFF: gl.constexpr, KN_OFF: gl.constexpr, V_OFF: gl.constexpr,
                       VS_OFF: gl.constexpr, VZ_OFF: gl.constexpr, KASM: gl.constexpr,
                       VASM: gl.constexpr):
    pid = gl.program_id(0)
    split = gl.program_id(1)
    b = pid // HK
    kvh = pid % HK
    seq_len = gl.load(seqlen_ptr + b)
    n_tiles = gl.cdiv(seq_len, TILE)
    per_split = gl.cdiv(n_tiles, NUM_SPLITS)
    t0 = split * per_split
    t1 = gl.minimum(t0 + per_split, n_tiles)

    # query (rotated, fp32) → Qᵀ [128, 8] operand, column κ = rotated coordinate c(κ)
    kq = gl.arange(0, 128, layout=gl.SliceLayout(1, _QL))
    hq = gl.arange(0, 8, layout=gl.SliceLayout(0, _QL))
    coord = 8 * (((kq >> 1) & 3) + 4 * ((kq >> 5) & 3)) + 2 * ((kq >> 3) & 3) + (kq & 1)
    q_rows = b.to(gl.int64) * sq_r + (kvh * GROUP + hq) * sq_h
    qv = gl.load(q_ptr + q_rows[None, :] + coord[:, None], mask=(hq < GROUP)[None, :], other=0.0)
    qb = gl.convert_layout((qv * qk_scale).to(gl.float16), _OP_B)

    bt_row = bt_ptr + b.to(gl.int64) * sbt
    page0 = cache_ptr + kvh.to(gl.int64) * sc_h
    # per lane (g, t): tokens 8g.. (keys, per-token scalars) and 16t.. (values) of the tile
    lane = gl.arange(0, 32, layout=_LANE)
    tg = 8 * (lane // 4)
    tt = 16 * (lane % 4)
    rho = gl.arange(0, TILE, layout=_ROWS)
    tau = 8 * (rho % 8) + rho // 8

    m_i = gl.full([8], float("-inf"), gl.float32, layout=_HEADS)
    l_f = gl.zeros([TILE, 8], gl.float32, layout=_MMA)
    z_f = gl.zeros([TILE, 8], gl.float32, layout=_MMA)
    acc = gl.zeros([128, 8], gl.float32, layout=_MMA)
    for t in range(t0, t1):
        tok0 = t * TILE
        # pages hold >= 16 tokens and tiles start at page boundaries: one page per lane and role
        pg = page0 + gl.load(bt_row + (tok0 + tg) // BS).to(gl.int64) * sc_b
        pv = page0 + gl.load(bt_row + (tok0 + tt) // BS).to(gl.int64) * sc_b
        kb = (pg + K_OFF + (lane % 4) * BS + (tg % BS)).to(gl.pointer_type(gl.int64))
        vb = (pv + V_OFF + 64 * (tt % BS) + 8 * (lane // 4)).to(gl.pointer_type(gl.int64))
        sp = (pg + 2 * (tg % BS)).to(gl.pointer_type(gl.float16))
        kn = _row_scalars(sp + KN_OFF // 2)
        vs = _row_scalars(sp + VS_OFF // 2)
        vz = _row_scalars(sp + VZ_OFF // 2)
        ok = (tok0 + tau < seq_len)[:, None]

        s = mma_v2(_key_operand(kb, BS, KASM), qb, gl.zeros([TILE, 8], gl.float32, layout=_MMA))
        s = gl.where(ok, s * kn, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[None, :])
        l_f = l_f * alpha[None, :] + p
        z_f = z_f * alpha[None, :] + p * gl.where(ok, vz, 0.0)
        pb = gl.convert_layout((p * gl.where(ok, vs, 0.0)).to(gl.float16), _OP_B)
        acc = mma_v2(_value_operand(vb, VASM), pb, acc * alpha[None, :])
        m_i = m_new

    l_i = gl.sum(l_f, axis=0)
    has = l_i > 0.0
    inv = gl.where(has, 1.0 / gl.where(has, l_i, 1.0), 0.0)
    z = gl.sum(z_f, axis=0) * inv
    lse = gl.where(has, m_i * 0.6931471805599453 + gl.log(gl.where(has, l_i, 1.0)),
                   float("-inf"))
    heads = gl.arange(0, 8, layout=_HEADS)
    dims = gl.arange(0, 128, layout=gl.SliceLayout(1, _MMA))
    dim = 16 * (dims % 8) + dims // 8
    po = (b.to(gl.int64) * spo_r + (kvh * GROUP + heads) * spo_h + split * spo_s)
    gl.store(po_ptr + po[None, :] + dim[:, None], acc * inv[None, :] + z[None, :],
             mask=(heads < GROUP)[None, :])
    gl.store(plse_ptr + b * spl_r + (kvh * GROUP + heads) * spl_h + split, lse,
             mask=heads < GROUP)


def supported(spec, q: torch.Tensor, group: int, plain: bool) -> bool:
    """Whether this kernel serves the call (else the Triton kernel does)."""
    m = spec.meta
    kf, vf = spec.key_fields, spec.value_fields
    return (plain and q.is_cuda and torch.cuda.get_device_capability(q.device) >= (8, 0)
            and m["D"] == 128 and group <= 8 and len(kf) == 1 and kf[0].cm and kf[0].lut >= 0
            and kf[0].g == 16 and not m["V_TQ"] and len(vf) == 1 and vf[0].bits == 4
            and vf[0].w == 1 and vf[0].g == 64)


def launch(spec, qk, kv_cache, block_table, seq_lens, part, plse, scale: float, group: int,
           num_splits: int) -> None:
    m = spec.meta
    kf = spec.key_fields[0]
    batch, hk = seq_lens.numel(), kv_cache.shape[1]
    _decode_mma_kernel[(batch * hk, num_splits)](
        qk, qk.stride(0), qk.stride(1), kv_cache, kv_cache.stride(0), kv_cache.stride(1),
        block_table, block_table.stride(0), seq_lens, part, part.stride(0), part.stride(1),
        part.stride(2), plse, plse.stride(0), plse.stride(1), scale * 1.4426950408889634,
        num_splits, GROUP=group, HK=hk, BS=spec.block_size, K_OFF=kf.off, KN_OFF=m["KN_OFF"],
        V_OFF=spec.value_fields[0].off, VS_OFF=m["VS_OFF"], VZ_OFF=m["VZ_OFF"],
        KASM=_asm.lut3_rows(spec.table[kf.lut:kf.lut + 8]), VASM=_asm.U4_PAIRS.value, num_warps=1)
