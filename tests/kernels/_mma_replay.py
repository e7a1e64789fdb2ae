"""Shared pieces of the CPU replays of the tensor-core kernel's operands (test_mma_operands.py,
test_mma_head64.py): one page holding a whole 64-token tile, its codes in natural order, and
gl.join / reshape / permute as torch operations."""

import torch

from tqattn.quant import paged
from tqattn.quant.codec import TQCodec
from tqattn.quant.packing import unpack_bits

BS = 64  # one page holds the whole 64-token tile


def page(preset, d=128, seed=0):
    """(codec, the page's bytes, the slots in vLLM's byte order) of BS random tokens."""
    codec = TQCodec(preset, d)
    g = torch.Generator().manual_seed(seed)
    cache = torch.zeros(paged.kv_cache_shape(1, BS, 1, codec), dtype=torch.uint8)
    k, v = torch.randn(BS, 1, d, generator=g), torch.randn(BS, 1, d, generator=g)
    paged.store_ref(codec, k, v, cache, torch.arange(BS))
    slots = paged.gather_slots_ref(codec, cache, torch.zeros(1, 1, dtype=torch.int32),
                                   torch.tensor([BS]))
    return codec, cache[0, 0], slots[0].reshape(BS, -1)


def codes(codec, slots, name):
    f = codec.layout.field(name)
    return unpack_bits(slots[:, f.offset:f.offset + f.nbytes], f.bits, f.count)   # (BS, d)


def stack(*xs):
    return torch.stack(xs, -1)           # gl.join: a new last dimension


def j4(a, b, c, d):
    return stack(stack(a, b), stack(c, d))


def j8(o):
    return stack(j4(*o[0:4]), j4(*o[4:8]))


def j16(o):
    return stack(stack(j4(*o[0:4]), j4(*o[4:8])), stack(j4(*o[8:12]), j4(*o[12:16])))


def permute_reshape(x, order, shape):
    """The lane dimension split into (g, t), then the kernel's permute and reshape."""
    return x.reshape(8, 4, *x.shape[1:]).permute(order).reshape(shape)
