"""Triton helpers shared by the kernels: unpack code tiles, their coordinate order, fp16 fields."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_words(ptr, ok, BS: tl.constexpr, W: tl.constexpr, G: tl.constexpr, GP: tl.constexpr):
    """[N, GP] int32 words of a code field; ptr [N, 1] points at the token's row of sub-plane 0."""
    g = tl.arange(0, GP)[None, :]
    if G == GP:
        m = ok
    else:
        m = ok & (g < G)
    w = tl.load(ptr + g, mask=m, other=0).to(tl.int32)
    if W == 3:
        w = w | (tl.load(ptr + BS * G + g, mask=m, other=0).to(tl.int32) << 8)
        w = w | (tl.load(ptr + 2 * BS * G + g, mask=m, other=0).to(tl.int32) << 16)
    return w


@triton.jit
def split_words(w, BITS: tl.constexpr, CPW: tl.constexpr):
    """Words [N, GP] → codes [N, GP·CPW], column g·CPW + i = code i of word g."""
    M: tl.constexpr = (1 << BITS) - 1
    if CPW == 1:
        c = w
    elif CPW == 2:
        c = tl.join(w & M, (w >> BITS) & M)
    elif CPW == 4:
        c = tl.join(tl.join(w & M, (w >> BITS) & M),
                    tl.join((w >> 2 * BITS) & M, (w >> 3 * BITS) & M))
    else:
        c = tl.join(tl.join(tl.join(w & M, (w >> BITS) & M),
                            tl.join((w >> 2 * BITS) & M, (w >> 3 * BITS) & M)),
                    tl.join(tl.join((w >> 4 * BITS) & M, (w >> 5 * BITS) & M),
                            tl.join((w >> 6 * BITS) & M, (w >> 7 * BITS) & M)))
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
               W: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, CPW: tl.constexpr):
    """Codes [N, GP·CPW] of the tokens (page base pbase [N], offset in page tip [N])."""
    ptr = cache_ptr + (pbase + OFF + tip * G)[:, None]
    return split_words(load_words(ptr, ok[:, None], BS, W, G, GP), BITS, CPW)


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
