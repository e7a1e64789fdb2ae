"""Helpers for the kernel tests: random paged caches filled through the reference store."""

import torch

from tqattn.quant import paged
from tqattn.quant.codec import TQCodec
from tqattn.quant.presets import PRESETS


def kernel_presets(head_dim: int = 64, block_size: int = 16) -> list[str]:
    """Every preset the Triton kernels take at this head size (QJL presets have none)."""
    try:
        from tqattn.kernels._spec import kernel_spec
    except ImportError:  # no Triton: the kernel tests skip
        return []
    out = []
    for name in PRESETS:
        try:
            kernel_spec(TQCodec(name, head_dim), block_size)
        except NotImplementedError:
            continue
        out.append(name)
    return out


def random_block_table(lens, block_size, extra_blocks=1, device="cpu", gen=None):
    """Random permutation of blocks; each sequence gets ceil(len / block_size) of them."""
    per = [(n + block_size - 1) // block_size for n in lens]
    nb = sum(per) + extra_blocks
    perm = torch.randperm(nb, generator=gen)
    bt = torch.zeros(len(lens), max(per + [1]), dtype=torch.int32)
    i = 0
    for b, n in enumerate(per):
        bt[b, :n] = perm[i:i + n]
        i += n
    return bt.to(device), nb


def slots_for(bt, b, positions, block_size):
    return bt[b, positions // block_size].long() * block_size + positions % block_size


def filled_cache(codec: TQCodec, lens, hk, block_size, device="cpu", key_scale=1.0, seed=0,
                 stale=False):
    """(cache, block_table, seq_lens) with random K/V stored by the reference; ``stale``: the
    cache starts as random bytes (what earlier requests leave behind in page tails)."""
    gen = torch.Generator().manual_seed(seed)
    bt, nb = random_block_table(lens, block_size, gen=gen)
    bt = bt.to(device)
    shape = paged.kv_cache_shape(nb, block_size, hk, codec)
    cache = (torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8) if stale
             else torch.zeros(shape, dtype=torch.uint8)).to(device)
    d = codec.head_dim
    for b, n in enumerate(lens):
        pos = torch.arange(n, device=device)
        k = (torch.randn(n, hk, d, generator=gen) * key_scale).to(device)
        v = torch.randn(n, hk, d, generator=gen).to(device)
        paged.store_ref(codec, k, v, cache, slots_for(bt, b, pos, block_size))
    return cache, bt, torch.tensor(lens, dtype=torch.int32, device=device)


def rel_err(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
