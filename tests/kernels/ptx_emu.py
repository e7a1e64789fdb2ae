"""A tiny interpreter for the straight-line PTX of ``tqattn/kernels/_asm.py`` (b32 integer ops,
``prmt``, ``lop3`` and f16x2 arithmetic), so the inline-asm conversions can be checked against
the page format on CPU, where triton's interpreter cannot run inline asm."""

from __future__ import annotations

import re

import numpy as np

M32 = 0xFFFFFFFF


def _prmt(a: int, b: int, sel: int) -> int:
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        c = (sel >> (4 * i)) & 0xF
        byte = src[c & 7]
        if c & 8:  # sign-replicate mode
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    out = 0
    for bit in range(32):
        idx = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
        out |= ((lut >> idx) & 1) << bit
    return out


def _halves(x: int) -> np.ndarray:
    return np.array([x & 0xFFFF, x >> 16], dtype=np.uint16).view(np.float16)


def _pack(h: np.ndarray) -> int:
    u = h.astype(np.float16).view(np.uint16)
    return int(u[0]) | int(u[1]) << 16


def run(text: str, inputs: dict[int, int]) -> dict[int, int]:
    """Execute ``text`` with ``$n`` operands from ``inputs``; returns every ``$n`` written."""
    regs: dict[str, int] = {f"${k}": v & M32 for k, v in inputs.items()}

    def val(tok: str) -> int:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", tok):
            return int(tok, 0) & M32
        raise KeyError(f"read of unset register {tok}")

    written: dict[int, int] = {}
    for line in text.replace("{", "\n").replace("}", "\n").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        args = [a.strip() for a in rest.split(",")]
        dst, src = args[0], args[1:]
        if op == "mov.b32":
            r = val(src[0])
        elif op == "and.b32":
            r = val(src[0]) & val(src[1])
        elif op == "or.b32":
            r = val(src[0]) | val(src[1])
        elif op == "shr.b32":
            r = val(src[0]) >> val(src[1])
        elif op == "shl.b32":
            r = (val(src[0]) << val(src[1])) & M32
        elif op == "mul.lo.u32":
            r = (val(src[0]) * val(src[1])) & M32
        elif op == "prmt.b32":
            r = _prmt(val(src[0]), val(src[1]), val(src[2]))
        elif op == "lop3.b32":
            r = _lop3(val(src[0]), val(src[1]), val(src[2]), val(src[3]))
        elif op == "sub.f16x2":
            r = _pack(_halves(val(src[0])) - _halves(val(src[1])))
        elif op == "fma.rn.f16x2":
            a, b, c = (_halves(val(s)).astype(np.float32) for s in src)
            r = _pack((a * b + c).astype(np.float16))  # exact here: small integers
        else:
            raise NotImplementedError(op)
        regs[dst] = r & M32
        if dst.startswith("$"):
            written[int(dst[1:])] = regs[dst]
    return written
