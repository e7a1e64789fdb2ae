"""Offline (sm_90, no GPU): can a page-linear shared-memory tile, as TMA copies would leave it,
hand each lane its words in the decode's register order with one load a region (issue 27)?

Gluon 3.6 has no shared-memory gather, but a lane's words in a page region are affine in its
lane bits with power-of-two strides. ``tq_k4v3``'s head-256 key words of a 4-page tile
(16-token pages, both halves, :func:`tqattn.kernels.decode_mma._load_keys4` with MAP 1) in
int64 words of a page's key region: bit 0 the 16-byte pair, bit 1 lane bit 0, bit 2 lane bit 1,
bit 3 the half, bit 4 lane bit 2, bits 5-7 the token pair m; lane bits 3-4 pick the page slot.
So one ``.load`` in a ``DistributedLinearLayout`` over [4 slots, 256 words] gives every lane its
32 words; reshape / permute / split then yield its 32 [32] words (in the bit-reversed order of
``_load_k``'s tuple: a static re-index). The 3-bit value words (:func:`_load_values3`, two
loads: sub-planes 0-1 and 2) and the fp16 scalar planes (:func:`_scalars16`: the 8 lanes of a
page slot read the same 4 words, a broadcast) follow the same way. This compiles that, keys alone
and all of a tile's words, and prints the shared loads and any lane shuffles they cost (the page
offsets here are placeholders; the layouts are what is checked).

    PYTHONPATH=. python3 bench/lab/smem_word_layout.py
"""

from __future__ import annotations

import collections
import os
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.kernel_builds import compile_captured  # noqa: E402
from bench.sass_stats import disassemble, opcode  # noqa: E402
from tqattn.kernels.decode_mma import _LANE  # noqa: E402

# register bits: the pair's word, m (3 bits), the half — the order of _load_k's tuple
KEY_WORDS = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 32], [0, 64], [0, 128], [0, 8]],
    lane_bases=[[0, 2], [0, 4], [0, 16], [1, 0], [2, 0]],
    warp_bases=[], block_bases=[], shape=[4, 256]))
# 3-bit column-major value words (_load_values3): lane bits 0-1 pick the page slot (tokens
# 16(lane % 4)..), lane bits 2-4 (g) 2, 4, 8 words; registers: the pair, code word g + 8 (16),
# the half (32) and the sub-plane (64 each: planes 0-1 here, plane 2 in VALUE_PLANE2)
VALUE_WORDS = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 16], [0, 32], [0, 64]],
    lane_bases=[[1, 0], [2, 0], [0, 2], [0, 4], [0, 8]],
    warp_bases=[], block_bases=[], shape=[4, 128]))
VALUE_PLANE2 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 16], [0, 32]],
    lane_bases=[[1, 0], [2, 0], [0, 2], [0, 4], [0, 8]],
    warp_bases=[], block_bases=[], shape=[4, 64]))
# the 16 fp16 scalars of a key row's page (_scalars16, MAP 1): 4 words, the same for the 8 lanes
# of a slot (lane bits 0-2 broadcast), lane bits 3-4 the slot
SCALAR_WORDS = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2]], lane_bases=[[0, 0], [0, 0], [0, 0], [1, 0], [2, 0]],
    warp_bases=[], block_bases=[], shape=[4, 4]))
_FILL = gl.constexpr(gl.BlockedLayout([1, 16], [1, 32], [1, 1], [1, 0]))


@gluon.jit
def _words(x, N: gl.constexpr):
    """The [32] words of x [32, 2, .., 2] (N trailing dimensions of 2), split off last first."""
    ws = (x,)
    for _ in gl.static_range(N):
        nw = ()
        for i in gl.static_range(len(ws)):
            a, b = gl.split(ws[i])
            nw = nw + (a, b)
        ws = nw
    return ws


@gluon.jit
def _words_kernel(src_ptr, out_ptr, VALUES: gl.constexpr):
    smem = gl.allocate_shared_memory(gl.int64, [4, 512], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    r = gl.arange(0, 4, layout=gl.SliceLayout(1, _FILL))
    c = gl.arange(0, 512, layout=gl.SliceLayout(0, _FILL))
    smem.store(gl.load(src_ptr + r[:, None] * 512 + c[None, :]))  # stands in for the copies
    gl.thread_barrier()
    x = smem.slice(0, 256, dim=1).load(KEY_WORDS)
    # [slot, m2, m1, m0, lane2, half, lane1, lane0, pair] → [lane..., half, m2, m1, m0, pair]
    x = gl.reshape(gl.permute(gl.reshape(x, [4, 2, 2, 2, 2, 2, 2, 2, 2]),
                              [0, 4, 6, 7, 5, 1, 2, 3, 8]), [32, 2, 2, 2, 2, 2])
    ws = _words(x, 5)  # the last dimensions split off: pair, m0, m1, m2, half
    acc = gl.zeros([32], gl.int64, layout=_LANE)
    for i in gl.static_range(len(ws)):
        acc = acc * 3 + gl.convert_layout(ws[i], _LANE)
    if VALUES:  # the value words (page offsets 256.. here) and two scalar planes (448.., 452..)
        v = smem.slice(256, 128, dim=1).load(VALUE_WORDS)
        # [s1, s0, b6, b5, b4, b3, b2, b1, b0] → [b3, b2, b1 (g), s1, s0, b6, b5, b4, b0]
        v = gl.reshape(gl.permute(gl.reshape(v, [2, 2, 2, 2, 2, 2, 2, 2, 2]),
                                  [5, 6, 7, 0, 1, 2, 3, 4, 8]), [32, 2, 2, 2, 2])
        v2 = smem.slice(384, 64, dim=1).load(VALUE_PLANE2)
        v2 = gl.reshape(gl.permute(gl.reshape(v2, [2, 2, 2, 2, 2, 2, 2, 2]),
                                   [4, 5, 6, 0, 1, 2, 3, 7]), [32, 2, 2, 2])
        ws = _words(v, 4) + _words(v2, 3)
        for i in gl.static_range(len(ws)):
            acc = acc * 5 + gl.convert_layout(ws[i], _LANE)
        for k in gl.static_range(2):  # the planes' words, as the broadcast layout holds them
            n = smem.slice(448 + 4 * k, 4, dim=1).load(SCALAR_WORDS)
            ri = gl.arange(0, 4, layout=gl.SliceLayout(1, SCALAR_WORDS))
            ci = gl.arange(0, 4, layout=gl.SliceLayout(0, SCALAR_WORDS))
            gl.store(out_ptr + 32 + 16 * k + ri[:, None] * 4 + ci[None, :], n)
    gl.store(out_ptr + gl.arange(0, 32, layout=_LANE), acc)


def main() -> None:
    for values in (False, True):
        kernel, _ = compile_captured(_words_kernel, (torch.zeros(2048, dtype=torch.int64),
                                                     torch.zeros(64, dtype=torch.int64)),
                                     {"VALUES": values, "num_warps": 1})
        instrs, _ = disassemble(kernel.asm["cubin"])
        count = collections.Counter(opcode(i) for _, i in instrs)
        lds = [i for _, i in instrs if opcode(i) == "LDS"]
        what = "keys, values, 2 scalar planes" if values else "keys"
        print(f"{what}: shared loads {len(lds)} "
              f"({', '.join(sorted(set(i.split()[0] for i in lds)))}), "
              f"lane shuffles {count.get('SHFL', 0)}, kernel instructions {len(instrs)}")


if __name__ == "__main__":
    main()
