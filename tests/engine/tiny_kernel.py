"""A small Triton kernel for tests/engine/test_precompile.py, in a module a compile worker can
import cheaply. Made a JITFunction whatever TRITON_INTERPRET says (test modules set it)."""

import triton.language as tl
from triton.runtime.jit import JITFunction


def add_one(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)


add_one = JITFunction(add_one)
