"""The tensor-core kernel's own store of a decode step's new token (kernels/decode_mma.py,
_store_new_token), through its PyTorch twin ``store_new_token_ref`` — the same fp32 transform,
codes, fp64 folding and byte packing — against the reference store, in every format the kernel
stores (3-bit or 4-bit keys; 4-bit uniform or rotated, 3-bit rotated or uniform values), at head
sizes 128 and 256. The kernel
itself runs on the GPU only (test_kernels_gpu.py::test_decode_fused_store_gpu)."""

import pytest
import torch

from tests.kernels._util import rel_err
from tqattn.quant import paged
from tqattn.quant.codec import TQCodec

decode_mma = pytest.importorskip("tqattn.kernels.decode_mma")


@pytest.mark.parametrize("name", ["turboquant_k3v4_nc", "tq_k4v3", "turboquant_4bit_nc",
                                  "turboquant_3bit_nc", "tq_k3v3", "tq_k4v4", "tq_k3v4"])
@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("d", [128, 256])
def test_store_new_token_twin_matches_reference(name, bs, d):
    """Bytes as the reference store writes them (a code may differ only where a coordinate sits
    on a bucket boundary: the twin rotates by Walsh–Hadamard butterflies, the reference by a
    matmul), non-finite rows marked, padding slots untouched, several tokens per page."""
    from tqattn.kernels._spec import kernel_spec
    codec = TQCodec(name, d)
    spec = kernel_spec(codec, bs)
    assert spec.mma.store
    hk, n, nb = 4, 24, 6
    g = torch.Generator().manual_seed(bs)
    k = torch.randn(n, hk, d, generator=g) * 3
    v = torch.randn(n, hk, d, generator=g)
    k[2, 1, d - 5] = float("nan")                       # in the second half at 256
    v[4, 2, 1] = float("inf")
    slots = torch.randperm(nb * bs, generator=g)[:n]
    slots[7] = -1
    init = torch.randint(0, 256, paged.kv_cache_shape(nb, bs, hk, codec), dtype=torch.uint8,
                         generator=g)
    a, b = init.clone(), init.clone()
    paged.store_ref(codec, k, v, a, slots)
    decode_mma.store_new_token_ref(spec, k, v, b, slots)
    assert (a != b).float().mean().item() < 1e-3
    bt = torch.arange(nb, dtype=torch.int32)[None]
    for x, y in zip(paged.dequant_ref(codec, a, bt, torch.tensor([nb * bs])),
                    paged.dequant_ref(codec, b, bt, torch.tensor([nb * bs]))):
        assert torch.equal(x.isnan(), y.isnan())
        # the unwritten slots' random bytes can decode to inf: both caches hold them alike
        assert torch.equal(x.isinf(), y.isinf())
        fin = x.isfinite()
        assert rel_err(y[fin], x[fin]) < 1e-3
    assert x[slots[slots >= 0]].isnan().any()           # the non-finite rows' markers


def test_store_new_token_ref_refuses_what_the_kernel_does_not_store():
    from tqattn.kernels._spec import kernel_spec
    spec = kernel_spec(TQCodec("turboquant_k8v4", 128), 16)
    with pytest.raises(ValueError, match="does not store"):
        decode_mma.store_new_token_ref(spec, torch.zeros(1, 1, 128), torch.zeros(1, 1, 128),
                                       torch.zeros(1, 1, 16 * spec.codec.slot_bytes,
                                                   dtype=torch.uint8), torch.tensor([0]))
