"""Decode attention on tensor cores with register-resident operands (Gluon, sm_80+).

The tensor-core path of :func:`tqattn.kernels.decode.decode_attention_triton` for the layouts of
:func:`tqattn.kernels._spec.mma_layout`, head size 128, 64 or 256 (constexpr D), GQA groups of
up to 8 query heads, one query row per sequence, no window / soft-cap, in these formats
(constexprs KEYS, VALS; MAP, the score rows' token order, follows from VALS):

* KEYS = VALS = 0, ``turboquant_k3v4_nc``: 3-bit centroid keys in column-major planes, 4-bit
  uniform values in token rows (the description below);
* KEYS = 1, VALS = 0, ``turboquant_4bit_nc``: the 4-bit row keys below with the first format's
  uniform values; the values fix the score rows' token order (MAP 0), so a lane loads the
  key rows of its tokens 8g + j;
* KEYS = VALS = 1, ``tq_k4v3``: 4-bit keys of a symmetric codebook in token rows (a lane reads
  16 row bytes of each of its 8 tokens, :data:`_asm.LUT4_ROWS` turns a byte into its coordinate
  pair), rotated 3-bit values in column-major planes (:data:`_asm.LUT3_TOKENS`: one coordinate's
  consecutive tokens), accumulated in the rotated basis and un-rotated once per program (a
  Walsh–Hadamard transform of the output rows); score row ρ is token 16·(g // 2) + 2·(ρ // 8) +
  g % 2 with g = ρ % 8 (the values' pairs of consecutive tokens fix it).
* KEYS = 0, VALS = 2, ``turboquant_3bit_nc``: the first format's keys in the third's token
  order (MAP 1: a lane loads its key words of tokens 8g.. as in the first format and trades the
  tokens of the other parity with lane ^ 4, :func:`_parity_word`), 3-bit uniform values in
  column-major planes read as the third format's (the codes 0..7 as their table, scale and zero
  point per token as in the first format). The same keys with the third format's rotated values (KEYS = 0, VALS = 1) serve ``tq_k3v3``.
* VALS = 3 with 4-bit (KEYS = 1, ``tq_k4v4``) or 3-bit keys (KEYS = 0, ``tq_k3v4``): rotated
  4-bit values of a symmetric codebook in token rows, loaded as the first format's uniform
  values (MAP 0) and decoded by :data:`_asm.LUT4_PAIRS`, their norms instead of scale and zero
  point, the output un-rotated per program as ``tq_k4v3``'s.
* KEYS = 2, VALS = 0, ``turboquant_k8v4``: fp8 (e4m3) keys in token rows, unrotated and without
  a norm (a lane reads 32 row bytes of each of its 8 tokens, converted by ``cvt.f16x2.e4m3x2``;
  the operand columns are the 4-bit keys' σ, the query is not rotated; sm_89+), the first
  format's uniform values. The store kernel writes a step's new token first (the kernel's own
  store serves rotated keys only).

Math = :func:`tqattn.quant.paged.decode_attention_ref` (its twin; the inline asm does not run
under triton's interpreter, so the comparison runs on the GPU: ``pytest -m gpu``; the index
bookkeeping of the second format is replayed on CPU in tests/kernels/test_mma_operands.py).
Each program rotates the raw query itself: the head size 128 rotation is diag(s)·H/√128, a
Walsh–Hadamard transform (:func:`_fused_query`, twin :func:`fused_query_ref`). With a decode
step's new K/V (STORE, every format but fp8 keys), the last split of each (sequence, KV
head) encodes its sequence's new token into the page before reading it
(:func:`_store_new_token`, twin :func:`store_new_token_ref`; the math of kernels/store.py), so
a decode step is one launch. The last split of each group to finish merges
the group's split outputs (the math of ``decode._merge_kernel``) into ``out``/``lse``.

Why a second kernel: the Triton kernel feeds ``tl.dot`` from blocked layouts, so every decoded
tile makes a round trip through shared memory (plus barriers), and its ``[heads, tokens]`` dots
pad 4 heads to 16 rows. Here Gluon's explicit layouts let each lane load exactly the code
words whose decoded fp16 pairs form its own ``mma.sync`` fragments — no shared memory at all:

* scores are ``Sᵀ[64 tokens, 8 heads] = K·(q·scale)ᵀ`` (m16n8k16: tokens on M, heads on N);
  the K operand comes from :data:`_asm.LUT3_ROWS` on three column-major page words (4 tokens
  × 8 codes); row ρ of a tile is token ``8·(ρ % 8) + ρ // 8`` and operand column κ is rotated
  coordinate ``8·cw + 2p + (κ & 1)`` with ``cw = (κ>>1 & 3) + 4·(κ>>5 & 3)``, ``p = κ>>3 & 3``;
* ``Oᵀ[128 dims, 8 heads] += Vᵀ·(p·scale)`` with ``Vᵀ`` from :data:`_asm.U4_PAIRS` (pairs of
  tokens τ, τ+8 of one dimension; row ρ of ``Vᵀ`` is dimension ``16·(ρ % 8) + ρ // 8``); the
  zero points enter as ``Σ p·zero``; ``p`` goes from the score layout to the operand layout
  in registers;
* each lane reads one page per role and tile (tiles of 64 tokens start at page boundaries),
  its 8 key norms / value scales / zero points as one 16-byte load each,
  the online softmax rescales only when a head's max grows by more than 8 (log2 units), row
  sums stay per lane until the end, and only the sequence's last partial tile is masked.
  Limit: ``p ≤ 2^8`` times a token's value scale must fit fp16 (scale < 256, i.e. a value
  range below ~3800 within one token's head vector with 4-bit uniform values, ~1800 with 3-bit
  ones; the Triton kernel, with ``p ≤ 1``, allows 256x more).

Head size 64 (every format but fp8 keys): the same tiles and token orders with half the code
words per lane — 3-bit keys' words t, t + 4; 4-bit keys' row bytes 8t.. (one int64 per
token); 4-bit row values' bytes 4g.. (one int32 per token); 3-bit column-major values' word g
— operands K [64, 64] and Vᵀ [64, 64], row ρ of Vᵀ and of the output coordinate 8·(ρ % 8) +
ρ // 8, a 64-point transform of the query and of rotated values' output; no fused store (the
store kernel writes the step's token first). Replayed on CPU in tests/kernels/test_mma_head64.py.
Head size 256: two 128-coordinate halves, each loaded and decoded as a head-128 page with the
second half's offset and twice the strides — scores K_a·Q_a + K_b·Q_b, two accumulators
[128, 8], the query's transform as [H(a + b); H(a − b)] — and each tile loads its own key and
value words together (the halves' words do not fit the registers a tile ahead;
:func:`_loop256`), except in ``turboquant_k3v4_nc``'s format, where the next tile's words
travel asynchronously into shared memory while a tile is computed (:func:`_loop256_copies`,
:func:`_word`); the step's new token stored by the kernel (rotated as the query is).
Replayed on CPU in tests/kernels/test_mma_head256.py.

Launch: one warp per (sequence, KV head, split); the split count fills exactly one wave of the
programs that the compiled kernel's registers (and shared memory) let an SM hold
(programs_per_sm). Each split
takes a fixed range of tiles; the older of the two programs on an SM scheduler runs much
faster than the younger, so programs take their (group, split) by arrival, the older ones
first, and an older program's range is SPLIT_WEIGHTS times a younger one's. The words of the
next tile are loaded while a tile is computed (≤ 255 registers: 8 programs per SM), and the
blocks of a coming tile are prefetched into L2 (which one depends on the head size: L2_AHEAD_64,
L2_AHEAD_128; at 256, :func:`_loop256`). Measurements behind these choices:
bench/results/README.md.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from . import _asm
# the asm texts by name: Triton's cache key hashes the global constexprs a kernel names, not
# those it reads as a module's attributes, so a changed text would reuse a stale build
from ._asm import LUT3_ROWS, LUT3_TOKENS, LUT4_PAIRS, LUT4_ROWS, LUT4_ROWS_SM, U4_PAIRS
from ._spec import num_sms
from ..quant.codec import sign_magnitude
from ..quant.packing import pack_bits
from ..quant.paged import page_word_bytes
from ..quant.rotation import is_signed_hadamard

TILE = gl.constexpr(64)
_MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1],
                                              instr_shape=[16, 8]))
_OP_A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_MMA.value, k_width=2))
_OP_B = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=_MMA.value, k_width=2))
_LANE = gl.constexpr(gl.BlockedLayout([1], [32], [1], [0]))
_PAIR = gl.constexpr(gl.BlockedLayout([1, 2], [32, 1], [1, 1], [1, 0]))  # 16 bytes per lane
# [STEP splits, heads, 128] of the merge: each lane 4 dimensions of every split and head
_MS = gl.constexpr(gl.BlockedLayout([1, 1, 4], [1, 1, 32], [1, 1, 1], [2, 1, 0]))
MAX_SPLITS = gl.constexpr(64)
_QL = gl.constexpr(gl.BlockedLayout([32, 1], [4, 8], [1, 1], [0, 1]))    # [128, 8] query: 32 k each
_QL64 = gl.constexpr(gl.BlockedLayout([16, 1], [4, 8], [1, 1], [0, 1]))  # [64, 8]: 16 k each
_MS64 = gl.constexpr(gl.BlockedLayout([1, 1, 2], [1, 1, 32], [1, 1, 1], [2, 1, 0]))
_MS256 = gl.constexpr(gl.BlockedLayout([1, 1, 8], [1, 1, 32], [1, 1, 1], [2, 1, 0]))
_ROWS = gl.constexpr(gl.SliceLayout(1, _MMA.value))
# a [32] int64 slot in shared memory, lane l's word at l: 256 conflict-free bytes
_SLOTS = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))
_HEADS = gl.constexpr(gl.SliceLayout(0, _MMA.value))


@gluon.jit
def _wht_stage(x, B: gl.constexpr, N: gl.constexpr = 128):
    """One butterfly of the Walsh–Hadamard transform over bit log2(B) of axis 0 of [N, 8]
    (the pairs must be in-thread: B ≤ 16 in _QL, ≤ 8 in _QL64)."""
    u, v = gl.split(gl.permute(gl.reshape(x, [N // (2 * B), 2, B, 8]), [0, 2, 3, 1]))
    return gl.reshape(gl.permute(gl.join(u + v, u - v), [0, 3, 1, 2]), [N, 8])


@gluon.jit
def _wht_rows(x):
    """Walsh–Hadamard transform (unnormalised) along axis 0 of x [128, 8] fp32 in _QL: bits
    0-4 in-thread; bits 5, 6 after one regrouping."""
    x = _wht_stage(x, 1)
    x = _wht_stage(x, 2)
    x = _wht_stage(x, 4)
    x = _wht_stage(x, 8)
    x = _wht_stage(x, 16)
    # bits 5, 6 of k into each thread: k' = 4 (k % 32) + k // 32
    x = gl.convert_layout(gl.reshape(gl.permute(gl.reshape(x, [4, 32, 8]), [1, 0, 2]),
                                     [128, 8]), _QL)
    x = _wht_stage(x, 1)
    x = _wht_stage(x, 2)
    return gl.reshape(gl.permute(gl.reshape(x, [32, 4, 8]), [1, 0, 2]), [128, 8])


@gluon.jit
def _wht_rows64(x):
    """:func:`_wht_rows` for x [64, 8] in _QL64: bits 0-3 in-thread, bits 4, 5 after one
    regrouping (k' = 4 (k % 16) + k // 16)."""
    x = _wht_stage(x, 1, 64)
    x = _wht_stage(x, 2, 64)
    x = _wht_stage(x, 4, 64)
    x = _wht_stage(x, 8, 64)
    x = gl.convert_layout(gl.reshape(gl.permute(gl.reshape(x, [4, 16, 8]), [1, 0, 2]),
                                     [64, 8]), _QL64)
    x = _wht_stage(x, 1, 64)
    x = _wht_stage(x, 2, 64)
    return gl.reshape(gl.permute(gl.reshape(x, [16, 4, 8]), [1, 0, 2]), [64, 8])


@gluon.jit
def _fused_query(q_ptr, q_rows, hmask, sgn_ptr, qscale, KEYS: gl.constexpr, D: gl.constexpr):
    """The query operand Qᵀ [D, 8] computed from the raw query: R = diag(s)·H/√D
    with its columns in operand order (a bit permutation σ of the column index, so R[:, σ] =
    P_σ·diag(s_σ)·H/√D): load q[σ(k)]·s[σ(k)]/√D (sgn_ptr), Walsh–Hadamard transform in
    fp32, times qscale, fp16 — the math of :func:`fused_query_ref`. σ: :func:`operand_coord`
    of the key format. D = 256: σ within each half, the transform of length 256 as
    [H(a + b); H(a − b)] of the halves a, b, and the halves' operands [128, 8] as a tuple."""
    QL: gl.constexpr = _QL64 if D == 64 else _QL
    HD: gl.constexpr = 64 if D == 64 else 128
    k = gl.arange(0, HD, layout=gl.SliceLayout(1, QL))
    if KEYS == 0:
        sk = (k & 0x61) | ((k >> 2) & 6) | ((k << 2) & 0x18)
    elif D != 64:
        sk = (k & 1) | ((k >> 2) & 0x1E) | ((k << 4) & 0x60)
    else:
        sk = (k & 1) | ((k >> 2) & 0xE) | ((k << 3) & 0x30)
    rows = gl.convert_layout(q_rows, gl.SliceLayout(0, QL))
    ok = gl.convert_layout(hmask, gl.SliceLayout(0, QL))
    x = gl.load(q_ptr + rows[None, :] + sk[:, None], mask=ok[None, :], other=0.0).to(gl.float32)
    if D == 256:
        x = x * gl.load(sgn_ptr + k)[:, None]
        x2 = gl.load(q_ptr + rows[None, :] + (sk + 128)[:, None], mask=ok[None, :],
                     other=0.0).to(gl.float32) * gl.load(sgn_ptr + 128 + k)[:, None]
        q = (gl.convert_layout(_wht_rows(x + x2) * qscale, _OP_B).to(gl.float16),
             gl.convert_layout(_wht_rows(x - x2) * qscale, _OP_B).to(gl.float16))
    elif KEYS != 2:  # fp8 keys are not rotated
        x = x * gl.load(sgn_ptr + k)[:, None]
        if D == 128:
            x = _wht_rows(x)
        else:
            x = _wht_rows64(x)
    if D != 256:
        q = gl.convert_layout(x * qscale, _OP_B).to(gl.float16)
    return q


_TOK = gl.constexpr(gl.BlockedLayout([4], [32], [1], [0]))   # [128]: lane l holds 4l..4l+3
_B64 = gl.constexpr(gl.BlockedLayout([2], [32], [1], [0]))    # [64] bytes: 2 per lane


@gluon.jit
def _bfly(x, M: gl.constexpr):
    """The value of lane (lane ^ M) (shfl.sync.bfly)."""
    return gl.inline_asm_elementwise(f"shfl.sync.bfly.b32 $0, $1, {M}, 0x1f, 0xffffffff;",
                                     "=r,r", [x], dtype=x.dtype, is_pure=True, pack=1)


@gluon.jit
def _wht128(x, kk):
    """Walsh–Hadamard transform (unnormalised) of x [128] in _TOK (kk: its indices): bits 0, 1
    of the index in-thread, bits 2-6 across lanes by butterfly shuffles."""
    u, v = gl.split(gl.reshape(x, [64, 2]))
    x = gl.reshape(gl.join(u + v, u - v), [128])
    u, v = gl.split(gl.permute(gl.reshape(x, [32, 2, 2]), [0, 2, 1]))
    x = gl.reshape(gl.permute(gl.join(u + v, u - v), [0, 2, 1]), [128])
    x = gl.convert_layout(x, _TOK)
    for b in gl.static_range(5):
        p = _bfly(x, 1 << b)
        x = gl.where(((kk >> (b + 2)) & 1) != 0, p - x, x + p)
    return x


@gluon.jit
def _row_halves(ptr, row, kk, D: gl.constexpr):
    """One D-element row (128 or 256) → its 128-element halves, fp32 in _TOK, all zeroed if any
    element is non-finite, and that flag."""
    x = gl.load(ptr + row + kk).to(gl.float32)
    bad = _nonfinite(x)
    if D == 256:
        x2 = gl.load(ptr + row + 128 + kk).to(gl.float32)
        bad = bad | _nonfinite(x2)
        xs = (gl.where(bad, 0.0, x), gl.where(bad, 0.0, x2))
    else:
        xs = (gl.where(bad, 0.0, x),)
    return xs, bad


@gluon.jit
def _nonfinite(x):
    """Whether any element of x [128] is NaN or ±inf."""
    return gl.max(((x != x) | (gl.abs(x) == float("inf"))).to(gl.int32), axis=0) > 0


@gluon.jit
def _lloyd_max(xs, sgn_ptr, ftab_ptr, kk, LUT: gl.constexpr, BND: gl.constexpr,
               BITS: gl.constexpr, FOLD: gl.constexpr, SM: gl.constexpr, D: gl.constexpr):
    """Codes [128] of each half of the row xs (:func:`_row_halves`) rotated (R = diag(s)·H/√D,
    sgn_ptr: s/√D; at D = 256 H's halves are [H₁₂₈(a + b); H₁₂₈(a − b)]) and scaled to a unit
    vector, and the norm to store: ‖x‖, or with FOLD ("nc") ‖x‖ / ‖ĉ‖ in fp64 as the store
    kernel folds it. Boundaries / centroids at ftab_ptr + BND / + LUT; SM: 4-bit codes in
    sign-and-magnitude order."""
    if D == 256:
        nrm = gl.sqrt_rn(gl.sum(xs[0] * xs[0], axis=0) + gl.sum(xs[1] * xs[1], axis=0))
        a = xs[0] * gl.load(sgn_ptr + kk)
        b = xs[1] * gl.load(sgn_ptr + 128 + kk)
        ys = (_wht128(a + b, kk), _wht128(a - b, kk))
    else:
        nrm = gl.sqrt_rn(gl.sum(xs[0] * xs[0], axis=0))
        ys = (_wht128(xs[0] * gl.load(sgn_ptr + kk), kk),)
    den = gl.zeros([128], gl.float32, layout=_TOK) + (nrm + 1e-8)
    codes = ()
    for h in gl.static_range(D // 128):
        y = gl.div_rn(ys[h], den)
        code = gl.zeros([128], gl.int32, layout=_TOK)
        for i in gl.static_range((1 << BITS) - 1):
            code += (y > gl.load(ftab_ptr + BND + i)).to(gl.int32)
        if SM:  # sign-and-magnitude order (tqattn.quant.codec.sign_magnitude)
            code = code ^ gl.where(code < 8, 7, 0)
        codes = codes + (code,)
    if FOLD:  # the centroids gathered from the (L1-resident) table
        c = gl.load(ftab_ptr + LUT + codes[0]).to(gl.float64)
        cc = gl.sum(c * c, axis=0)
        if D == 256:
            c = gl.load(ftab_ptr + LUT + codes[1]).to(gl.float64)
            cc = cc + gl.sum(c * c, axis=0)
        nrm = (nrm.to(gl.float64) / gl.sqrt(cc)).to(gl.float32)
    return codes, nrm


@gluon.jit
def _uniform_codes(vs, LEVELS: gl.constexpr, D: gl.constexpr):
    """Uniform codes [128] of each half of the row vs on LEVELS + 1 levels, its scale and zero
    point."""
    vmin = gl.min(vs[0], axis=0)
    vmax = gl.max(vs[0], axis=0)
    if D == 256:
        vmin = gl.minimum(vmin, gl.min(vs[1], axis=0))
        vmax = gl.maximum(vmax, gl.max(vs[1], axis=0))
    scale = gl.maximum(gl.div_rn(vmax - vmin, LEVELS * 1.0), 1e-8)
    codes = ()
    for h in gl.static_range(D // 128):
        qv = gl.floor(gl.div_rn(vs[h] - vmin, gl.zeros([128], gl.float32, layout=_TOK) + scale)
                      + 0.5)
        codes = codes + (gl.minimum(gl.maximum(qv, 0.0), LEVELS * 1.0).to(gl.int32),)
    return codes, scale, vmin


@gluon.jit
def _store_words3(page, code, kk, lane, off, OFF: gl.constexpr, BS: gl.constexpr,
                  WORDS: gl.constexpr):
    """3-bit codes [128] as 16 column-major words of 8 codes (codes 0-5 in nibbles, 6-7
    bit-spread: tqattn.quant.paged) of a field of WORDS words: byte s of word g of token off at
    OFF + (WORDS·s + g)·BS + off. A word spans lanes 2g and 2g + 1."""
    i8 = kk % 8
    spread = (code & 1) | ((code & 2) << 7) | ((code & 4) << 14)
    bits = gl.where(i8 < 6, code << (4 * i8), spread << gl.maximum(4 * i8 - 21, 0))
    half = gl.convert_layout(gl.sum(gl.reshape(bits, [32, 4]), axis=1), _LANE)
    word = half | _bfly(half, 1)
    kp = page + OFF + (lane // 2) * BS + off
    for sp in gl.static_range(3):
        gl.store(kp + sp * WORDS * BS, ((word >> (8 * sp)) & 255).to(gl.uint8),
                 mask=lane % 2 == 0)


@gluon.jit
def _store_row4(page, code, kk, off, OFF: gl.constexpr, ROW: gl.constexpr):
    """4-bit codes [128] as 64 bytes of token off's ROW-byte row at OFF (coordinate 2j in byte
    j's low nibble)."""
    pairs = gl.convert_layout(gl.sum(gl.reshape(code << (4 * (kk % 2)), [64, 2]), axis=1), _B64)
    gl.store(page + OFF + ROW * off + gl.arange(0, 64, layout=_B64), pairs.to(gl.uint8))


@gluon.jit
def _store_codes(page, codes, kk, lane, off, OFF: gl.constexpr, BS: gl.constexpr,
                 CM: gl.constexpr, D: gl.constexpr):
    """Each half's codes [128] of token off into the field at OFF: 3-bit column-major words
    (CM; the second half from word 16 on) or 4-bit token rows (the second half from byte 64)."""
    for h in gl.static_range(D // 128):
        if CM:
            _store_words3(page, codes[h], kk, lane, off, OFF + 16 * BS * h, BS, D // 8)
        else:
            _store_row4(page, codes[h], kk, off, OFF + 64 * h, D // 2)


@gluon.jit
def _store_scalar(fp16p, x, lane, OFF: gl.constexpr):
    """One fp16 scalar of the token (fp16p: its first plane's entry) at plane offset OFF."""
    zero = gl.zeros([32], gl.float32, layout=_LANE)
    gl.store(fp16p + OFF // 2 + 0 * lane, (zero + x).to(gl.float16), mask=lane == 0)


@gluon.jit
def _store_new_token(kn_ptr, skn_b, skn_h, vn_ptr, svn_b, svn_h, slot_ptr, ftab_ptr, ksgn_ptr,
                     cache_ptr, sc_b, sc_h, b, kvh, BS: gl.constexpr, K_OFF: gl.constexpr,
                     KN_OFF: gl.constexpr, V_OFF: gl.constexpr, VS_OFF: gl.constexpr,
                     VZ_OFF: gl.constexpr, K_LUT: gl.constexpr, K_BND: gl.constexpr,
                     V_LUT: gl.constexpr, V_BND: gl.constexpr, K_FOLD: gl.constexpr,
                     V_FOLD: gl.constexpr, KEYS: gl.constexpr, VALS: gl.constexpr,
                     KSM: gl.constexpr, VSM: gl.constexpr, D: gl.constexpr):
    """STORE: encode sequence b's new token of KV head kvh into the page at slot_ptr[b] (negative:
    padding, nothing written) — the math of kernels/store.py, with the rotation as a
    Walsh–Hadamard transform (R = diag(s)·H/√D, D = 128 or 256; ksgn_ptr: s/√D) in fp32 instead
    of TF32 dots: codes can differ from the store kernel's where a coordinate sits on a bucket
    boundary. Keys: 3-bit centroid codes in column-major words with folded norm (KEYS 0) or
    4-bit codes in token rows (KEYS 1); values: 4-bit uniform in token rows (VALS 0), rotated
    3-bit in column-major words with their norm (VALS 1), 3-bit uniform in column-major words
    (VALS 2); non-finite rows store NaN norms / scales. One warp, 4 coordinates of each 128-half
    per lane. PyTorch twin: :func:`store_new_token_ref`."""
    slot = gl.load(slot_ptr + b).to(gl.int64)
    if slot >= 0:
        off = slot % BS
        page = cache_ptr + (slot // BS) * sc_b + kvh.to(gl.int64) * sc_h
        kk = gl.arange(0, 128, layout=_TOK)
        lane = gl.arange(0, 32, layout=_LANE)
        fp16p = (page + 2 * off).to(gl.pointer_type(gl.float16))
        x, bad = _row_halves(kn_ptr, b.to(gl.int64) * skn_b + kvh * skn_h, kk, D)
        v, vbad = _row_halves(vn_ptr, b.to(gl.int64) * svn_b + kvh * svn_h, kk, D)
        # both rows encoded before any store: a store may alias the tables' loads, so the value
        # row's encode would otherwise wait behind the key's stores
        code, kn = _lloyd_max(x, ksgn_ptr, ftab_ptr, kk, K_LUT, K_BND, 3 + KEYS, K_FOLD, KSM, D)
        if VALS == 1 or VALS == 3:
            vcode, vnrm = _lloyd_max(v, ksgn_ptr, ftab_ptr, kk, V_LUT, V_BND, 3 + VALS // 3,
                                     V_FOLD, VSM, D)
        else:
            vcode, vnrm, vmin = _uniform_codes(v, 15 if VALS == 0 else 7, D)
        _store_codes(page, code, kk, lane, off, K_OFF, BS, KEYS == 0, D)
        _store_scalar(fp16p, gl.where(bad, float("nan"), kn), lane, KN_OFF)
        _store_codes(page, vcode, kk, lane, off, V_OFF, BS, VALS == 1 or VALS == 2, D)
        _store_scalar(fp16p, gl.where(vbad, float("nan"), vnrm), lane, VS_OFF)
        if VALS == 0 or VALS == 2:
            _store_scalar(fp16p, vmin, lane, VZ_OFF)
    # the warp reads this token's page back in its last tile
    gl.thread_barrier()


def operand_coord(k: torch.Tensor, keys: int = 0, d: int = 128) -> torch.Tensor:
    """Rotated coordinate of operand column k at head size d: σ(k) (the kernel writes the same
    bit operations inline). 3-bit keys (keys 0): swaps bits 1-2 with bits 3-4 (its own
    inverse); 4-bit keys (keys 1): lane t's row bytes hold coordinates d/4·t..
    (:func:`_key_rows4`); at 256 the 128 map within each half."""
    if d == 256:
        return operand_coord(k % 128, keys) + 128 * (k // 128)
    if keys == 0:
        return (k & 0x61) | ((k >> 2) & 6) | ((k << 2) & 0x18)
    if d == 64:
        return (k & 1) | ((k >> 2) & 0xE) | ((k << 3) & 0x30)
    return (k & 1) | ((k >> 2) & 0x1E) | ((k << 4) & 0x60)   # keys 1 and fp8 keys (2)


def value_row_coord(r: torch.Tensor, d: int = 128, vals: int = 0) -> torch.Tensor:
    """Coordinate of row ρ of Vᵀ and of the output accumulator: d/8·(ρ % 8) + ρ // 8 (at 256
    the 128 map within each half); 3-bit column-major values (vals 1, 2) at d ≥ 128: 8(ρ % 8)
    + (ρ // 8) % 8 + 64(ρ // 64)."""
    if d > 64 and vals in (1, 2):
        return 8 * (r % 8) + (r // 8) % 8 + 64 * (r // 64)
    if d == 256:
        return value_row_coord(r % 128) + 128 * (r // 128)
    return d // 8 * (r % 8) + r // 8


def _wht128_ref(x: torch.Tensor) -> torch.Tensor:
    """:func:`_wht128` on rows x (n, 128) fp32: the butterflies over bits 0..6 of the index in
    the kernel's order, (u + v, u − v) each."""
    for b in range(7):
        y = x.reshape(-1, 128 >> (b + 1), 2, 1 << b)
        x = torch.stack([y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]], 2).reshape(-1, 128)
    return x


def store_new_token_ref(spec, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> None:
    """PyTorch twin of :func:`_store_new_token` (key/value (N, Hk, D), D = 128 or 256, one token
    per entry of slot_mapping; negative slots store nothing): the same fp32 transform, codes and
    fp64 folding, packed by the page format's own packers, written into kv_cache in place."""
    m, fmt, kf, vf = spec.layout, spec.mma, spec.key_fields[0], spec.value_fields[0]
    if not fmt or not fmt.store:
        raise ValueError(f"{spec.codec.preset.name}: the tensor-core kernel does not store its "
                         f"tokens")
    bs, tab, d = spec.block_size, spec.table.float(), m.d
    sgn = torch.sign(spec.codec.rotation.float().cpu()[:, 0]) / d ** 0.5
    keep = slot_mapping.cpu() >= 0
    k = key.detach().float().cpu()[keep].reshape(-1, d)
    v = value.detach().float().cpu()[keep].reshape(-1, d)
    hk = key.shape[1]
    slots = slot_mapping.cpu()[keep].repeat_interleave(hk)
    heads = torch.arange(hk).repeat(int(keep.sum()))

    def rows(x):
        bad = ~torch.isfinite(x).all(1)
        return torch.where(bad[:, None], 0.0, x), bad

    def wht(x):              # at 256: [H(a + b), H(a − b)] of the halves
        if d == 128:
            return _wht128_ref(x)
        a, b = x[:, :128], x[:, 128:]
        return torch.cat([_wht128_ref(a + b), _wht128_ref(a - b)], 1)

    def lloyd_max(x, lut, bnd, bits, fold, sm):
        nrm = x.square().sum(1).sqrt()
        y = wht(x * sgn) / (nrm + 1e-8)[:, None]
        code = (y[:, :, None] > tab[bnd:bnd + (1 << bits) - 1]).sum(2)
        if sm:
            code = sign_magnitude(code)
        if fold:
            c = tab[lut:lut + (1 << bits)][code].double()
            nrm = (nrm.double() / c.square().sum(1).sqrt()).float()
        return code, nrm

    def uniform(x, levels):
        vmin = x.min(1).values
        scale = torch.clamp((x.max(1).values - vmin) / levels, min=1e-8)
        q = torch.floor((x - vmin[:, None]) / scale[:, None] + 0.5).clamp(0, levels).long()
        return q, scale, vmin

    flat = kv_cache.view(kv_cache.shape[0], kv_cache.shape[1], -1)
    kx, kbad = rows(k)
    vx, vbad = rows(v)
    code, kn = lloyd_max(kx, kf.lut, kf.bnd, 3 + fmt.keys, m.k_corr == 1, kf.sm)
    t = slots % bs
    dev = kv_cache.device
    blk, hd = (slots // bs).to(dev)[:, None], heads.to(dev)[:, None]

    def put(pos, data):      # pos, data (n, m): byte positions in each token's page
        flat[blk, hd, pos.to(dev)] = data.to(torch.uint8).to(dev)

    def write3(off, code):   # byte s of word g at (D/8·s + g)·BS: column-major sub-planes
        w = page_word_bytes(code).reshape(-1, d // 8, 3)
        g = torch.arange(d // 8)
        for sp in range(3):
            put(off + (d // 8 * sp + g) * bs + t[:, None], w[:, :, sp])

    def write4(off, code):   # token rows of D/2 bytes
        put(off + d // 2 * t[:, None] + torch.arange(d // 2), pack_bits(code, 4))

    def write16(off, x):
        put(off + 2 * t[:, None] + torch.arange(2),
            x.to(torch.float16).view(torch.uint8).reshape(-1, 2))

    (write3 if fmt.keys == 0 else write4)(kf.off, code)
    write16(m.kn_off, torch.where(kbad, float("nan"), kn))
    if fmt.rotated_values:
        vcode, vn = lloyd_max(vx, vf.lut, vf.bnd, 3 + fmt.vals // 3, m.v_corr == 1, vf.sm)
        (write3 if fmt.vals == 1 else write4)(vf.off, vcode)
        write16(m.vn_off, torch.where(vbad, float("nan"), vn))
    else:
        q, scale, vmin = uniform(vx, 15 if fmt.vals == 0 else 7)
        (write4 if fmt.vals == 0 else write3)(vf.off, q)
        write16(m.vs_off, torch.where(vbad, float("nan"), scale))
        write16(m.vz_off, vmin)


def fused_query_ref(q: torch.Tensor, sgn: torch.Tensor, scale: float, keys: int = 0) -> torch.Tensor:
    """PyTorch twin of :func:`_fused_query` for q (rows, D), D = 64, 128 or 256: the same
    permuted load and the same butterflies, in the same order → fp16 (rows, D), equal to
    fp16((q·R[:, σ])·scale) up to fp32 rounding."""
    d = q.shape[-1]
    sk = operand_coord(torch.arange(d, device=q.device), keys, d)
    if keys == 2:  # fp8 keys are not rotated: the permuted, scaled query
        return (q.float()[:, sk] * scale).to(torch.float16)
    x = (q.float()[:, sk] * sgn.to(q.device)).T.contiguous()          # [D, rows] as [k, n]
    rows = x.shape[1]

    def wht(x):                         # _wht_rows / _wht_rows64
        n = x.shape[0]
        lanes = n // 4                  # rows held per thread before the regrouping (_QL*)

        def stage(x, b):
            y = x.reshape(n // (2 * b), 2, b, rows)
            return torch.stack([y[:, 0] + y[:, 1], y[:, 0] - y[:, 1]], 1).reshape(n, rows)

        for b in (1, 2, 4, 8, 16)[:(lanes.bit_length() - 1)]:
            x = stage(x, b)
        x = x.reshape(4, lanes, rows).permute(1, 0, 2).reshape(n, rows)
        x = stage(stage(x, 1), 2)
        return x.reshape(lanes, 4, rows).permute(1, 0, 2).reshape(n, rows)

    if d == 256:
        x = torch.cat([wht(x[:128] + x[128:]), wht(x[:128] - x[128:])])
    else:
        x = wht(x)
    return (x * scale).to(torch.float16).T.contiguous()


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
def _lut3(a, b, c, tab):
    return gl.inline_asm_elementwise(LUT3_ROWS, "=r," * 16 + "r," * 6 + "r",
                                     [a, b, c, tab[0], tab[1], tab[2], tab[3]], (gl.int32,) * 16,
                                     is_pure=True, pack=1)


@gluon.jit
def _key_calls(kw, m: gl.constexpr, tab):
    """Code word t + 4m: three sub-plane words (int64: tokens 8g..8g+3 | 8g+4..8g+7)."""
    a0, a1 = _lo_hi(kw[3 * m])
    b0, b1 = _lo_hi(kw[3 * m + 1])
    c0, c1 = _lo_hi(kw[3 * m + 2])
    return _j16(_lut3(a0, b0, c0, tab)), _j16(_lut3(a1, b1, c1, tab))


# prmt selectors: bytes 0, 2, 4, 6 / 1, 3, 5, 7 of the pair (b:a)
EVEN_BYTES = gl.constexpr(0x6420)
ODD_BYTES = gl.constexpr(0x7531)


@gluon.jit
def _prmt(a, b, sel: gl.constexpr):
    return gl.inline_asm_elementwise(f"prmt.b32 $0, $1, $2, {sel};", "=r,r,r", [a, b],
                                     dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _parity_word(w, odd):
    """MAP 1: one sub-plane word of the lane's tokens 8g..8g+7 (byte i: token 8g + i) → the
    word whose byte j is token 16(g // 2) + g % 2 + 2j. Lanes g and g ^ 1 (lane ^ 4) hold the
    two halves of those 16 tokens: each keeps its own tokens of its parity and trades the others."""
    lo, hi = _lo_hi(w)
    ev = _prmt(lo, hi, EVEN_BYTES)  # tokens 0, 2, 4, 6 of the lane's 8
    od = _prmt(lo, hi, ODD_BYTES)   # tokens 1, 3, 5, 7
    keep = gl.where(odd, od, ev)
    got = _bfly(gl.where(odd, ev, od), 4)
    first = gl.where(odd, got, keep)
    last = gl.where(odd, keep, got)
    return (first.to(gl.int64) & 0xFFFFFFFF) | (last.to(gl.int64) << 32)


@gluon.jit
def _key_rows(kw, tab, MAP: gl.constexpr, D: gl.constexpr):
    """K [64 rows, D columns] (128 of a half at D = 256) fp16 from the lane's key words
    (_load_tile); row g + 8i is token 8g + i (MAP 0) or 16(g // 2) + g % 2 + 2i (MAP 1)."""
    if MAP == 1:
        odd = ((gl.arange(0, 32, layout=_LANE) // 4) % 2) == 1
        pw = (_parity_word(kw[0], odd), _parity_word(kw[1], odd), _parity_word(kw[2], odd),
              _parity_word(kw[3], odd), _parity_word(kw[4], odd), _parity_word(kw[5], odd))
        if D == 128:
            pw = pw + (_parity_word(kw[6], odd), _parity_word(kw[7], odd),
                       _parity_word(kw[8], odd), _parity_word(kw[9], odd),
                       _parity_word(kw[10], odd), _parity_word(kw[11], odd))
        kw = pw
    l0, h0 = _key_calls(kw, 0, tab)
    l1, h1 = _key_calls(kw, 1, tab)
    if D != 64:
        l2, h2 = _key_calls(kw, 2, tab)
        l3, h3 = _key_calls(kw, 3, tab)
        x = gl.join(_j4(l0, l1, l2, l3), _j4(h0, h1, h2, h3))
        # [lane, e0, e1, p0, p1, m0, m1, r7] → halves → [g, t, e0, e1, p0, p1, m0, m1, r7, h]
        x = gl.reshape(_halves(x), [8, 4, 2, 2, 2, 2, 2, 2, 2, 2])
        # row = g + 8 e0 + 16 e1 + 32 r7; column = h + 2t + 8 p0 + 16 p1 + 32 m0 + 64 m1
        x = gl.permute(x, [8, 3, 2, 0, 7, 6, 5, 4, 1, 9])
    else:
        x = gl.join(gl.join(l0, l1), gl.join(h0, h1))
        # [lane, e0, e1, p0, p1, m0, r7] → halves → [g, t, e0, e1, p0, p1, m0, r7, h]
        x = gl.reshape(_halves(x), [8, 4, 2, 2, 2, 2, 2, 2, 2])
        # row = g + 8 e0 + 16 e1 + 32 r7; column = h + 2t + 8 p0 + 16 p1 + 32 m0
        x = gl.permute(x, [7, 3, 2, 0, 6, 5, 4, 1, 8])
    return gl.reshape(x, [64, 64 if D == 64 else 128])


@gluon.jit
def _u4(a, b):
    return gl.inline_asm_elementwise(U4_PAIRS, "=r," * 8 + "r,r", [a, b], (gl.int32,) * 8,
                                     is_pure=True, pack=1)


@gluon.jit
def _lut4p(a, b, tab):
    return gl.inline_asm_elementwise(LUT4_PAIRS, "=r," * 8 + "r," * 5 + "r",
                                     [a, b, tab[0], tab[1], tab[2], tab[3]], (gl.int32,) * 8,
                                     is_pure=True, pack=1)


@gluon.jit
def _pairs4(a, b, tab, LUT: gl.constexpr):
    """:data:`_asm.U4_PAIRS` (uniform codes) or, with LUT, :data:`_asm.LUT4_PAIRS` (the
    symmetric codebook of rotated values, table words tab)."""
    if LUT:
        o = _lut4p(a, b, tab)
    else:
        o = _u4(a, b)
    return o


@gluon.jit
def _value_calls(vw, j: gl.constexpr, tab, LUT: gl.constexpr, D: gl.constexpr):
    """Tokens 16t + j (A) and 16t + 8 + j (B): bytes 8g..8g+7 (int64) each; head size 64:
    bytes 4g..4g+3 (int32)."""
    if D != 64:
        a0, a1 = _lo_hi(vw[2 * j])
        b0, b1 = _lo_hi(vw[2 * j + 1])
        x = gl.join(_j8(_pairs4(a0, b0, tab, LUT)), _j8(_pairs4(a1, b1, tab, LUT)))
    else:
        x = _j8(_pairs4(vw[2 * j], vw[2 * j + 1], tab, LUT))
    return x


@gluon.jit
def _value_rows(vw, tab, LUT: gl.constexpr, D: gl.constexpr):
    """Vᵀ [D rows, 64 columns] (128 of a half at D = 256) fp16 from the lane's 16 value words
    (_load_tile): uniform codes, or with LUT rotated codes through the table words tab."""
    x = gl.join(_j4(_value_calls(vw, 0, tab, LUT, D), _value_calls(vw, 1, tab, LUT, D),
                    _value_calls(vw, 2, tab, LUT, D), _value_calls(vw, 3, tab, LUT, D)),
                _j4(_value_calls(vw, 4, tab, LUT, D), _value_calls(vw, 5, tab, LUT, D),
                    _value_calls(vw, 6, tab, LUT, D), _value_calls(vw, 7, tab, LUT, D)))
    if D != 64:
        # [lane, nib, b0, b1, w, j0, j1, j2] → halves → [g, t, nib, b0, b1, w, j0, j1, j2, h]
        x = gl.reshape(_halves(x), [8, 4, 2, 2, 2, 2, 2, 2, 2, 2])
        # row = g + 8 nib + 16 b0 + 32 b1 + 64 w; column = h + 2t + 8 j0 + 16 j1 + 32 j2
        x = gl.permute(x, [5, 4, 3, 2, 0, 8, 7, 6, 1, 9])
    else:
        # [lane, nib, b0, b1, j0, j1, j2] → halves → [g, t, nib, b0, b1, j0, j1, j2, h]
        x = gl.reshape(_halves(x), [8, 4, 2, 2, 2, 2, 2, 2, 2])
        # row = g + 8 nib + 16 b0 + 32 b1; column = h + 2t + 8 j0 + 16 j1 + 32 j2
        x = gl.permute(x, [4, 3, 2, 0, 7, 6, 5, 1, 8])
    return gl.reshape(x, [64 if D == 64 else 128, 64])


@gluon.jit
def _lut4(x, tab, SM: gl.constexpr):
    """SM: codes in sign-and-magnitude order (the tq_* presets')."""
    return gl.inline_asm_elementwise(LUT4_ROWS_SM if SM else LUT4_ROWS, "=r," * 4 + "r," * 4 + "r",
                                     [x, tab[0], tab[1], tab[2], tab[3]], (gl.int32,) * 4,
                                     is_pure=True, pack=1)


@gluon.jit
def _key_row4_8(w, tab, SM: gl.constexpr):
    """One token's 8 row bytes (int64: 16 4-bit codes) → [32, r0, r1, q0] fp16 pairs of byte
    4q + r."""
    a0, a1 = _lo_hi(w)
    o0 = _lut4(a0, tab, SM)
    o1 = _lut4(a1, tab, SM)
    return gl.join(_j4(o0[0], o0[1], o0[2], o0[3]), _j4(o1[0], o1[1], o1[2], o1[3]))


@gluon.jit
def _key_row4(lo, hi, tab, SM: gl.constexpr):
    """One token's 16 row bytes (two int64: 32 4-bit codes) → [32, r0, r1, q0, q1] fp16 pairs
    of byte 4q + r."""
    return gl.join(_key_row4_8(lo, tab, SM), _key_row4_8(hi, tab, SM))


@gluon.jit
def _key_rows4(kw, tab, D: gl.constexpr, SM: gl.constexpr):
    """K [64 rows, D columns] (128 of a half at D = 256) fp16 of 4-bit row keys
    (:func:`_load_keys4`): row g + 8j is the lane's token j, column e + 2t + 8r + 32q its
    byte 4q + r's nibble e (of its bytes 16t.. at head size 128, 8t.. at 64)."""
    if D != 64:
        x = _j8((_key_row4(kw[0], kw[1], tab, SM), _key_row4(kw[2], kw[3], tab, SM),
                 _key_row4(kw[4], kw[5], tab, SM), _key_row4(kw[6], kw[7], tab, SM),
                 _key_row4(kw[8], kw[9], tab, SM), _key_row4(kw[10], kw[11], tab, SM),
                 _key_row4(kw[12], kw[13], tab, SM), _key_row4(kw[14], kw[15], tab, SM)))
        # [lane, r0, r1, q0, q1, j0, j1, j2] → halves → [g, t, r0, r1, q0, q1, j0, j1, j2, e]
        x = gl.reshape(_halves(x), [8, 4, 2, 2, 2, 2, 2, 2, 2, 2])
        x = gl.permute(x, [8, 7, 6, 0, 5, 4, 3, 2, 1, 9])
    else:
        x = _j8((_key_row4_8(kw[0], tab, SM), _key_row4_8(kw[1], tab, SM),
                 _key_row4_8(kw[2], tab, SM), _key_row4_8(kw[3], tab, SM),
                 _key_row4_8(kw[4], tab, SM), _key_row4_8(kw[5], tab, SM),
                 _key_row4_8(kw[6], tab, SM), _key_row4_8(kw[7], tab, SM)))
        # [lane, r0, r1, q0, j0, j1, j2] → halves → [g, t, r0, r1, q0, j0, j1, j2, e]
        x = gl.reshape(_halves(x), [8, 4, 2, 2, 2, 2, 2, 2, 2])
        x = gl.permute(x, [7, 6, 5, 0, 4, 3, 2, 1, 8])
    return gl.reshape(x, [64, 64 if D == 64 else 128])


@gluon.jit
def _cat_rows(a, b):
    """[m, n] and [m, n] → [2m, n] (b's rows after a's)."""
    m: gl.constexpr = a.shape[0]
    n: gl.constexpr = a.shape[1]
    return gl.reshape(gl.permute(gl.join(a, b), [2, 0, 1]), [2 * m, n])


@gluon.jit
def _key_operand(kw, tab, KEYS: gl.constexpr, MAP: gl.constexpr, D: gl.constexpr,
                 KSM: gl.constexpr):
    """K [64, D] A operand of rotated keys (D ≤ 128; KEYS 0: :func:`_key_rows`, 1:
    :func:`_key_rows4`)."""
    if KEYS == 0:
        x = _key_rows(kw, tab, MAP, D)
    else:
        x = _key_rows4(kw, tab, D, KSM)
    return gl.convert_layout(x, _OP_A)


@gluon.jit
def _value_operand(vw, tab, VALS: gl.constexpr, D: gl.constexpr):
    """Vᵀ [D, 64] A operand (D ≤ 128; VALS 0, 3: :func:`_value_rows`; 1, 2:
    :func:`_value_rows3`)."""
    if VALS == 0 or VALS == 3:
        x = _value_rows(vw, tab, VALS == 3, D)
    else:
        x = _value_rows3(vw, tab, D)
    return gl.convert_layout(x, _OP_A)


@gluon.jit
def _e4m3x4(x):
    """int32 of 4 e4m3 bytes → fp16 pairs of bytes (0, 1) and (2, 3)."""
    return gl.inline_asm_elementwise("{ .reg .b16 l, h; mov.b32 {l, h}, $2; "
                                     "cvt.rn.f16x2.e4m3x2 $0, l; cvt.rn.f16x2.e4m3x2 $1, h; }",
                                     "=r,=r,r", [x], (gl.int32, gl.int32), is_pure=True, pack=1)


@gluon.jit
def _key_row8(w0, w1, w2, w3):
    """One token's 32 fp8 row bytes (four int64) → [32, r0, c0, c1, c2] fp16 pairs of bytes
    4c + 2r0, +1 (as :func:`_key_row4`'s [32, r0, r1, q0, q1] for byte 4q + r)."""
    a0, a1 = _lo_hi(w0)
    a2, a3 = _lo_hi(w1)
    a4, a5 = _lo_hi(w2)
    a6, a7 = _lo_hi(w3)
    p0, q0 = _e4m3x4(a0)
    p1, q1 = _e4m3x4(a1)
    p2, q2 = _e4m3x4(a2)
    p3, q3 = _e4m3x4(a3)
    p4, q4 = _e4m3x4(a4)
    p5, q5 = _e4m3x4(a5)
    p6, q6 = _e4m3x4(a6)
    p7, q7 = _e4m3x4(a7)
    return _j16((p0, q0, p1, q1, p2, q2, p3, q3, p4, q4, p5, q5, p6, q6, p7, q7))


@gluon.jit
def _key_operand8(kw):
    """K [64 rows, 128 columns] fp16 A operand of fp8 row keys (:func:`_load_keys8`): row
    g + 8j is the lane's token j, column e + 2t + 8r0 + 16c its row byte 32t + 4c + 2r0 + e —
    the 4-bit keys' columns (:func:`operand_coord` with keys 1)."""
    x = _j8((_key_row8(kw[0], kw[1], kw[2], kw[3]), _key_row8(kw[4], kw[5], kw[6], kw[7]),
             _key_row8(kw[8], kw[9], kw[10], kw[11]), _key_row8(kw[12], kw[13], kw[14], kw[15]),
             _key_row8(kw[16], kw[17], kw[18], kw[19]), _key_row8(kw[20], kw[21], kw[22], kw[23]),
             _key_row8(kw[24], kw[25], kw[26], kw[27]), _key_row8(kw[28], kw[29], kw[30], kw[31])))
    # [lane, r0, c0, c1, c2, j0, j1, j2] → halves → [g, t, r0, c0, c1, c2, j0, j1, j2, e]
    x = gl.reshape(_halves(x), [8, 4, 2, 2, 2, 2, 2, 2, 2, 2])
    x = gl.permute(x, [8, 7, 6, 0, 5, 4, 3, 2, 1, 9])
    return gl.convert_layout(gl.reshape(x, [64, 128]), _OP_A)


@gluon.jit
def _lut3_tokens(a, b, c, tab):
    return gl.inline_asm_elementwise(LUT3_TOKENS, "=r," * 16 + "r," * 6 + "r",
                                     [a, b, c, tab[0], tab[1], tab[2], tab[3]], (gl.int32,) * 16,
                                     is_pure=True, pack=1)


@gluon.jit
def _value_word3(vw, W: gl.constexpr, tab):
    """Code word g + 8W of the lane's 16 tokens (:func:`_load_values3`) → [32, h, c0, c1, c2,
    kb0, kb1] fp16 pairs: code c of tokens 4kb + 2h, +1."""
    a0, a1 = _lo_hi(vw[6 * W])
    b0, b1 = _lo_hi(vw[6 * W + 2])
    c0, c1 = _lo_hi(vw[6 * W + 4])
    d0, d1 = _lo_hi(vw[6 * W + 1])
    e0, e1 = _lo_hi(vw[6 * W + 3])
    f0, f1 = _lo_hi(vw[6 * W + 5])
    return _j4(_j16(_lut3_tokens(a0, b0, c0, tab)), _j16(_lut3_tokens(a1, b1, c1, tab)),
               _j16(_lut3_tokens(d0, e0, f0, tab)), _j16(_lut3_tokens(d1, e1, f1, tab)))


@gluon.jit
def _value_rows3(vw, tab, D: gl.constexpr):
    """Vᵀ [D rows, 64 columns] (128 of a half at D = 256) fp16 of 3-bit column-major values:
    row g + 8i is coordinate 8g + 64(i // 8) + i % 8 (head size 64: 8g + i), column e + 2t + 8h
    + 16kb token 16t + 4kb + 2h + e."""
    if D != 64:
        x = gl.join(_value_word3(vw, 0, tab), _value_word3(vw, 1, tab))
        # [lane, h, c0, c1, c2, kb0, kb1, w] → halves → [g, t, h, c0, c1, c2, kb0, kb1, w, e]
        x = gl.reshape(_halves(x), [8, 4, 2, 2, 2, 2, 2, 2, 2, 2])
        x = gl.permute(x, [8, 5, 4, 3, 0, 7, 6, 2, 1, 9])
    else:
        # [lane, h, c0, c1, c2, kb0, kb1] → halves → [g, t, h, c0, c1, c2, kb0, kb1, e]
        x = gl.reshape(_halves(_value_word3(vw, 0, tab)), [8, 4, 2, 2, 2, 2, 2, 2, 2])
        x = gl.permute(x, [5, 4, 3, 0, 7, 6, 2, 1, 8])
    return gl.reshape(x, [64 if D == 64 else 128, 64])


@gluon.jit
def _f16x2(x):
    """int32 fp16 pair → (low, high) as fp32."""
    return gl.inline_asm_elementwise("{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; "
                                     "cvt.f32.f16 $1, h; }", "=r,=r,r", [x],
                                     (gl.float32, gl.float32), is_pure=True, pack=1)


@gluon.jit
def _row_scalars(w, MAP: gl.constexpr):
    """The lane's 8 fp16 scalars of one role → fp32 [64, 8] in the score layout (row g + 8i,
    both heads of the lane). MAP 0: tokens 8g + i, two int64 words (:func:`_load_tile`); MAP 1:
    tokens 16(g // 2) + 2i + g % 2 of four int64 words (tokens 16(g // 2) + 0..15)."""
    if MAP == 0:
        a0, a1 = _lo_hi(w[0])
        a2, a3 = _lo_hi(w[1])
        v0, v1 = _f16x2(a0)
        v2, v3 = _f16x2(a1)
        v4, v5 = _f16x2(a2)
        v6, v7 = _f16x2(a3)
    else:
        odd = ((gl.arange(0, 32, layout=_LANE) // 4) % 2) == 1
        a0, a1 = _lo_hi(w[0])
        a2, a3 = _lo_hi(w[1])
        a4, a5 = _lo_hi(w[2])
        a6, a7 = _lo_hi(w[3])
        v0 = _odd_half(a0, odd)
        v1 = _odd_half(a1, odd)
        v2 = _odd_half(a2, odd)
        v3 = _odd_half(a3, odd)
        v4 = _odd_half(a4, odd)
        v5 = _odd_half(a5, odd)
        v6 = _odd_half(a6, odd)
        v7 = _odd_half(a7, odd)
    x = gl.join(_j4(gl.join(v0, v0), gl.join(v1, v1), gl.join(v2, v2), gl.join(v3, v3)),
                _j4(gl.join(v4, v4), gl.join(v5, v5), gl.join(v6, v6), gl.join(v7, v7)))
    # [lane, h, i0, i1, i2] → [g, t, h, i0, i1, i2]; row = g + 8i, column = h + 2t
    x = gl.permute(gl.reshape(x, [8, 4, 2, 2, 2, 2]), [5, 4, 3, 0, 1, 2])
    return gl.convert_layout(gl.reshape(x, [64, 8]), _MMA)


@gluon.jit
def _odd_half(x, odd):
    """The high fp16 of an int32 pair where odd, else the low one, as fp32."""
    lo, hi = _f16x2(x)
    return gl.where(odd, hi, lo)


@gluon.jit
def _load16(p, buf=None, S: gl.constexpr = 0, MODE: gl.constexpr = 0):
    """16 bytes at p (int64 pointers, 16-byte aligned) per lane as two int64 [32] words
    (MODE 1, 2: :func:`_word` of slots S, S + 1)."""
    if MODE == 0:
        pp = gl.convert_layout(p, gl.SliceLayout(1, _PAIR))[:, None] + \
            gl.arange(0, 2, layout=gl.SliceLayout(0, _PAIR))[None, :]
        lo, hi = gl.split(gl.load(pp))
        lo = gl.convert_layout(lo, _LANE)
        hi = gl.convert_layout(hi, _LANE)
    else:
        lo = _word(p, buf, S, MODE)
        hi = _word(p + 1, buf, S + 1, MODE)
    return lo, hi


@gluon.jit
def _word(p, buf, S: gl.constexpr, MODE: gl.constexpr):
    """The lane's int64 word at p: loaded (MODE 0), copied asynchronously into slot S of buf
    (a tuple of [32] shared allocations; MODE 1, returns p), or read back from it (MODE 2)."""
    if MODE == 0:
        w = gl.load(p)
    elif MODE == 1:
        async_copy.async_copy_global_to_shared(buf[S], p)
        w = p
    else:
        w = buf[S].load(_LANE)
    return w


@gluon.jit
def _pages(t, seq_len, bt_row, lane, BS: gl.constexpr, MAP: gl.constexpr):
    """The lane's two page indices in tile t (key rows 8g.. (MAP 0) or 16(g // 2).. (MAP 1),
    value rows 16t..); past the sequence: page 0 (finite codes; those tokens are masked)."""
    if MAP == 0:
        tg = t * TILE + 8 * (lane // 4)
    else:
        tg = t * TILE + 16 * (lane // 8)
    tt = t * TILE + 16 * (lane % 4)
    return (gl.load(bt_row + tg // BS, mask=tg < seq_len, other=0),
            gl.load(bt_row + tt // BS, mask=tt < seq_len, other=0))


@gluon.jit
def _scalars16(t, pages, page0, lane, sc_b, BS: gl.constexpr, OFF: gl.constexpr, buf=None,
               S: gl.constexpr = 0, MODE: gl.constexpr = 0):
    """MAP 1: the 4 int64 words of the fp16 scalars (plane OFF) of the key rows' tokens
    16(g // 2) + 0..15 (in the key row's page). buf, S, MODE: :func:`_word` (slots S..S + 3)."""
    tg = t * TILE + 16 * (lane // 8)
    sp = (page0 + pages[0].to(gl.int64) * sc_b + OFF + 2 * (tg % BS)).to(gl.pointer_type(gl.int64))
    n0, n1 = _load16(sp, buf, S, MODE)
    n2, n3 = _load16(sp + 2, buf, S + 2, MODE)
    return (n0, n1, n2, n3)


@gluon.jit
def _load_keys(t, pages, page0, lane, sc_b, BS: gl.constexpr, K_OFF: gl.constexpr,
               KN_OFF: gl.constexpr, MAP: gl.constexpr, D: gl.constexpr, buf=None,
               S: gl.constexpr = 0, MODE: gl.constexpr = 0, NORMS: gl.constexpr = True):
    """The lane's key words of tile t (pages: :func:`_pages` of t): the three sub-plane words
    of code words t, t + 4, .. (12 at head size 128 and per half of 256 (K_OFF: the half's
    first word), 6 at 64) of its tokens 8g.. and the words of its fp16 key norms — of those 8
    tokens (MAP 0: 2 words) or of tokens 16(g // 2) + 0..15 (MAP 1: 4 words;
    :func:`_key_rows` trades the code words' tokens). buf, S, MODE: :func:`_word` (the code
    words in slots S.., then the norms'); NORMS False: no norms (kn: the first code word)."""
    tg = t * TILE + 8 * (lane // 4)
    pg = page0 + pages[0].to(gl.int64) * sc_b
    kb = (pg + K_OFF + (lane % 4) * BS + (tg % BS)).to(gl.pointer_type(gl.int64))
    SP: gl.constexpr = D // 64 * BS  # int64 words from one sub-plane to the next
    kw = (_word(kb, buf, S, MODE), _word(kb + SP, buf, S + 1, MODE),
          _word(kb + 2 * SP, buf, S + 2, MODE), _word(kb + BS // 2, buf, S + 3, MODE),
          _word(kb + BS // 2 + SP, buf, S + 4, MODE),
          _word(kb + BS // 2 + 2 * SP, buf, S + 5, MODE))
    if D != 64:
        kw = kw + (_word(kb + BS, buf, S + 6, MODE), _word(kb + BS + SP, buf, S + 7, MODE),
                   _word(kb + BS + 2 * SP, buf, S + 8, MODE),
                   _word(kb + 3 * BS // 2, buf, S + 9, MODE),
                   _word(kb + 3 * BS // 2 + SP, buf, S + 10, MODE),
                   _word(kb + 3 * BS // 2 + 2 * SP, buf, S + 11, MODE))
    N: gl.constexpr = 6 if D == 64 else 12
    if not NORMS:
        kn = kw[0]
    elif MAP == 1:
        kn = _scalars16(t, pages, page0, lane, sc_b, BS, KN_OFF, buf, S + N, MODE)
    else:
        # the lane's 8 scalars of a role are 16 contiguous bytes (offsets are multiples of 16)
        sp = (pg + 2 * (tg % BS)).to(gl.pointer_type(gl.int64))
        kn = _load16(sp + KN_OFF // 8, buf, S + N, MODE)
    return kw, kn


@gluon.jit
def _load_values(t, pages, page0, lane, sc_b, BS: gl.constexpr, V_OFF: gl.constexpr,
                 VS_OFF: gl.constexpr, VZ_OFF: gl.constexpr, D: gl.constexpr, buf=None,
                 S: gl.constexpr = 0, MODE: gl.constexpr = 0, SC: gl.constexpr = 2):
    """The lane's value words of tile t: row bytes 8g.. (4g.. at head size 64; of the half at
    V_OFF at 256) of its 16 tokens 16t.. (16 words, token j's and j + 8's in words 2j, 2j + 1:
    int64, int32 at 64), and 2 words each of the fp16 scales and zero points of its score rows
    (tokens 8g.., in the key row's page). buf, S, MODE: :func:`_word` (the row words in slots
    S.., then the scalars'); SC: scalars loaded — 2 both, 1 the scales (returned twice), 0
    none (the first row word instead)."""
    tg = t * TILE + 8 * (lane // 4)
    tt = t * TILE + 16 * (lane % 4)
    pg = page0 + pages[0].to(gl.int64) * sc_b
    pv = page0 + pages[1].to(gl.int64) * sc_b
    if D != 64:
        vb = (pv + V_OFF + (D // 2) * (tt % BS) + 8 * (lane // 4)).to(gl.pointer_type(gl.int64))
    else:
        vb = (pv + V_OFF + 32 * (tt % BS) + 4 * (lane // 4)).to(gl.pointer_type(gl.int32))
    TS: gl.constexpr = 8 if D == 64 else D // 16  # words from one token's row to the next
    vw = (_word(vb, buf, S, MODE), _word(vb + 8 * TS, buf, S + 1, MODE),
          _word(vb + TS, buf, S + 2, MODE), _word(vb + 9 * TS, buf, S + 3, MODE),
          _word(vb + 2 * TS, buf, S + 4, MODE), _word(vb + 10 * TS, buf, S + 5, MODE),
          _word(vb + 3 * TS, buf, S + 6, MODE), _word(vb + 11 * TS, buf, S + 7, MODE),
          _word(vb + 4 * TS, buf, S + 8, MODE), _word(vb + 12 * TS, buf, S + 9, MODE),
          _word(vb + 5 * TS, buf, S + 10, MODE), _word(vb + 13 * TS, buf, S + 11, MODE),
          _word(vb + 6 * TS, buf, S + 12, MODE), _word(vb + 14 * TS, buf, S + 13, MODE),
          _word(vb + 7 * TS, buf, S + 14, MODE), _word(vb + 15 * TS, buf, S + 15, MODE))
    sp = (pg + 2 * (tg % BS)).to(gl.pointer_type(gl.int64))
    if SC == 0:
        vs = (vw[0], vw[0])
        vz = vs
    else:
        vs = _load16(sp + VS_OFF // 8, buf, S + 16, MODE)
        if SC == 2:
            vz = _load16(sp + VZ_OFF // 8, buf, S + 18, MODE)
        else:
            vz = vs
    return vw, vs, vz


@gluon.jit
def _load_keys4(t, pages, page0, lane, sc_b, BS: gl.constexpr, K_OFF: gl.constexpr,
                KN_OFF: gl.constexpr, MAP: gl.constexpr, D: gl.constexpr, buf=None,
                S: gl.constexpr = 0, MODE: gl.constexpr = 0, NORMS: gl.constexpr = True):
    """4-bit row keys: the lane's row bytes of its 8 tokens — at head size 128 bytes 16t..
    (16 int64: token j's in words 2j, 2j + 1), at 64 bytes 8t.. (8 int64: token j's in word
    j) — and the words of their fp16 key norms. MAP 1: tokens 16(g // 2) + g % 2 + 2j, the 4
    norm words of tokens 16(g // 2) + 0..15; MAP 0 (the order 4-bit uniform values fix):
    tokens 8g + j, the 2 norm words of those 8 tokens. buf, S, MODE, NORMS: as
    :func:`_load_keys`'s (head size 128 and 256 only for MODE 1, 2)."""
    ROW: gl.constexpr = D // 16          # int64 words per token row
    step: gl.constexpr = ROW * (1 + MAP)  # int64 words from token j to j + 1: one or two rows
    if MAP == 0:
        tg = t * TILE + 8 * (lane // 4)
        first = tg % BS
    else:
        tg = t * TILE + 16 * (lane // 8)
        first = (tg % BS) + (lane // 4) % 2
    pg = page0 + pages[0].to(gl.int64) * sc_b
    HD: gl.constexpr = 128 if D > 128 else D  # the operand's columns (256: the half at K_OFF)
    kb = (pg + K_OFF + first * (D // 2) + (HD // 8) * (lane % 4)).to(gl.pointer_type(gl.int64))
    if D != 64:
        a0, a1 = _load16(kb, buf, S, MODE)
        b0, b1 = _load16(kb + step, buf, S + 2, MODE)
        c0, c1 = _load16(kb + 2 * step, buf, S + 4, MODE)
        d0, d1 = _load16(kb + 3 * step, buf, S + 6, MODE)
        e0, e1 = _load16(kb + 4 * step, buf, S + 8, MODE)
        f0, f1 = _load16(kb + 5 * step, buf, S + 10, MODE)
        g0, g1 = _load16(kb + 6 * step, buf, S + 12, MODE)
        h0, h1 = _load16(kb + 7 * step, buf, S + 14, MODE)
        kw = (a0, a1, b0, b1, c0, c1, d0, d1, e0, e1, f0, f1, g0, g1, h0, h1)
    else:
        kw = (gl.load(kb), gl.load(kb + step), gl.load(kb + 2 * step), gl.load(kb + 3 * step),
              gl.load(kb + 4 * step), gl.load(kb + 5 * step), gl.load(kb + 6 * step),
              gl.load(kb + 7 * step))
    if not NORMS:
        kn = kw[0]
    elif MAP == 0:
        kn = _load16((pg + KN_OFF + 2 * (tg % BS)).to(gl.pointer_type(gl.int64)), buf, S + 16,
                     MODE)
    else:
        kn = _scalars16(t, pages, page0, lane, sc_b, BS, KN_OFF, buf, S + 16, MODE)
    return kw, kn


@gluon.jit
def _load_keys8(t, pages, page0, lane, sc_b, BS: gl.constexpr, K_OFF: gl.constexpr):
    """fp8 row keys (MAP 0): the lane's 32 row bytes 32t.. of its 8 tokens 8g + j (32 int64:
    token j's in words 4j..4j + 3); no norms (the second value repeats two of the words)."""
    tg = t * TILE + 8 * (lane // 4)
    pg = page0 + pages[0].to(gl.int64) * sc_b
    kb = (pg + K_OFF + (tg % BS) * 128 + 32 * (lane % 4)).to(gl.pointer_type(gl.int64))
    a0, a1 = _load16(kb)
    a2, a3 = _load16(kb + 2)
    b0, b1 = _load16(kb + 16)
    b2, b3 = _load16(kb + 18)
    c0, c1 = _load16(kb + 32)
    c2, c3 = _load16(kb + 34)
    d0, d1 = _load16(kb + 48)
    d2, d3 = _load16(kb + 50)
    e0, e1 = _load16(kb + 64)
    e2, e3 = _load16(kb + 66)
    f0, f1 = _load16(kb + 80)
    f2, f3 = _load16(kb + 82)
    g0, g1 = _load16(kb + 96)
    g2, g3 = _load16(kb + 98)
    h0, h1 = _load16(kb + 112)
    h2, h3 = _load16(kb + 114)
    kw = (a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3,
          e0, e1, e2, e3, f0, f1, f2, f3, g0, g1, g2, g3, h0, h1, h2, h3)
    return kw, (a0, a1)


@gluon.jit
def _load_values3(t, pages, page0, lane, sc_b, BS: gl.constexpr, V_OFF: gl.constexpr,
                  D: gl.constexpr, buf=None, S: gl.constexpr = 0, MODE: gl.constexpr = 0):
    """3-bit column-major values (MAP 1): sub-plane s of code words g + 8w (at (16s + g +
    8w)·BS in the plane; head size 64: of code word g, at (8s + g)·BS) for the lane's 16 tokens
    16t.. (12 int64, 6 at 64: word 6w + 2s + u holds tokens 16t + 8u + 0..7), so that the 8
    lanes of a page read 8 adjacent words' 16-byte runs (block size 16: whole sectors). buf, S,
    MODE: :func:`_word` (slots S..)."""
    tt = t * TILE + 16 * (lane % 4)
    pv = page0 + pages[1].to(gl.int64) * sc_b
    SP: gl.constexpr = D // 64 * BS  # int64 words from one sub-plane to the next
    vb = (pv + V_OFF + (tt % BS) + (lane // 4) * BS).to(gl.pointer_type(gl.int64))
    a0, a1 = _load16(vb, buf, S, MODE)
    b0, b1 = _load16(vb + SP, buf, S + 2, MODE)
    c0, c1 = _load16(vb + 2 * SP, buf, S + 4, MODE)
    if D != 64:  # code word g + 8 (of the half at V_OFF at head size 256)
        d0, d1 = _load16(vb + BS, buf, S + 6, MODE)
        e0, e1 = _load16(vb + BS + SP, buf, S + 8, MODE)
        f0, f1 = _load16(vb + BS + 2 * SP, buf, S + 10, MODE)
        vw = (a0, a1, b0, b1, c0, c1, d0, d1, e0, e1, f0, f1)
    else:
        vw = (a0, a1, b0, b1, c0, c1)
    return vw


@triton.constexpr_function
def _key_slots(KEYS, MAP):
    """Shared word slots of a head-256 tile's key words (both halves) and norms
    (:func:`_load_k`)."""
    return 2 * (12 if KEYS == 0 else 16) + (2 if MAP == 0 else 4)


@triton.constexpr_function
def _value_slots(VALS):
    """Shared word slots of a head-256 tile's value words (both halves) and scalars
    (:func:`_load_v`)."""
    return {0: 36, 1: 28, 2: 32, 3: 34}[VALS]


@gluon.jit
def _load_k(t, pages, page0, lane, sc_b, BS: gl.constexpr, K_OFF: gl.constexpr,
            KN_OFF: gl.constexpr, KEYS: gl.constexpr, MAP: gl.constexpr, D: gl.constexpr,
            buf=None, S: gl.constexpr = 0, MODE: gl.constexpr = 0):
    """Key words and norms of tile t. buf, S, MODE (head size 256): :func:`_word`, in slots
    S..S + _key_slots(KEYS, MAP) - 1."""
    if D == 256:  # the halves' words, the first half's first (K_OFF + KH: the second's)
        KH: gl.constexpr = 16 * BS if KEYS == 0 else 64
        S2: gl.constexpr = S + _key_slots(KEYS, MAP) - (12 if KEYS == 0 else 16)
        if KEYS == 0:
            kw, kn = _load_keys(t, pages, page0, lane, sc_b, BS, K_OFF, KN_OFF, MAP, D, buf, S,
                                MODE)
            kw2, _ = _load_keys(t, pages, page0, lane, sc_b, BS, K_OFF + KH, KN_OFF, MAP, D,
                                buf, S2, MODE, False)
        else:
            kw, kn = _load_keys4(t, pages, page0, lane, sc_b, BS, K_OFF, KN_OFF, MAP, D, buf, S,
                                 MODE)
            kw2, _ = _load_keys4(t, pages, page0, lane, sc_b, BS, K_OFF + KH, KN_OFF, MAP, D,
                                 buf, S2, MODE, False)
        kw = kw + kw2
    elif KEYS == 0:
        kw, kn = _load_keys(t, pages, page0, lane, sc_b, BS, K_OFF, KN_OFF, MAP, D)
    elif KEYS == 1:
        kw, kn = _load_keys4(t, pages, page0, lane, sc_b, BS, K_OFF, KN_OFF, MAP, D)
    else:
        kw, kn = _load_keys8(t, pages, page0, lane, sc_b, BS, K_OFF)
    return kw, kn


@gluon.jit
def _load_v(t, pages, page0, lane, sc_b, BS: gl.constexpr, V_OFF: gl.constexpr,
            VS_OFF: gl.constexpr, VZ_OFF: gl.constexpr, VALS: gl.constexpr, D: gl.constexpr,
            buf=None, S: gl.constexpr = 0, MODE: gl.constexpr = 0):
    """Value words and their scalars: (scales, zero points) for uniform values (VALS 0, 2),
    (norms, norms) for rotated ones (VALS 1, 3; VS_OFF: the norms' plane, VZ_OFF unused). At
    D = 256 the two halves' words, the first half's first. buf, S, MODE (head size 256):
    :func:`_word`, in slots S..S + _value_slots(VALS) - 1."""
    if VALS == 0:
        vw, vs, vz = _load_values(t, pages, page0, lane, sc_b, BS, V_OFF, VS_OFF, VZ_OFF, D,
                                  buf, S, MODE)
    elif VALS == 3:
        vw, vs, vz = _load_values(t, pages, page0, lane, sc_b, BS, V_OFF, VS_OFF, VS_OFF, D,
                                  buf, S, MODE, 1)
    else:
        vw = _load_values3(t, pages, page0, lane, sc_b, BS, V_OFF, D, buf, S, MODE)
        vs = _scalars16(t, pages, page0, lane, sc_b, BS, VS_OFF, buf, S + 12, MODE)
        if VALS == 2:
            vz = _scalars16(t, pages, page0, lane, sc_b, BS, VZ_OFF, buf, S + 16, MODE)
        else:
            vz = vs
    if D == 256:  # the second half: 64 row bytes on (VALS 0, 3) or 16 code words on (1, 2)
        S2: gl.constexpr = S + _value_slots(VALS) - (16 if (VALS == 0 or VALS == 3) else 12)
        if VALS == 0 or VALS == 3:
            vw2, _, _ = _load_values(t, pages, page0, lane, sc_b, BS, V_OFF + 64, VS_OFF,
                                     VS_OFF, D, buf, S2, MODE, 0)
        else:
            vw2 = _load_values3(t, pages, page0, lane, sc_b, BS, V_OFF + 16 * BS, D, buf, S2,
                                MODE)
        vw = vw + vw2
    return vw, vs, vz


@gluon.jit
def _load_tile(t, pages, page0, lane, sc_b, BS: gl.constexpr, K_OFF: gl.constexpr,
               KN_OFF: gl.constexpr, V_OFF: gl.constexpr, VS_OFF: gl.constexpr,
               VZ_OFF: gl.constexpr, KEYS: gl.constexpr, VALS: gl.constexpr, MAP: gl.constexpr,
               D: gl.constexpr):
    """The lane's raw words of tile t (pages: :func:`_pages` of t): key words, value words and
    the words of their fp16 scalars. Pages hold >= 16 tokens and tiles start at page
    boundaries, so each lane reads one page per role."""
    kw, kn = _load_k(t, pages, page0, lane, sc_b, BS, K_OFF, KN_OFF, KEYS, MAP, D)
    vw, vs, vz = _load_v(t, pages, page0, lane, sc_b, BS, V_OFF, VS_OFF, VZ_OFF, VALS, D)
    return kw, vw, (kn, vs, vz)


@gluon.jit
def _lane_sums(x):
    """[64, 8] score-layout tensor → [8 g, 8 heads]: each lane's sum over its own 8 rows (no
    shuffles; rows g + 8i)."""
    return gl.sum(gl.reshape(x, [8, 8, 8]), axis=0)


@gluon.jit
def _scores(kw, skn, t, seq_len, qb, tab, tau, MASKED: gl.constexpr, KEYS: gl.constexpr,
            MAP: gl.constexpr, D: gl.constexpr, KSM: gl.constexpr):
    """A tile's scores (log2 units) from its key words (rows in the token order MAP);
    MASKED: -inf past the sequence."""
    if D == 256:  # qb: the halves' operands; kw: the halves' words, the first half's first
        N: gl.constexpr = 12 if KEYS == 0 else 16
        s = gl.zeros([TILE, 8], gl.float32, layout=_MMA)
        s = mma_v2(_key_operand(kw[0:N], tab, KEYS, MAP, 128, KSM), qb[0], s)
        s = mma_v2(_key_operand(kw[N:2 * N], tab, KEYS, MAP, 128, KSM), qb[1], s)
    else:
        if KEYS == 2:
            ka = _key_operand8(kw)
        else:
            ka = _key_operand(kw, tab, KEYS, MAP, D, KSM)
        s = mma_v2(ka, qb, gl.zeros([TILE, 8], gl.float32, layout=_MMA))
    if KEYS != 2:  # fp8 keys have no norm
        s = s * _row_scalars(skn, MAP)
    if MASKED:
        s = gl.where((t * TILE + tau < seq_len)[:, None], s, float("-inf"))
    return s


@gluon.jit
def _attend(s, vw, svs, svz, t, seq_len, m_i, l_p, z_p, acc, tau, tabv, MASKED: gl.constexpr,
            VALS: gl.constexpr, MAP: gl.constexpr, D: gl.constexpr):
    """Online softmax of a tile's scores (rescaled only when a head's running max grows by
    more than 8 in log2 units, so p ≤ 256) and P·V from its value words (VALS 1, 3: rotated
    values, their norms in svs, no zero points)."""
    UNIFORM: gl.constexpr = VALS == 0 or VALS == 2
    vs = _row_scalars(svs, MAP)
    if UNIFORM:
        vz = _row_scalars(svz, MAP)
    if MASKED:
        ok = (t * TILE + tau < seq_len)[:, None]
        vs = gl.where(ok, vs, 0.0)
        if UNIFORM:
            vz = gl.where(ok, vz, 0.0)
    m_new = gl.maximum(m_i, gl.max(s, axis=0))
    if gl.max(m_new - m_i, axis=0) > 8.0:
        alpha = gl.exp2(m_i - m_new)
        if D == 256:  # acc: the halves' accumulators
            acc = (acc[0] * alpha[None, :], acc[1] * alpha[None, :])
        else:
            acc = acc * alpha[None, :]
        a2 = gl.max(gl.reshape(gl.zeros([TILE, 8], gl.float32, layout=_MMA) + alpha[None, :],
                               [8, 8, 8]), axis=0)
        l_p = l_p * a2
        if UNIFORM:
            z_p = z_p * a2
        m_i = m_new
    p = gl.exp2(s - m_i[None, :])
    l_p = l_p + _lane_sums(p)
    pb = gl.convert_layout((p * vs).to(gl.float16), _OP_B)
    if UNIFORM:
        z_p = z_p + _lane_sums(p * vz)
    if D == 256:  # vw: the halves' words, the first half's first
        N: gl.constexpr = 16 if (VALS == 0 or VALS == 3) else 12
        acc = (mma_v2(_value_operand(vw[0:N], tabv, VALS, 128), pb, acc[0]),
               mma_v2(_value_operand(vw[N:2 * N], tabv, VALS, 128), pb, acc[1]))
    else:
        acc = mma_v2(_value_operand(vw, tabv, VALS, D), pb, acc)
    return m_i, l_p, z_p, acc


@gluon.jit
def _tile(kw, vw, sc, t, seq_len, m_i, l_p, z_p, acc, qb, tab, tabv, tau, MASKED: gl.constexpr,
          KEYS: gl.constexpr, VALS: gl.constexpr, MAP: gl.constexpr, D: gl.constexpr,
          KSM: gl.constexpr):
    """One 64-token tile from its raw words (:func:`_load_tile`). MASKED: the sequence's last,
    partial tile."""
    s = _scores(kw, sc[0], t, seq_len, qb, tab, tau, MASKED, KEYS, MAP, D, KSM)
    return _attend(s, vw, sc[1], sc[2], t, seq_len, m_i, l_p, z_p, acc, tau, tabv, MASKED, VALS,
                   MAP, D)


@gluon.jit
def _l2_page(tp, limit, seq_len, bt_row, lane, BS: gl.constexpr):
    """The page of the block of tile tp that the lane prefetches (32·BS/TILE lanes per
    block; -1 if tp >= limit or past the sequence): the address of an L2 prefetch
    (:func:`_l2_prefetch`) a tile later, so that this load's latency hides."""
    tok = tp * TILE + (lane // (32 * BS // TILE)) * BS
    ok = (tok < seq_len) & (tp < limit)
    return gl.where(ok, gl.load(bt_row + tok // BS, mask=ok, other=0), -1)


@gluon.jit
def _l2_prefetch(page, page0, sc_b, sc_h, lane, BS: gl.constexpr, D: gl.constexpr):
    """L2 prefetch of the lane's two 128-byte lines (four at head size 256) of its (page, KV
    head) block (sc_h bytes) where page >= 0."""
    if D == 256:
        off = (lane % (32 * BS // TILE)) * 512
        page = gl.where(off < sc_h, page, -1)
        base = page0 + gl.maximum(page, 0).to(gl.int64) * sc_b + off
        _prefetch2(gl.where(off + 256 < sc_h, page, -1), base + 256, off + 384, sc_h)
        r = _prefetch2(page, base, off + 128, sc_h)
    else:
        off = (lane % (32 * BS // TILE)) * 256
        if D != 128:  # a smaller block: the lanes past its end prefetch nothing
            page = gl.where(off < sc_h, page, -1)
        r = _prefetch2(page, page0 + gl.maximum(page, 0).to(gl.int64) * sc_b + off, off + 128,
                       sc_h)
    return r


@gluon.jit
def _prefetch2(page, addr, off2, sc_h):
    """L2 prefetch of the line at addr where page >= 0, and of the next one where also
    off2 < sc_h."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred p, q; setp.ge.s32 p, $1, 0; setp.lt.and.s32 q, $3, $4, p; mov.u32 $0, 0; "
        "@p prefetch.global.L2 [$2]; @q prefetch.global.L2 [$2+128]; }",
        "=r,r,l,r,r", [page, addr, off2, sc_h], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _atomic_inc_lane0(ptr, lane_id):
    """Lane 0's relaxed atomic increment of *ptr: its old value in lane 0 (:func:`_bcast`)."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.eq.u32 p, $2, 0; mov.u32 $0, 0; "
        "@p atom.relaxed.gpu.global.add.u32 $0, [$1], 1; }",
        "=r,l,r", [ptr, lane_id], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _bcast(x):
    """Lane 0's x (>= 0; 0 in the other lanes) in every lane, as a warp-uniform value."""
    return gl.inline_asm_elementwise("redux.sync.max.u32 $0, $1, 0xffffffff;",
                                     "=r,r", [x], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _step(kw, vw, sc, t, tn, pages, seq_len, m_i, l_p, z_p, acc, qb, tab, tabv, tau, page0, lane,
          sc_b, BS: gl.constexpr, K_OFF: gl.constexpr, KN_OFF: gl.constexpr, V_OFF: gl.constexpr,
          VS_OFF: gl.constexpr, VZ_OFF: gl.constexpr, KEYS: gl.constexpr, VALS: gl.constexpr,
          MAP: gl.constexpr, D: gl.constexpr, KSM: gl.constexpr):
    """Full tile t from its words, and the words of tile tn (pages: its page indices) loaded
    during t, each role's as soon as t's words of that role are consumed."""
    s = _scores(kw, sc[0], t, seq_len, qb, tab, tau, False, KEYS, MAP, D, KSM)
    kw, skn = _load_k(tn, pages, page0, lane, sc_b, BS, K_OFF, KN_OFF, KEYS, MAP, D)
    gl.thread_barrier()
    m_i, l_p, z_p, acc = _attend(s, vw, sc[1], sc[2], t, seq_len, m_i, l_p, z_p, acc, tau, tabv,
                                 False, VALS, MAP, D)
    vw, svs, svz = _load_v(tn, pages, page0, lane, sc_b, BS, V_OFF, VS_OFF, VZ_OFF, VALS, D)
    gl.thread_barrier()
    return m_i, l_p, z_p, acc, kw, vw, (skn, svs, svz)


@gluon.jit
def _warpid():
    return gl.inline_asm_elementwise("mov.u32 $0, %warpid;", "=r", [], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def _merge_group(po_ptr, plse_ptr, out_ptr, lse_ptr, b, kvh, spo_r, spo_h, spo_s, spl_r, spl_h,
                 so_r, so_h, sl_r, NUM_SPLITS, GROUP: gl.constexpr, WRITE_LSE: gl.constexpr,
                 D: gl.constexpr):
    """The group's split outputs → its final rows (the math of decode._merge_kernel). It runs
    on the critical path's tail: STEP splits per L2 round trip (their LSEs and parts loaded
    together), merged online with a running max per head; every lane loads the LSEs itself, so
    the max needs no cross-lane reduction."""
    HP: gl.constexpr = 4 if GROUP <= 4 else 8  # a part's rows held per lane: 16 or 32 fp32
    STEP: gl.constexpr = (16 if D == 256 else 32) // HP   # 128 loaded fp32 a lane (64 at D = 64)
    MS: gl.constexpr = _MS if D == 128 else _MS64 if D == 64 else _MS256
    L2D: gl.constexpr = gl.SliceLayout(2, MS)    # [STEP, HP]
    P2: gl.constexpr = gl.SliceLayout(0, MS)     # [HP, D]
    LH: gl.constexpr = gl.SliceLayout(0, L2D)
    RH: gl.constexpr = gl.SliceLayout(1, P2)
    jj = gl.arange(0, STEP, layout=gl.SliceLayout(1, L2D))
    hh = gl.arange(0, HP, layout=LH)
    hr = gl.arange(0, HP, layout=RH)
    dd = gl.arange(0, D, layout=gl.SliceLayout(0, P2))
    hm = hh < GROUP
    lp = plse_ptr + b.to(gl.int64) * spl_r + (kvh * GROUP + hh) * spl_h
    # part strides come in rows of D fp32, so the compiler sees aligned rows
    pp = po_ptr + ((b.to(gl.int64) * spo_r + (kvh * GROUP + hr) * spo_h) * D)[:, None] + \
        dd[None, :]
    m = gl.full([HP], -1.0e30, gl.float32, layout=LH)
    tot = gl.zeros([HP], gl.float32, layout=LH)
    acc = gl.zeros([HP, D], gl.float32, layout=P2)
    # every split wrote its part (zeros and LSE −inf when it had no tokens)
    for s0 in range(0, NUM_SPLITS, STEP):
        sj = s0 + jj
        ok = (sj < NUM_SPLITS)[:, None] & hm[None, :]
        lse_j = gl.load(lp[None, :] + sj[:, None], mask=ok, other=float("-inf"))
        x = gl.load(pp[None, :, :] + (sj.to(gl.int64) * spo_s * D)[:, None, None],
                    mask=ok[:, :, None], other=0.0)
        m_new = gl.maximum(m, gl.max(lse_j, axis=0))
        alpha = gl.exp(m - m_new)
        w = gl.exp(lse_j - m_new[None, :])
        acc = acc * gl.convert_layout(alpha, RH)[:, None] + gl.sum(x * w[:, :, None], axis=0)
        tot = tot * alpha + gl.sum(w, axis=0)
        m = m_new
    o = acc / gl.convert_layout(gl.where(tot > 0.0, tot, 1.0), RH)[:, None]
    orow = b.to(gl.int64) * so_r + (kvh * GROUP + hr) * so_h
    gl.store(out_ptr + orow[:, None] + dd[None, :], o.to(out_ptr.dtype.element_ty),
             mask=(hr < GROUP)[:, None])
    if WRITE_LSE:
        gl.store(lse_ptr + b.to(gl.int64) * sl_r + kvh * GROUP + hh,
                 gl.where(tot > 0.0, m + gl.log(gl.where(tot > 0.0, tot, 1.0)),
                          float("-inf")), mask=hm)


@gluon.jit
def _loop256(q_ptr, q_rows, hmask, sgn_ptr, qscale, t0, t1, seq_len, bt_row, tab, tabv, tau,
             page0, lane, sc_b, sc_h, alone, BS: gl.constexpr, K_OFF: gl.constexpr,
             KN_OFF: gl.constexpr, V_OFF: gl.constexpr, VS_OFF: gl.constexpr,
             VZ_OFF: gl.constexpr, KEYS: gl.constexpr, VALS: gl.constexpr, MAP: gl.constexpr,
             KSM: gl.constexpr):
    """A split's tiles at head size 256: both halves' words do not fit the registers beside
    the halves' accumulators a tile ahead (the next tile's key words alone spill), so each tile
    loads its own key and value words, both in flight at once. Alone on its SM scheduler
    (alone: no other program hides its load latency), the next tile's blocks are prefetched into
    L2 while a tile is computed; else each tile's, just before its loads. Returns the softmax
    state and the accumulators [128, 8] of the halves."""
    qb = _fused_query(q_ptr, q_rows, hmask, sgn_ptr, qscale, KEYS, 256)
    m_i = gl.full([8], -1.0e30, gl.float32, layout=_HEADS)
    l_p = _lane_sums(gl.zeros([TILE, 8], gl.float32, layout=_MMA))
    z_p = l_p
    acc = (gl.zeros([128, 8], gl.float32, layout=_MMA), gl.zeros([128, 8], gl.float32, layout=_MMA))
    pages = _pages(t0, seq_len, bt_row, lane, BS, MAP)
    nx = alone.to(gl.int32)  # the tile ahead of the loads whose blocks are prefetched
    _l2_prefetch(gl.where(alone, _l2_page(t0, t1, seq_len, bt_row, lane, BS), -1), page0, sc_b,
                 sc_h, lane, BS, 256)
    pf = _l2_page(t0 + nx, t1, seq_len, bt_row, lane, BS)
    for t in range(t0, t1):
        _l2_prefetch(gl.where(alone, -1, pf), page0, sc_b, sc_h, lane, BS, 256)
        # every tile masked: a compare per row, and the last, partial tile needs no own code
        kw, skn = _load_k(t, pages, page0, lane, sc_b, BS, K_OFF, KN_OFF, KEYS, MAP, 256)
        vw, svs, svz = _load_v(t, pages, page0, lane, sc_b, BS, V_OFF, VS_OFF, VZ_OFF, VALS, 256)
        gl.thread_barrier()
        _l2_prefetch(gl.where(alone, pf, -1), page0, sc_b, sc_h, lane, BS, 256)
        s = _scores(kw, skn, t, seq_len, qb, tab, tau, True, KEYS, MAP, 256, KSM)
        pages = _pages(t + 1, seq_len, bt_row, lane, BS, MAP)
        m_i, l_p, z_p, acc = _attend(s, vw, svs, svz, t, seq_len, m_i, l_p, z_p, acc, tau, tabv,
                                     True, VALS, MAP, 256)
        pf = _l2_page(t + 1 + nx, t1, seq_len, bt_row, lane, BS)
    return m_i, l_p, z_p, acc


@gluon.jit
def _loop256_copies(q_ptr, q_rows, hmask, sgn_ptr, qscale, t0, t1, seq_len, bt_row, tab, tabv,
                    tau, page0, lane, sc_b, BS: gl.constexpr, K_OFF: gl.constexpr,
                    KN_OFF: gl.constexpr, V_OFF: gl.constexpr, VS_OFF: gl.constexpr,
                    VZ_OFF: gl.constexpr, KEYS: gl.constexpr, VALS: gl.constexpr,
                    MAP: gl.constexpr, KSM: gl.constexpr):
    """:func:`_loop256` with the next tile's words in flight without registers: they travel
    asynchronously (``cp.async``) into shared memory, each lane its own words, one slot per
    word, while a tile is computed (the formats :func:`_async_256` picks)."""
    qb = _fused_query(q_ptr, q_rows, hmask, sgn_ptr, qscale, KEYS, 256)
    m_i = gl.full([8], -1.0e30, gl.float32, layout=_HEADS)
    l_p = _lane_sums(gl.zeros([TILE, 8], gl.float32, layout=_MMA))
    z_p = l_p
    acc = (gl.zeros([128, 8], gl.float32, layout=_MMA), gl.zeros([128, 8], gl.float32, layout=_MMA))
    NK: gl.constexpr = _key_slots(KEYS, MAP)
    # one allocation per slot: copies into distinct allocations need no barrier between them
    buf = ()
    for i in gl.static_range(NK + _value_slots(VALS)):
        buf = buf + (gl.allocate_shared_memory(gl.int64, [32], _SLOTS),)
    pages = _pages(t0, seq_len, bt_row, lane, BS, MAP)
    if t0 < t1:  # no copies left in flight past the loop
        _load_k(t0, pages, page0, lane, sc_b, BS, K_OFF, KN_OFF, KEYS, MAP, 256, buf, 0, 1)
        async_copy.commit_group()
        _load_v(t0, pages, page0, lane, sc_b, BS, V_OFF, VS_OFF, VZ_OFF, VALS, 256, buf, NK, 1)
        async_copy.commit_group()
    pages = _pages(t0 + 1, seq_len, bt_row, lane, BS, MAP)
    # each role's copies of tile t + 1 start once tile t's words of that role are read: one
    # group per role and tile, so waiting for all but the newest group waits for the role due
    for t in range(t0, t1):
        more = t + 1 < t1
        async_copy.wait_group(1)
        kw, skn = _load_k(t, pages, page0, lane, sc_b, BS, K_OFF, KN_OFF, KEYS, MAP, 256, buf,
                          0, 2)
        # every tile masked: a compare per row, and the last, partial tile needs no own code
        s = _scores(kw, skn, t, seq_len, qb, tab, tau, True, KEYS, MAP, 256, KSM)
        if more:
            _load_k(t + 1, pages, page0, lane, sc_b, BS, K_OFF, KN_OFF, KEYS, MAP, 256, buf, 0,
                    1)
        async_copy.commit_group()
        async_copy.wait_group(1)
        vw, svs, svz = _load_v(t, pages, page0, lane, sc_b, BS, V_OFF, VS_OFF, VZ_OFF, VALS,
                               256, buf, NK, 2)
        m_i, l_p, z_p, acc = _attend(s, vw, svs, svz, t, seq_len, m_i, l_p, z_p, acc, tau, tabv,
                                     True, VALS, MAP, 256)
        if more:
            _load_v(t + 1, pages, page0, lane, sc_b, BS, V_OFF, VS_OFF, VZ_OFF, VALS, 256, buf,
                    NK, 1)
        async_copy.commit_group()
        pages = _pages(t + 2, seq_len, bt_row, lane, BS, MAP)
    return m_i, l_p, z_p, acc


@triton.constexpr_function
def _async_256(KEYS, VALS):
    """Whether head size 256 copies its words asynchronously (:func:`_loop256_copies`): for
    ``turboquant_k3v4_nc``'s format only — 4-6 % faster on an H100, while ``tq_k4v3``'s took
    5-6 % longer (bench/results/decode256_async_copy_h100_s38.md)."""
    return KEYS == 0 and VALS == 0


# tiles ahead of the loop whose blocks are prefetched into L2, per head size (more bytes in
# flight than the registers hold; further ahead the prefetched blocks crowd the L2)
L2_AHEAD_64 = gl.constexpr(2)
# head 128 (twice head 64's bytes a tile): the tile whose words the loop loads next, measured fastest
L2_AHEAD_128 = gl.constexpr(1)


# split-count-dependent arguments and the block-table width are not specialised: every split
# count > 1 runs one build (ASSIGN; one split another, under the same register cap), and
# programs_per_sm reads its count
@gluon.jit(do_not_specialize=["sbt", "spo_r", "spo_h", "spo_s", "spl_r", "spl_h", "so_r", "so_h",
                              "sl_r", "NUM_SPLITS", "n_older", "w_old", "w_young"])
def _decode_mma_kernel(q_ptr, sq_r, sq_h, cache_ptr, sc_b, sc_h, bt_ptr, sbt, seqlen_ptr,
                       po_ptr, spo_r, spo_h, spo_s, plse_ptr, spl_r, spl_h, tab_ptr,
                       out_ptr, so_r, so_h, lse_ptr, sl_r, count_ptr, NUM_SPLITS, sgn_ptr, qscale,
                       kn_ptr, skn_b, skn_h, vn_ptr, svn_b, svn_h, slot_ptr, ftab_ptr, ksgn_ptr,
                       vtab_ptr, osgn_ptr, ASSIGN: gl.constexpr, n_older, w_old, w_young,
                       GROUP: gl.constexpr, HK: gl.constexpr, BS: gl.constexpr,
                       K_OFF: gl.constexpr, KN_OFF: gl.constexpr, V_OFF: gl.constexpr,
                       VS_OFF: gl.constexpr, VZ_OFF: gl.constexpr, WRITE_LSE: gl.constexpr,
                       STORE: gl.constexpr, K_LUT: gl.constexpr, K_BND: gl.constexpr,
                       V_LUT: gl.constexpr, V_BND: gl.constexpr, K_FOLD: gl.constexpr,
                       V_FOLD: gl.constexpr, KEYS: gl.constexpr, VALS: gl.constexpr,
                       MAP: gl.constexpr, D: gl.constexpr, KSM: gl.constexpr,
                       VSM: gl.constexpr):
    pid = gl.program_id(0)
    split = gl.program_id(1)
    groups = gl.num_programs(0)
    if ASSIGN:
        # (group, split) by arrival: programs in warp slots 0-3 (the older of their scheduler's
        # two, which runs faster) take the positions split·groups + group from the front, the
        # others from the back
        lane_id = gl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r", [], dtype=gl.int32,
                                            is_pure=True, pack=1)
        older = _warpid() < 4
        arrived = _bcast(_atomic_inc_lane0(count_ptr + groups + gl.where(older, 0, 1), lane_id))
        pos = gl.where(older, arrived, groups * NUM_SPLITS - 1 - arrived)
        pid = pos % groups
        split = pos // groups
    b = pid // HK
    kvh = pid % HK
    seq_len = gl.load(seqlen_ptr + b)
    n_tiles = gl.cdiv(seq_len, TILE)
    # each split takes a fixed range of tiles, the sequence's last tile at the end of the last
    # split's. Of the two one-warp programs that share an SM scheduler the older gets most
    # issue slots; with positions by arrival the group's first h_old splits are older programs
    # (n_older: the launch's expected count), and their ranges are w_old : w_young times the
    # others'
    h_old = gl.minimum(gl.maximum((n_older - pid + groups - 1) // groups, 0), NUM_SPLITS)
    c0 = w_old * gl.minimum(split, h_old) + w_young * gl.maximum(split - h_old, 0)
    c1 = c0 + gl.where(split < h_old, w_old, w_young)
    den = w_old * h_old + w_young * (NUM_SPLITS - h_old)
    t0 = n_tiles * c0 // den
    t1 = n_tiles * c1 // den
    # tiles [t0, t_mid) are full; t_mid < t1 is the sequence's partial last tile
    t_mid = gl.maximum(t0, gl.minimum(t1, seq_len // TILE))

    lane = gl.arange(0, 32, layout=_LANE)
    # one copy of the table per lane: a warp-uniform load would put it in uniform registers,
    # which ptxas copies into a register before every prmt
    tab = (gl.load(tab_ptr + 4 * lane), gl.load(tab_ptr + 4 * lane + 1),
           gl.load(tab_ptr + 4 * lane + 2), gl.load(tab_ptr + 4 * lane + 3))
    if VALS != 0:
        tabv = (gl.load(vtab_ptr + 4 * lane), gl.load(vtab_ptr + 4 * lane + 1),
                gl.load(vtab_ptr + 4 * lane + 2), gl.load(vtab_ptr + 4 * lane + 3))
    else:
        tabv = tab
    bt_row = bt_ptr + b.to(gl.int64) * sbt
    page0 = cache_ptr + kvh.to(gl.int64) * sc_h
    rho = gl.arange(0, TILE, layout=_ROWS)
    # the token of score row ρ: the values' format fixes the row order (MAP), which the key
    # loads follow
    if MAP == 0:
        tau = 8 * (rho % 8) + rho // 8
    else:
        tau = 16 * ((rho % 8) // 2) + 2 * (rho // 8) + rho % 2

    if D == 256:
        if STORE:
            # the step's new token, stored by the last split (it reads the sequence's last tile
            # last) before its tiles are loaded
            if split == NUM_SPLITS - 1:
                _store_new_token(kn_ptr, skn_b, skn_h, vn_ptr, svn_b, svn_h, slot_ptr, ftab_ptr,
                                 ksgn_ptr, cache_ptr, sc_b, sc_h, b, kvh, BS, K_OFF, KN_OFF, V_OFF,
                                 VS_OFF, VZ_OFF, K_LUT, K_BND, V_LUT, V_BND, K_FOLD, V_FOLD, KEYS,
                                 VALS, KSM, VSM, D)
        hq = gl.arange(0, 8, layout=gl.SliceLayout(0, _OP_B))
        q_rows = b.to(gl.int64) * sq_r + (kvh * GROUP + hq) * sq_h
        if _async_256(KEYS, VALS):
            m_i, l_p, z_p, acc = _loop256_copies(q_ptr, q_rows, hq < GROUP, sgn_ptr, qscale, t0,
                                                 t1, seq_len, bt_row, tab, tabv, tau, page0, lane,
                                                 sc_b, BS, K_OFF, KN_OFF, V_OFF, VS_OFF,
                                                 VZ_OFF, KEYS, VALS, MAP, KSM)
        else:
            # at most one program per SM scheduler (OLDER_PER_SM a SM): n_older counts them all
            alone = groups * NUM_SPLITS <= n_older
            m_i, l_p, z_p, acc = _loop256(q_ptr, q_rows, hq < GROUP, sgn_ptr, qscale, t0, t1,
                                          seq_len, bt_row, tab, tabv, tau, page0, lane, sc_b,
                                          sc_h, alone, BS, K_OFF, KN_OFF, V_OFF, VS_OFF, VZ_OFF,
                                          KEYS, VALS, MAP, KSM)
    else:
        # the first tile's words are loaded first, the query rotated while they are in flight; the
        # page indices run a tile ahead of the words, so a block-table miss never waits in line
        # before a tile's word loads
        kw, vw, sc = _load_tile(t0, _pages(t0, seq_len, bt_row, lane, BS, MAP), page0, lane, sc_b,
                                BS, K_OFF, KN_OFF, V_OFF, VS_OFF, VZ_OFF, KEYS, VALS, MAP, D)
        pages = _pages(t0 + 1, seq_len, bt_row, lane, BS, MAP)
        hq = gl.arange(0, 8, layout=gl.SliceLayout(0, _OP_B))
        q_rows = b.to(gl.int64) * sq_r + (kvh * GROUP + hq) * sq_h
        qb = _fused_query(q_ptr, q_rows, hq < GROUP, sgn_ptr, qscale, KEYS, D)
        if STORE:
            # the step's new token, stored by the last split (it reads the sequence's last tile
            # last) while the first tile's words are in flight; read again if that tile is the last
            if split == NUM_SPLITS - 1:
                _store_new_token(kn_ptr, skn_b, skn_h, vn_ptr, svn_b, svn_h, slot_ptr, ftab_ptr,
                                 ksgn_ptr, cache_ptr, sc_b, sc_h, b, kvh, BS, K_OFF, KN_OFF, V_OFF,
                                 VS_OFF, VZ_OFF, K_LUT, K_BND, V_LUT, V_BND, K_FOLD, V_FOLD, KEYS,
                                 VALS, KSM, VSM, D)
                if t0 == n_tiles - 1:
                    kw, vw, sc = _load_tile(t0, _pages(t0, seq_len, bt_row, lane, BS, MAP), page0, lane,
                                            sc_b, BS, K_OFF, KN_OFF, V_OFF, VS_OFF, VZ_OFF, KEYS,
                                            VALS, MAP, D)

        # a finite "-inf": the first tile always takes the rescale branch (alpha = 0)
        m_i = gl.full([8], -1.0e30, gl.float32, layout=_HEADS)
        l_p = _lane_sums(gl.zeros([TILE, 8], gl.float32, layout=_MMA))
        z_p = l_p
        acc = gl.zeros([D, 8], gl.float32, layout=_MMA)
        # the words of the next tile are in flight while a tile is computed, each role's loaded once
        # the current tile's words of that role are consumed (keys after the scores, values after
        # P·V), with the page indices a tile further ahead, so the loads wait for nothing. The
        # barriers (one warp: no waiting) pin the loads there: ptxas otherwise sinks them to the
        # end of the loop body, closer to their use than the HBM latency. The words of the last
        # split's last tile are loaded once its other tiles are done.
        ahead: gl.constexpr = L2_AHEAD_128 if D == 128 else L2_AHEAD_64
        pf = _l2_page(t0 + ahead, t1, seq_len, bt_row, lane, BS)
        for t in range(t0, t_mid):
            _l2_prefetch(pf, page0, sc_b, sc_h, lane, BS, D)
            m_i, l_p, z_p, acc, kw, vw, sc = _step(kw, vw, sc, t, t + 1, pages, seq_len, m_i, l_p,
                                                   z_p, acc, qb, tab, tabv, tau, page0, lane, sc_b,
                                                   BS, K_OFF, KN_OFF, V_OFF, VS_OFF, VZ_OFF, KEYS,
                                                   VALS, MAP, D, KSM)
            pages = _pages(t + 2, seq_len, bt_row, lane, BS, MAP)
            pf = _l2_page(t + 1 + ahead, t1, seq_len, bt_row, lane, BS)
        if t_mid < t1:  # the last split: the sequence's partial last tile
            m_i, l_p, z_p, acc = _tile(kw, vw, sc, t_mid, seq_len, m_i, l_p, z_p, acc, qb, tab, tabv,
                                       tau, True, KEYS, VALS, MAP, D, KSM)

    l_i = gl.convert_layout(gl.sum(l_p, axis=0), _HEADS)
    has = l_i > 0.0
    inv = gl.where(has, 1.0 / gl.where(has, l_i, 1.0), 0.0)
    lse = gl.where(has, m_i * 0.6931471805599453 + gl.log(gl.where(has, l_i, 1.0)),
                   float("-inf"))
    heads = gl.arange(0, 8, layout=_HEADS)
    dims = gl.arange(0, D, layout=gl.SliceLayout(1, _MMA))
    if D == 64:
        dim = 8 * (dims % 8) + dims // 8
    elif VALS == 1 or VALS == 2:  # 3-bit column-major values (the halves' rows at 256)
        dim = (dims // 64) * 64 + 8 * (dims % 8) + (dims // 8) % 8
    else:  # the halves' rows at 256 each as at head size 128
        dim = (dims // 128) * 128 + 16 * (dims % 8) + (dims % 128) // 8
    if VALS == 0 or VALS == 2:
        z = gl.convert_layout(gl.sum(z_p, axis=0), _HEADS) * inv
        if D == 256:
            acc = gl.convert_layout(_cat_rows(acc[0], acc[1]), _MMA)
        o = acc * inv[None, :] + z[None, :]
    else:
        # rotated values: o = õ·Rᵀ, i.e. row ρ of the output is s[dim]/√D · (H·õ)[ρ] (a bit
        # permutation of the coordinates leaves H unchanged); splits merge linearly after it
        if D == 128:
            o = gl.convert_layout(_wht_rows(gl.convert_layout(acc * inv[None, :], _QL)), _MMA)
        elif D == 256:
            a = gl.convert_layout(acc[0] * inv[None, :], _QL)
            a2 = gl.convert_layout(acc[1] * inv[None, :], _QL)
            o = gl.convert_layout(_cat_rows(_wht_rows(a + a2), _wht_rows(a - a2)), _MMA)
        else:
            o = gl.convert_layout(_wht_rows64(gl.convert_layout(acc * inv[None, :], _QL64)),
                                  _MMA)
        o = o * gl.load(osgn_ptr + dims)[:, None]
    if NUM_SPLITS == 1:  # the group's only split: its rows are final
        orow = b.to(gl.int64) * so_r + (kvh * GROUP + heads) * so_h
        gl.store(out_ptr + orow[None, :] + dim[:, None], o.to(out_ptr.dtype.element_ty),
                 mask=(heads < GROUP)[None, :])
        if WRITE_LSE:
            gl.store(lse_ptr + b.to(gl.int64) * sl_r + kvh * GROUP + heads, lse,
                     mask=heads < GROUP)
    else:
        po = (b.to(gl.int64) * spo_r + (kvh * GROUP + heads) * spo_h + split * spo_s) * D
        gl.store(po_ptr + po[None, :] + dim[:, None], o, mask=(heads < GROUP)[None, :])
        gl.store(plse_ptr + b * spl_r + (kvh * GROUP + heads) * spl_h + split, lse,
                 mask=heads < GROUP)
        # the group's last split to finish merges (no merge launch): the barrier orders every
        # lane's stores before the release of the counter; the counter is left at 0 for the
        # next call
        gl.thread_barrier()
        done = gl.atomic_add(count_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if done == NUM_SPLITS - 1:
            gl.store(count_ptr + pid, 0)
            _merge_group(po_ptr, plse_ptr, out_ptr, lse_ptr, b, kvh, spo_r, spo_h, spo_s,
                         spl_r, spl_h, so_r, so_h, sl_r, NUM_SPLITS, GROUP, WRITE_LSE, D)
            if ASSIGN:
                # the last group merged: every program has taken its position; the arrival
                # counters are left at 0 for the next call
                merged = gl.atomic_add(count_ptr + groups + 2, 1, sem="relaxed", scope="gpu")
                if merged == groups - 1:
                    gl.store(count_ptr + groups, 0)
                    gl.store(count_ptr + groups + 1, 0)
                    gl.store(count_ptr + groups + 2, 0)


# tiles of a split run by an older program : by a younger one (the kernel comment at h_old)
SPLIT_WEIGHTS = (5, 3)
# older programs per SM: the first of each scheduler's (one-warp programs, 4 schedulers)
OLDER_PER_SM = 4
# register cap (sm_90, ptxas of triton 3.6): the prefetched words of the next tile need
# 230-241 registers without spills, and any count up to 256 keeps 8 programs per SM (two warps
# per 16K-register bank)
MAXNREG = 255


def _args(spec, q, kv_cache, block_table, seq_lens, part, plse, out, lse, group, num_splits,
          scale, new_kv=None):
    m, fmt = spec.layout, spec.mma
    kf, vf = spec.key_fields[0], spec.value_fields[0]
    groups = seq_lens.numel() * kv_cache.shape[1]
    tab, sgn, ksgn, vtab, osgn = _tables(spec, q.device)
    lse_arg = lse if lse is not None else plse
    args = (q, q.stride(0), q.stride(1), kv_cache, kv_cache.stride(0), kv_cache.stride(1),
            block_table, block_table.stride(0), seq_lens,
            part, part.stride(0) // m.d, part.stride(1) // m.d, part.stride(2) // m.d,
            plse, plse.stride(0), plse.stride(1), tab,
            out, out.stride(0), out.stride(1), lse_arg, lse_arg.stride(0),
            _counters(q.device, groups + 3), num_splits, sgn, float(scale) * 1.4426950408889634)
    if new_kv is not None:
        if not fmt.store:
            raise ValueError(f"new_kv: the tensor-core kernel does not store {spec.codec.preset.name} "
                             f"tokens (the store kernel runs first)")
        kn, vn, slots = new_kv
        if kn.shape != (seq_lens.numel(), kv_cache.shape[1], m.d) or vn.shape != kn.shape:
            raise ValueError(f"new_kv: key/value {tuple(kn.shape)} / {tuple(vn.shape)}, expected "
                             f"one token per sequence ({seq_lens.numel()}, {kv_cache.shape[1]}, "
                             f"{m.d})")
        if kn.stride(-1) != 1 or vn.stride(-1) != 1:
            raise ValueError("new_kv: key/value need a contiguous last dimension")
        args += (kn, kn.stride(0), kn.stride(1), vn, vn.stride(0), vn.stride(1), slots,
                 spec.tables_on(q.device)[0], ksgn)
    else:
        args += (q, 0, 0, q, 0, 0, seq_lens, tab, tab)
    args += (vtab, osgn)
    meta = dict(GROUP=group, HK=kv_cache.shape[1], BS=spec.block_size, K_OFF=kf.off,
                KN_OFF=m.kn_off, V_OFF=vf.off,
                VS_OFF=m.vn_off if fmt.rotated_values else m.vs_off, VZ_OFF=m.vz_off,
                WRITE_LSE=lse is not None, STORE=new_kv is not None,
                K_LUT=kf.lut, K_BND=kf.bnd, V_LUT=vf.lut, V_BND=vf.bnd, K_FOLD=m.k_corr == 1,
                V_FOLD=m.v_corr == 1, KEYS=fmt.keys, VALS=fmt.vals, MAP=fmt.token_map,
                KSM=kf.sm, VSM=vf.sm, ASSIGN=num_splits > 1,
                n_older=min(groups * num_splits, OLDER_PER_SM * num_sms(q.device)),
                w_old=SPLIT_WEIGHTS[0], w_young=SPLIT_WEIGHTS[1], D=m.d, num_warps=1,
                maxnreg=MAXNREG)
    return args, meta


_RESIDENT: dict = {}


def programs_per_sm(spec, q, kv_cache, block_table, seq_lens, group: int,
                    new_kv: tuple | None = None) -> int:
    """One-warp programs an SM holds at once, from the register count and shared memory of the
    kernel build that :func:`launch` runs for these arguments (the split count fills one wave
    of them)."""
    key = (id(spec), group, kv_cache.shape[1], q.dtype, str(q.device), new_kv is not None)
    # (the spec fixes the key and value formats)
    if key not in _RESIDENT:
        part = torch.empty(*q.shape[:2], 16, q.shape[2], device=q.device)
        plse = torch.empty(*q.shape[:2], 16, device=q.device)
        out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
        args, meta = _args(spec, q, kv_cache, block_table, seq_lens, part, plse, out, None,
                           group, 16, 1.0, new_kv)
        kernel = _decode_mma_kernel.warmup(*args, grid=(1, 1), **meta)
        try:
            kernel._init_handles()  # loads the binary; sets n_regs (triton 3.6)
            regs = -(-int(kernel.n_regs) // 8) * 8
            shared = int(kernel.metadata.shared)
        except (AttributeError, TypeError):  # another triton: the register cap
            regs, shared = MAXNREG, 0
        per_sm = getattr(torch.cuda.get_device_properties(q.device),
                         "shared_memory_per_multiprocessor", 0) if q.is_cuda else 0
        _RESIDENT[key] = resident_programs(regs, shared, per_sm)
    return _RESIDENT[key]


def resident_programs(regs: int, shared: int = 0, shared_per_sm: int = 0) -> int:
    """One-warp programs an SM holds at once with regs registers (a multiple of 8) and shared
    bytes of shared memory each (shared_per_sm: the SM's; 0: not limiting)."""
    # an SM's 64K registers are four 16K banks, one per scheduler, each holding whole warps:
    # 144-168 registers fit 3 one-warp programs per bank, not 65536 / (32·regs)
    n = 4 * max(1, min(16, 16384 // (32 * regs)))
    if shared and shared_per_sm:  # each program's shared memory plus the 1 KB a block reserves
        n = max(1, min(n, shared_per_sm // (shared + 1024)))
    return n


def num_splits(resident: int, groups: int, head_size: int) -> int:
    """The split count for ``groups`` (sequence, KV head) pairs when the GPU holds ``resident``
    of these one-warp programs at once: exactly one wave (a partial second wave idles most SMs),
    1..MAX_SPLITS."""
    n = max(1, min(MAX_SPLITS.value, resident // groups))
    if head_size == 256 and n > 16:
        # past 16 splits, half as many longer ones measured 3-7 % faster
        # (bench/results/decode256_l2_next_tile_h100_s29.md)
        n //= 2
    return n


def launch(spec, q, kv_cache, block_table, seq_lens, part, plse, out, lse, group: int,
           num_splits: int, scale: float, new_kv: tuple | None = None) -> None:
    """q: the raw query (rows, Hq, 128), contiguous last dimension; scale: the softmax scale;
    new_kv: (key, value, slot_mapping) of one new token per sequence, which the kernel stores
    itself (STORE: the last split of each group, before reading its tiles); part/plse: split
    scratch; out (rows, Hq, D) and lse (rows, Hq) or None receive the merged result."""
    if out.stride(-1) != 1:
        raise ValueError(f"out must have a contiguous last dimension, strides {out.stride()}")
    d = spec.layout.d
    if part.stride(-1) != 1 or any(x % d for x in part.stride()[:3]):
        raise ValueError(f"part: rows of {d} contiguous fp32 expected, strides {part.stride()}")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits={num_splits}: the tensor-core kernel merges 1..{MAX_SPLITS}")
    args, meta = _args(spec, q, kv_cache, block_table, seq_lens, part, plse, out, lse, group,
                       num_splits, scale, new_kv)
    _decode_mma_kernel[(seq_lens.numel() * kv_cache.shape[1], num_splits)](*args, **meta)


_COUNTERS: dict = {}


def _counters(device, n: int) -> torch.Tensor:
    """Per-group split counters and, after them, the arrival counters; zero between calls (the
    merging programs reset them). One buffer per device, grown by replacement; replaced buffers
    stay alive for captured graphs. Calls on different streams must not run concurrently."""
    key = str(device)
    bufs = _COUNTERS.setdefault(key, [])
    if not bufs or bufs[-1].numel() < n:
        bufs.append(torch.zeros(max(n, 2 * bufs[-1].numel() if bufs else 1024),
                                dtype=torch.int32, device=device))
    return bufs[-1]


_TABLES: dict = {}


def _tables(spec, device) -> tuple:
    """On device, cached per spec: the key codebook as the 4 int32 prmt table words, one copy
    per lane [32, 4]; the rotation's signs s[σ(k)]/√128 in operand order (R = diag(s)·H/√128,
    :func:`_fused_query`); s/√128 in natural order (:func:`_store_new_token`); rotated values
    (VALS 1): their codebook's table words [32, 4] and s/√128 at each output row's coordinate
    (:func:`value_row_coord`); rotated 4-bit values (VALS 3): their codebook's magnitude table
    words (:func:`_asm.symmetric_table_words`); 3-bit uniform values (VALS 2): the codes 0..7
    as table words."""
    key = (id(spec), str(device))
    if key not in _TABLES:
        fmt, kf = spec.mma, spec.key_fields[0]
        r = spec.codec.rotation.float().cpu()
        if fmt.keys == 0:
            words = _asm.lut3_table_words(spec.table[kf.lut:kf.lut + 8].tolist())
        elif fmt.keys == 1:
            words = _asm.symmetric_table_words(spec.table[kf.lut:kf.lut + 16].tolist(), kf.sm)
        else:  # fp8 keys: no table, no rotation (the kernel reads neither)
            words = [0, 0, 0, 0]
        if fmt.keys != 2 and not is_signed_hadamard(r):
            raise ValueError("the tensor-core kernel needs a rotation diag(s)·H/√128")
        d = spec.layout.d
        s = torch.ones(d) / d ** 0.5 if fmt.keys == 2 else torch.sign(r[:, 0]) / d ** 0.5
        vwords, osgn = words, s
        vf = spec.value_fields[0]
        if fmt.vals == 1:
            vwords = _asm.lut3_table_words(spec.table[vf.lut:vf.lut + 8].tolist())
        elif fmt.vals == 2:
            vwords = _asm.lut3_table_words(range(8))
        elif fmt.vals == 3:
            vwords = _asm.symmetric_table_words(spec.table[vf.lut:vf.lut + 16].tolist(), vf.sm)
        if fmt.rotated_values:
            osgn = s[value_row_coord(torch.arange(d), d, fmt.vals)]
        _TABLES[key] = (torch.tensor([words] * 32, dtype=torch.int32, device=device),
                        s[operand_coord(torch.arange(d), fmt.keys, d)].float().to(device),
                        s.float().to(device),
                        torch.tensor([vwords] * 32, dtype=torch.int32, device=device),
                        osgn.float().to(device))
    return _TABLES[key]
