"""PTX for the decode kernel's code → fp16 conversions (``tl.inline_asm_elementwise``, pack=1).

Each block takes 32-bit words holding one byte of 4 elements (element e in byte e — 4 tokens of
a column-major key plane, or 4 byte positions of a token row) and writes fp16 pairs, with no
per-element shifts, integer→float conversions or memory lookups:

* :func:`lut3` — 3-bit codes through an 8-entry fp16 table (key or value centroids, or the
  uniform codes 0..7). Inputs ``$16..$18``: the words of the three byte sub-planes of 3-byte
  code words (page bit order of ``tqattn.quant.paged``); outputs ``$0..$15``: code position j
  of elements (0, 1) in ``$2j`` and of elements (2, 3) in ``$2j+1``. ``byte & 0x77`` gives two
  3-bit selectors in nibbles; codes 6 and 7 gather bits 3 and 7 of the three bytes. ``prmt``
  looks each selector up in the low-byte and high-byte halves of the table, held in registers
  (immediates of the asm text: one text per table), and a second pair of ``prmt`` interleaves
  low and high bytes into fp16 pairs.
* :data:`U4_VALUES` — 4-bit uniform value codes (two per byte) of 4 bytes → low nibbles of
  bytes (0, 1) in ``$0``, (2, 3) in ``$1``, high nibbles in ``$2``, ``$3``: ``0x6400 | n`` is
  the fp16 1024 + n and ``0x6400 | 16n`` is 1024 + 16n, both exact.

The PyTorch twins are the generic paths of the decode kernel (the interpreter's), which the
tests compare against the reference on CPU and, with and without these blocks, on the GPU.
"""

from __future__ import annotations

import struct

import triton.language as tl


def _pairs(lo: str, hi: str, out_a: str, out_b: str, sel: str,
           tab: tuple[str, str, str, str] = ("tl0", "tl1", "th0", "th1")) -> str:
    # lo/hi: byte lookups of nibble selectors [a(e), b(e), a(e+1), b(e+1)] → pairs a, b
    return (f"prmt.b32 {lo}, {tab[0]}, {tab[1]}, {sel};\n"
            f"prmt.b32 {hi}, {tab[2]}, {tab[3]}, {sel};\n"
            f"prmt.b32 {out_a}, {lo}, {hi}, 0x6240;\n"
            f"prmt.b32 {out_b}, {lo}, {hi}, 0x7351;\n")


def lut3(centroids) -> str:
    """Asm text for a 3-bit codebook (8 floats, rounded to fp16 as the generic path does)."""
    vals = [struct.unpack("<H", struct.pack("<e", float(c)))[0] for c in centroids]
    if len(vals) != 8:
        raise ValueError(f"a 3-bit codebook has 8 centroids, got {len(vals)}")
    lo = [v & 0xFF for v in vals]
    hi = [v >> 8 for v in vals]
    word = lambda b: b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24  # noqa: E731
    text = ("{\n.reg .b32 tl0, tl1, th0, th1, s, t, l, h;\n"
            f"mov.b32 tl0, {word(lo[:4]):#010x};\nmov.b32 tl1, {word(lo[4:]):#010x};\n"
            f"mov.b32 th0, {word(hi[:4]):#010x};\nmov.b32 th1, {word(hi[4:]):#010x};\n")
    return text + _lut3_element_pairs(("tl0", "tl1", "th0", "th1")) + "}"


def _lut3_element_pairs(tab: tuple[str, str, str, str]) -> str:
    # selector words: codes (0,1) from byte 0, (2,3) from byte 1, (4,5) from byte 2, (6,7)
    # from bits 3 and 7 of the three bytes
    text = ""
    for j, src in enumerate(("$16", "$17", "$18")):
        text += f"and.b32 s, {src}, 0x77777777;\n"
        text += _pairs("l", "h", f"${4 * j}", f"${4 * j + 2}", "s", tab)
        text += "shr.b32 t, s, 16;\n"
        text += _pairs("l", "h", f"${4 * j + 1}", f"${4 * j + 3}", "t", tab)
    text += ("shr.b32 s, $16, 3;\nand.b32 s, s, 0x11111111;\n"
             "shr.b32 t, $17, 2;\nand.b32 t, t, 0x22222222;\nor.b32 s, s, t;\n"
             "shr.b32 t, $18, 1;\nand.b32 t, t, 0x44444444;\nor.b32 s, s, t;\n")
    text += _pairs("l", "h", "$12", "$14", "s", tab)
    text += "shr.b32 t, s, 16;\n"
    text += _pairs("l", "h", "$13", "$15", "t", tab)
    return text


U4_VALUES = tl.constexpr(
    "{\n.reg .b32 x, y, t, k, m, c;\n"
    "mov.b32 k, 0x64006400;\n"            # fp16 pair (1024, 1024)
    "mov.b32 m, 0x2C002C00;\n"            # (1/16, 1/16)
    "mov.b32 c, 0xD400D400;\n"            # (-64, -64)
    "prmt.b32 x, $4, 0, 0x4140;\n"        # [byte0, 0, byte1, 0]: elements 0, 1
    "prmt.b32 y, $4, 0, 0x4342;\n"        # elements 2, 3
    "lop3.b32 t, x, 0x000F000F, k, 0xEA;\nsub.f16x2 $0, t, k;\n"    # (x & m) | k
    "lop3.b32 t, y, 0x000F000F, k, 0xEA;\nsub.f16x2 $1, t, k;\n"
    "lop3.b32 t, x, 0x00F000F0, k, 0xEA;\nfma.rn.f16x2 $2, t, m, c;\n"  # (1024+16n)/16-64
    "lop3.b32 t, y, 0x00F000F0, k, 0xEA;\nfma.rn.f16x2 $3, t, m, c;\n}")


# --- token-row pairs for the tensor-core operands of kernels/decode_mma.py -------------------
# mma operands hold fp16 pairs along the reduction axis: dimensions (2c, 2c+1) of one token for
# Q·Kᵀ, tokens (τ, τ+8) of one dimension for P·V. The blocks below emit those pairs directly.

def lut3_table_words(centroids) -> list[int]:
    """The 8 fp16 centroids as the 4 table words of :data:`LUT3_ROWS` (low bytes of codes 0-3,
    4-7, then high bytes), as signed int32."""
    vals = [struct.unpack("<H", struct.pack("<e", float(c)))[0] for c in centroids]
    if len(vals) != 8:
        raise ValueError(f"a 3-bit codebook has 8 centroids, got {len(vals)}")
    out = []
    for part in ([v & 0xFF for v in vals[:4]], [v & 0xFF for v in vals[4:]],
                 [v >> 8 for v in vals[:4]], [v >> 8 for v in vals[4:]]):
        w = part[0] | part[1] << 8 | part[2] << 16 | part[3] << 24
        out.append(w - (1 << 32) if w >= 1 << 31 else w)
    return out


def _lut3_rows_text() -> str:
    # inputs: $16..$18 the three byte sub-planes of 4 tokens, $19..$22 the table words (passed
    # in registers: as immediates ptxas re-materialises them before every prmt)
    text = "{\n.reg .b32 s, t, l, h;\n"

    def rows(sel: str, e: int, p: int) -> str:
        # bytes [lo a(e), lo b(e), lo a(e+1), lo b(e+1)] → (a, b) of token e, then of e+1
        return (f"prmt.b32 l, $19, $20, {sel};\nprmt.b32 h, $21, $22, {sel};\n"
                f"prmt.b32 ${e + 4 * p}, l, h, 0x5140;\nprmt.b32 ${e + 1 + 4 * p}, l, h, 0x7362;\n")

    for p, src in enumerate(("$16", "$17", "$18")):
        text += f"and.b32 s, {src}, 0x77777777;\n" + rows("s", 0, p)
        text += "shr.b32 t, s, 16;\n" + rows("t", 2, p)
    text += ("shr.b32 s, $16, 3;\nand.b32 s, s, 0x11111111;\n"
             "shr.b32 t, $17, 2;\nand.b32 t, t, 0x22222222;\nor.b32 s, s, t;\n"
             "shr.b32 t, $18, 1;\nand.b32 t, t, 0x44444444;\nor.b32 s, s, t;\n")
    text += rows("s", 0, 3) + "shr.b32 t, s, 16;\n" + rows("t", 2, 3)
    return text + "}"


# Like :func:`lut3` (inputs ``$16..$18``: the three byte sub-planes of 4 tokens), with the
# table in ``$19..$22`` (:func:`lut3_table_words`); output ``$(e + 4p)`` holds codes
# (2p, 2p+1) of token e as an fp16 pair (p = 3: codes 6, 7).
LUT3_ROWS = tl.constexpr(_lut3_rows_text())


def _u4_pair_text() -> str:
    text = ("{\n.reg .b32 x, t, k, m, c;\nmov.b32 k, 0x64006400;\n"
            "mov.b32 m, 0x2C002C00;\nmov.b32 c, 0xD400D400;\n")
    for b in range(4):
        sel = b | b << 4 | (4 + b) << 8 | (4 + b) << 12     # [A byte b, -, B byte b, -]
        text += (f"prmt.b32 x, $8, $9, {sel:#06x};\n"
                 f"lop3.b32 t, x, 0x000F000F, k, 0xEA;\nsub.f16x2 ${2 * b}, t, k;\n"
                 f"lop3.b32 t, x, 0x00F000F0, k, 0xEA;\nfma.rn.f16x2 ${2 * b + 1}, t, m, c;\n")
    return text + "}"


# 4-bit uniform codes of two token rows (words A = $8, B = $9: 8 codes each, two per byte) →
# ``$(2b + h)``: the (A, B) pair of the low (h = 0) / high (h = 1) nibble of byte b.
U4_PAIRS = tl.constexpr(_u4_pair_text())


# Like :func:`lut3` (code j of elements (0, 1) in ``$2j``, of (2, 3) in ``$2j+1``; inputs
# ``$16..$18``: the three byte sub-planes of 4 consecutive tokens), with the table in
# ``$19..$22`` (:func:`lut3_table_words`): fp16 pairs of one coordinate's consecutive tokens, the
# P·V operand of the tensor-core kernel's 3-bit values.
LUT3_TOKENS = tl.constexpr("{\n.reg .b32 s, t, l, h;\n"
                           + _lut3_element_pairs(("$19", "$20", "$21", "$22")) + "}")


def symmetric_table_words(centroids, sm: bool = False) -> list[int]:
    """The 8 non-negative fp16 centroids c[8..15] of a symmetric 4-bit codebook as the 4 table
    words of :data:`LUT4_ROWS`: after rounding to fp16 c[15-i] = -c[i] (bucket order), or with
    sm c[i] = -c[8+i] (sign-and-magnitude order, :data:`LUT4_ROWS_SM`)."""
    vals = [struct.unpack("<H", struct.pack("<e", float(c)))[0] for c in centroids]
    if len(vals) != 16:
        raise ValueError(f"a 4-bit codebook has 16 centroids, got {len(vals)}")
    neg = vals[:8] if sm else vals[7::-1]
    if any(n != v ^ 0x8000 for n, v in zip(neg, vals[8:])) or any(v >> 15 for v in vals[8:]):
        rule = "c[i] = -c[8+i]" if sm else "c[15-i] = -c[i]"
        raise ValueError(f"the 4-bit codebook is not symmetric in fp16 ({rule}, c[8..15] >= 0)")
    return lut3_table_words([struct.unpack("<e", struct.pack("<H", v))[0] for v in vals[8:]])


def _lut4_body(src: str, outs: tuple[str, str, str, str], tab: tuple[str, str, str, str],
               sm: bool = False) -> str:
    # src: 4 bytes (byte b: codes n0, n1 in its low / high nibble) → outs[b]: their fp16 pair,
    # through the magnitude table tab. Code n is +mag[n - 8] for n >= 8, -mag[7 - n] below:
    # c = ~x & 0x88.. flags the negative nibbles and m = x ^ 7·flag their magnitude selectors.
    # Bit 3 of each nibble (set for n >= 8) is the msb of a byte of x (odd nibbles) or of x << 4
    # (even ones): prmt's sign-replicate selectors spread it over the byte of h that nibble's
    # lookup fills, and the bytes left clear get the sign bit. In sign-and-magnitude order (sm)
    # the low 3 bits already are the magnitude selectors.
    if sm:
        text = f"and.b32 m, {src}, 0x77777777;\nshl.b32 a, {src}, 4;\n"
    else:
        text = (f"lop3.b32 c, {src}, 0x88888888, 0, 0x0C;\n"
                "shr.b32 t, c, 3;\nmul.lo.u32 u, t, 7;\n"
                f"lop3.b32 m, {src}, u, 0x77777777, 0x28;\nshl.b32 a, {src}, 4;\n")
    for half, spread in ((0, "0x9D8C"), (1, "0xBFAE")):  # nibbles 4h..4h+3 → bytes 0..3
        if half:
            text += "shr.b32 m, m, 16;\n"
        text += (f"prmt.b32 l, {tab[0]}, {tab[1]}, m;\nprmt.b32 h, {tab[2]}, {tab[3]}, m;\n"
                 f"prmt.b32 s, {src}, a, {spread};\n"
                 "lop3.b32 h, h, s, 0x80808080, 0xF2;\n"      # h | (~s & 0x80808080)
                 f"prmt.b32 {outs[2 * half]}, l, h, 0x5140;\n"
                 f"prmt.b32 {outs[2 * half + 1]}, l, h, 0x7362;\n")
    return text


def _lut4_rows_text(sm: bool = False) -> str:
    # $4: 4 bytes of one token row (byte b: codes of coordinates 2b, 2b+1); $5..$8: the table
    return ("{\n.reg .b32 c, t, u, m, l, h, a, s;\n"
            + _lut4_body("$4", ("$0", "$1", "$2", "$3"), ("$5", "$6", "$7", "$8"), sm) + "}")


def _lut4_pairs_text() -> str:
    # $8, $9: 4 bytes of token rows A and B (byte b: two codes); x0 / x1 gather the low / high
    # nibbles of both, byte b = (A's, B's), so that the row block's pairs are the (A, B) pairs
    tab = ("$10", "$11", "$12", "$13")
    return ("{\n.reg .b32 c, t, u, m, l, h, a, s, x0, x1;\n"
            "shl.b32 t, $9, 4;\nlop3.b32 x0, $8, t, 0x0F0F0F0F, 0xE4;\n"    # (A & m) | (t & ~m)
            "shr.b32 t, $8, 4;\nlop3.b32 x1, t, $9, 0x0F0F0F0F, 0xE4;\n"
            + _lut4_body("x0", ("$0", "$2", "$4", "$6"), tab, sm=True)
            + _lut4_body("x1", ("$1", "$3", "$5", "$7"), tab, sm=True) + "}")


# 4-bit codes of a symmetric codebook (one token row word: 8 codes) → ``$b``: the fp16 pair of
# byte b (coordinates 2b, 2b+1), the Q·K operand of the tensor-core kernel's 4-bit keys.
LUT4_ROWS = tl.constexpr(_lut4_rows_text())


# The same for codes in sign-and-magnitude order (tqattn.quant.codec.sign_magnitude: the tq_*
# presets' 4-bit fields), table words from ``symmetric_table_words(c, sm=True)``.
LUT4_ROWS_SM = tl.constexpr(_lut4_rows_text(sm=True))


# 4-bit codes of a symmetric codebook in sign-and-magnitude order in two token rows (words A =
# $8, B = $9: 8 codes each), table in $10..$13 (``symmetric_table_words(c, sm=True)``) →
# ``$(2b + h)``: the fp16 (A, B) pair of nibble h of byte b, as :data:`U4_PAIRS` orders them —
# the P·V operand of rotated 4-bit values (a tq_* preset's).
LUT4_PAIRS = tl.constexpr(_lut4_pairs_text())
