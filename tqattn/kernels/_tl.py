"""Triton helpers shared by the kernels: unpack code tiles, their coordinate order, fp16 fields,
outlier planes."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_ptr(cache_ptr, pbase, tip, OFF: tl.constexpr, G: tl.constexpr, CM: tl.constexpr):
    """[N, 1] pointers to byte 0 of each token's codes in sub-plane 0 of a field's plane
    (column-major planes, CM: byte g of the token sits g·block_size further)."""
    if CM:
        return cache_ptr + (pbase + OFF + tip)[:, None]
    else:
        return cache_ptr + (pbase + OFF + tip * G)[:, None]


@triton.jit
def load_bytes(ptr, ok, BS: tl.constexpr, S: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
               CM: tl.constexpr):
    """uint8 [N, GP] of sub-plane S; ptr [N, 1] from row_ptr, ok [N, 1]."""
    g = tl.arange(0, GP)[None, :]
    if G == GP:
        m = ok
    else:
        m = ok & (g < G)
    if CM:
        # runs of 16 tokens are contiguous (pages and planes start 16-byte aligned, tiles
        # start at page boundaries); the hint lets the load vectorise along tokens
        p = tl.max_contiguous(tl.multiple_of(ptr + S * BS * G + g * BS, [16, 1]), [16, 1])
        return tl.load(p, mask=m, other=0)
    else:
        return tl.load(ptr + S * BS * G + g, mask=m, other=0)


@triton.jit
def load_words(ptr, ok, BS: tl.constexpr, W: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
               CM: tl.constexpr):
    """[N, GP] int32 words of a code field; ptr [N, 1] from row_ptr."""
    w = load_bytes(ptr, ok, BS, 0, G, GP, CM).to(tl.int32)
    if W == 3:
        w = w | (load_bytes(ptr, ok, BS, 1, G, GP, CM).to(tl.int32) << 8)
        w = w | (load_bytes(ptr, ok, BS, 2, G, GP, CM).to(tl.int32) << 16)
    return w


@triton.jit
def code_of(w, I: tl.constexpr, BITS: tl.constexpr, W: tl.constexpr):
    """Code I of each word (3-byte words: the page bit order of tqattn.quant.paged)."""
    if W == 3:
        if I < 6:
            c = (w >> (4 * I)) & 7
        else:
            c = (((w >> (4 * I - 21)) & 1) | ((w >> (4 * I - 14)) & 2)
                 | ((w >> (4 * I - 7)) & 4))
    else:
        c = (w >> (BITS * I)) & ((1 << BITS) - 1)
    return c


@triton.jit
def split_words(w, BITS: tl.constexpr, CPW: tl.constexpr, W: tl.constexpr):
    """Words [N, GP] → codes [N, GP·CPW], column g·CPW + i = code i of word g."""
    if CPW == 1:
        c = w
    elif CPW == 2:
        c = tl.join(code_of(w, 0, BITS, W), code_of(w, 1, BITS, W))
    elif CPW == 4:
        c = tl.join(tl.join(code_of(w, 0, BITS, W), code_of(w, 1, BITS, W)),
                    tl.join(code_of(w, 2, BITS, W), code_of(w, 3, BITS, W)))
    else:
        c = tl.join(tl.join(tl.join(code_of(w, 0, BITS, W), code_of(w, 1, BITS, W)),
                            tl.join(code_of(w, 2, BITS, W), code_of(w, 3, BITS, W))),
                    tl.join(tl.join(code_of(w, 4, BITS, W), code_of(w, 5, BITS, W)),
                            tl.join(code_of(w, 6, BITS, W), code_of(w, 7, BITS, W))))
    return tl.reshape(c, (w.shape[0], w.shape[1] * CPW))


@triton.jit
def coords(GP: tl.constexpr, CPW: tl.constexpr):
    """[GP·CPW] field-local coordinate of each column of a split_words tile (same join tree)."""
    g = tl.arange(0, GP) * CPW
    if CPW == 1:
        c = g
    elif CPW == 2:
        c = tl.join(g, g + 1)
    elif CPW == 4:
        c = tl.join(tl.join(g, g + 1), tl.join(g + 2, g + 3))
    else:
        c = tl.join(tl.join(tl.join(g, g + 1), tl.join(g + 2, g + 3)),
                    tl.join(tl.join(g + 4, g + 5), tl.join(g + 6, g + 7)))
    return tl.reshape(c, (GP * CPW,))


@triton.jit
def load_codes(cache_ptr, pbase, tip, ok, OFF: tl.constexpr, BS: tl.constexpr, BITS: tl.constexpr,
               W: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, CPW: tl.constexpr,
               CM: tl.constexpr):
    """Codes [N, GP·CPW] of the tokens (page base pbase [N], offset in page tip [N])."""
    ptr = row_ptr(cache_ptr, pbase, tip, OFF, G, CM)
    return split_words(load_words(ptr, ok[:, None], BS, W, G, GP, CM), BITS, CPW, W)


@triton.jit
def load_fp16(cache_ptr, pbase, tip, ok, OFF: tl.constexpr):
    """fp16 plane field of the tokens → fp32 [N]."""
    p = (cache_ptr + pbase + OFF).to(tl.pointer_type(tl.float16))
    return tl.load(p + tip, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def store_fp16(cache_ptr, base, off, x, mask, OFF: tl.constexpr):
    """x fp32 [H] → fp16 plane field at page offset `off` (base [H] = page starts)."""
    p = (cache_ptr + base + OFF).to(tl.pointer_type(tl.float16))
    tl.store(p + off, x.to(tl.float16), mask=mask)


@triton.jit
def fp8_e4m3_value(b):
    """e4m3fn byte (int32) → fp32, by arithmetic (also under the interpreter, which has no fp8).
    The NaN byte never occurs in outlier planes (the store zeroes non-finite vectors)."""
    e = (b >> 3) & 15
    m = (b & 7).to(tl.float32)
    mag = tl.where(e == 0, m * 0.001953125, (8.0 + m) * tl.exp2((e - 10).to(tl.float32)))
    return tl.where((b & 128) != 0, -mag, mag)


@triton.jit
def load_outliers(cache_ptr, pbase, tip, ok, IDX_OFF: tl.constexpr, VAL_OFF: tl.constexpr,
                  NOUT: tl.constexpr, NOUTP: tl.constexpr):
    """Outlier channels (int32) and values (fp32) of the tokens, [N, NOUTP] each (columns past
    NOUT: channel 0, value 0). Planes are token-major, NOUT bytes per token."""
    j = tl.arange(0, NOUTP)[None, :]
    m = ok[:, None] & (j < NOUT)
    at = (pbase + tip * NOUT)[:, None] + j
    idx = tl.load(cache_ptr + IDX_OFF + at, mask=m, other=0).to(tl.int32)
    val = tl.load(cache_ptr + VAL_OFF + at, mask=m, other=0).to(tl.int32)
    return idx, tl.where(m, fp8_e4m3_value(val), 0.0)
