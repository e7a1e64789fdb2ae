"""Full-precision cache write kernel vs scatter_rows (its reference) — interpreter on CPU, the
real GPU under ``-m gpu``."""

import pytest
import torch

from tests.kernels import conftest
from tqattn.attention.flash_attn import scatter_rows


def _case(device, n, hk, d, nb, bs, src_dtype, cache_dtype, layout, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, nb, bs, hk, d, generator=gen).to(device, cache_dtype)
    if layout == "head_major":  # (N, Hk, D) views of (Hk, N, D) tensors: heads N·D apart
        kv = torch.randn(2, hk, n + 2, d, generator=gen).to(device, src_dtype)
        key, value = kv[0].transpose(0, 1), kv[1].transpose(0, 1)
    else:  # fused: K/V are views into a fused (N, 3·Hk, D) tensor
        width = 3 * hk if layout == "fused" else hk
        qkv = torch.randn(n + 2, width, d, generator=gen).to(device, src_dtype)
        key, value = (qkv[:, :hk], qkv[:, hk:2 * hk]) if layout == "fused" else (qkv, qkv * 2)
    slots = torch.randperm(nb * bs, generator=gen)[:n].to(device)
    slots[torch.rand(n, generator=gen).to(device) < 0.3] = -1  # padding tokens
    return cache, key, value, slots


def _check(device):
    from tqattn.kernels.kv_write import write_kv_triton
    cases = [(5, 2, 16, 4, 4, torch.float32, torch.float32, "plain"),
             (7, 2, 16, 4, 4, torch.bfloat16, torch.bfloat16, "fused"),
             (6, 3, 24, 3, 8, torch.bfloat16, torch.float32, "fused"),   # W not a power of two
             (4, 1, 8, 2, 4, torch.float32, torch.float16, "plain"),
             (7, 3, 24, 3, 8, torch.bfloat16, torch.bfloat16, "head_major")]
    if device == "cuda":
        cases += [(300, 8, 128, 64, 16, torch.bfloat16, torch.bfloat16, "fused"),  # W = 1024
                  (300, 8, 128, 64, 16, torch.bfloat16, torch.bfloat16, "head_major")]
    for n, hk, d, nb, bs, sdt, cdt, layout in cases:
        cache, key, value, slots = _case(device, n, hk, d, nb, bs, sdt, cdt, layout)
        ref = cache.clone()
        scatter_rows(ref.flatten(1, 2), slots, torch.stack((key[:n], value[:n])).to(cdt), dim=1)
        write_kv_triton(key, value, cache, slots)
        assert torch.equal(cache, ref), (n, hk, d, sdt, cdt, layout)
    # every slot padding: the cache is untouched
    cache, key, value, slots = _case(device, 3, 2, 16, 2, 4, torch.float32, torch.float32, "plain")
    before = cache.clone()
    write_kv_triton(key, value, cache, torch.full_like(slots, -1))
    assert torch.equal(cache, before)
    with pytest.raises(ValueError, match=r"\(Hk, D\)"):
        write_kv_triton(key[:, :1], value[:, :1], cache, slots)


@pytest.mark.skipif(not (conftest.INTERPRET and conftest.KERNELS_IMPORTED),
                    reason="CPU interpreter test (the GPU runs the -m gpu one)")
def test_write_kv_matches_scatter_rows():
    _check("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_write_kv_matches_scatter_rows_gpu():
    _check("cuda")
