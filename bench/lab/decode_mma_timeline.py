"""The tensor-core decode kernel with per-program timestamps (a diagnostic, not a product build).

Built from the product kernel's own source (``tqattn.kernels.decode_mma._decode_mma_kernel``)
with stamp lines inserted at fixed anchors, so it stays the product kernel plus the stamps; an
anchor that is gone fails loudly. Within :func:`recording_timeline`, the product entry points
launch this build instead, and each program writes int64 [8] at its linear index
(pid · NUM_SPLITS + split): %globaltimer (ns) at its start, after its tiles (and its split
output's stores), after the split counter's atomic, at its end; its SM id; the counter's old
value; unused; its warp slot in the SM (%warpid). The split count stays the product build's
(programs_per_sm is read from the product kernel before the swap).
"""

from __future__ import annotations

import contextlib
import inspect
import linecache
import textwrap

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from tqattn.kernels import decode_mma


@gluon.jit
def _globaltimer():
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64,
                                     is_pure=False, pack=1)


@gluon.jit
def _smid():
    return gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32,
                                     is_pure=False, pack=1)


# (anchor line of the product kernel, lines inserted after it); indentation as in the kernel
_STAMPS = [
    ("    groups = gl.num_programs(0)\n", "    t_start = _globaltimer()\n"),
    ("    kvh = pid % HK\n",
     "    tlp = tl_ptr + (pid * NUM_SPLITS + split).to(gl.int64) * 8\n"
     "    gl.store(tlp, t_start)\n"
     "    gl.store(tlp + 4, _smid().to(gl.int64))\n"
     "    gl.store(tlp + 7, _warpid().to(gl.int64))\n"),
    ("    if NUM_SPLITS == 1:  # the group's only split: its rows are final\n",
     "        gl.store(tlp + 1, _globaltimer())\n"),
    ("        gl.thread_barrier()\n        done = gl.atomic_add(", None),   # see _source
    ("                    gl.store(count_ptr + groups + 2, 0)\n",
     "    gl.thread_barrier()\n    gl.store(tlp + 3, _globaltimer())\n"),
]


def _source() -> str:
    src = textwrap.dedent(inspect.getsource(decode_mma._decode_mma_kernel.fn))
    src = src[src.index("def _decode_mma_kernel("):]
    src = src.replace("K_BND: gl.constexpr):", "K_BND: gl.constexpr, tl_ptr):", 1)
    for anchor, add in _STAMPS:
        if src.count(anchor) != 1:
            raise RuntimeError(f"timeline build: anchor {anchor!r} not found once in the "
                               f"product kernel; update bench/lab/decode_mma_timeline.py")
        if add is None:   # around the split counter's atomic
            line = ('        done = gl.atomic_add(count_ptr + pid, 1, sem="acq_rel", '
                    'scope="gpu")\n')
            src = src.replace(line, "        gl.store(tlp + 1, _globaltimer())\n" + line
                              + "        gl.store(tlp + 2, _globaltimer())\n"
                              "        gl.store(tlp + 5, done.to(gl.int64))\n", 1)
        else:
            src = src.replace(anchor, anchor + add, 1)
    return src


def _build():
    src = _source()
    name = "<bench/lab/decode_mma_timeline: _decode_mma_kernel>"
    linecache.cache[name] = (len(src), None, src.splitlines(True), name)   # for getsource
    ns = dict(decode_mma.__dict__, _globaltimer=_globaltimer, _smid=_smid)
    exec(compile(src, name, "exec"), ns)
    product = decode_mma._decode_mma_kernel
    return gluon.jit(do_not_specialize=list(product.do_not_specialize))(ns["_decode_mma_kernel"])


_KERNEL: list = []


@contextlib.contextmanager
def recording_timeline(buf: torch.Tensor):
    """Within the block, tensor-core decode launches run the stamped build, writing into buf
    (int64, [≥ programs, 8]); a diagnostic that leaves the results unchanged."""
    if buf.dtype != torch.int64 or buf.dim() != 2 or buf.shape[1] != 8:
        raise ValueError(f"timeline buffer: int64 [programs, 8] expected, got {buf.dtype} "
                         f"{tuple(buf.shape)}")
    if not _KERNEL:
        _KERNEL.append(_build())
    kernel, product = _KERNEL[0], decode_mma._decode_mma_kernel

    class _Stamped:
        def __getitem__(self, grid):
            if grid[0] * grid[1] > buf.shape[0]:
                raise ValueError(f"timeline buffer: {buf.shape[0]} rows for "
                                 f"{grid[0] * grid[1]} programs")
            return lambda *args, **kw: kernel[grid](*args, tl_ptr=buf, **kw)

        def warmup(self, *args, **kw):   # programs_per_sm: the product build's count
            return product.warmup(*args, **kw)

    decode_mma._decode_mma_kernel = _Stamped()
    try:
        yield buf
    finally:
        decode_mma._decode_mma_kernel = product
