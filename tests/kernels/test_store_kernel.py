"""Store kernel vs store_ref under triton's interpreter (CPU, tiny shapes)."""

import contextlib
import math
from unittest import mock

import pytest
import torch

from tests.kernels import conftest
from tests.kernels._util import kernel_presets
from tqattn.quant import paged
from tqattn.quant.codec import TQCodec

pytestmark = pytest.mark.skipif(not (conftest.INTERPRET and conftest.KERNELS_IMPORTED),
                                reason="CPU interpreter tests (GPU runs test_kernels_gpu.py)")

PRESETS = kernel_presets()   # every preset the kernels take


def _store_both(codec, k, v, slots, nb, bs, hk, **sizes):
    """The reference's and the kernel's bytes; sizes: store module constants / functions patched
    for the call (launch sizes the tiny test shapes would not pick)."""
    from tqattn.kernels import store
    init = torch.randint(0, 256, paged.kv_cache_shape(nb, bs, hk, codec), dtype=torch.uint8)
    a, b = init.clone(), init.clone()
    paged.store_ref(codec, k, v, a, slots)
    with contextlib.ExitStack() as stack:
        for name, value in sizes.items():
            stack.enter_context(mock.patch.object(store, name, value))
        store.store_kv_triton(codec, k, v, b, slots)
    return a, b


@pytest.mark.parametrize("name,d,bs", [(p, 64, 16) for p in PRESETS]
                         + [("turboquant_k3v4_nc", 80, 32), ("tq_k3.5v3.5", 96, 16),
                            ("turboquant_k8v4", 80, 16), ("tq_k3o4v3.5", 96, 32)])
def test_store_bytes_match_reference(name, d, bs):
    codec = TQCodec(name, d)
    hk, n, nb = 3, 6, 3
    k = torch.randn(n, hk, d) * 3
    v = torch.randn(n, hk, d)
    k[1, 0, 3] = math.nan        # non-finite vectors are stored with NaN markers
    v[2, 2, 0] = math.inf
    slots = torch.randperm(nb * bs)[:n]
    slots[4] = -1                # padding: skipped
    a, b = _store_both(codec, k, v, slots, nb, bs, hk)
    assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["turboquant_k3v4_nc", "tq_k3.5v3.5", "turboquant_k8v4"])
@pytest.mark.parametrize("rows_per_program", [16, 64])
def test_store_rows_per_program(name, rows_per_program):
    """Programs whose (token, head) rows span several tokens: a row count that is not a multiple
    of the program's rows, padding slots inside and at the end."""
    codec = TQCodec(name, 64)
    hk, n, nb, bs = 3, 29, 4, 16
    k, v = torch.randn(n, hk, 64) * 2, torch.randn(n, hk, 64)
    slots = torch.randperm(nb * bs)[:n]
    slots[[5, 21, 28]] = -1
    a, b = _store_both(codec, k, v, slots, nb, bs, hk, ROWS_PER_PROGRAM=rows_per_program)
    assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["turboquant_k3v4_nc", "tq_k3.5v3.5", "tq_k3o4v3.5"])
@pytest.mark.parametrize("block_k", [16, 32])
def test_store_rotation_chunks(name, block_k):
    """The rotation in K chunks (the path of large steps; decode-size steps take it in one):
    the same bytes."""
    codec = TQCodec(name, 64)
    hk, n, nb, bs = 2, 11, 2, 16
    k, v = torch.randn(n, hk, 64) * 3, torch.randn(n, hk, 64)
    k[2, 1, 7] = math.inf
    slots = torch.randperm(nb * bs)[:n]
    slots[3] = -1
    a, b = _store_both(codec, k, v, slots, nb, bs, hk, DECODE_BLOCK_K=block_k)
    assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["turboquant_k3v4_nc", "turboquant_4bit_nc", "tq_k3v4_debias",
                                  "tq_k3.5v3.5", "turboquant_k8v4"])
@pytest.mark.parametrize("key_splits", [2, 4])
def test_store_key_splits(name, key_splits):
    """Key row blocks split over programs by rotated coordinates (presets where the split
    applies and, falling back to one program, where it does not): the same bytes, twice in a
    row (the parts' scratch is left at zero)."""
    from tqattn.kernels import store
    codec = TQCodec(name, 64)
    hk, n, nb, bs = 3, 13, 3, 16
    k, v = torch.randn(n, hk, 64) * 3, torch.randn(n, hk, 64)
    k[2, 1, 7] = math.inf
    slots = torch.randperm(nb * bs)[:n]
    slots[[3, 12]] = -1
    splits = lambda n_kv, device: key_splits  # noqa: E731
    a, b = _store_both(codec, k, v, slots, nb, bs, hk, auto_key_splits=splits)
    assert torch.equal(a, b)
    k2 = torch.randn(n, hk, 64)
    paged.store_ref(codec, k2, v, a, slots)
    with mock.patch.object(store, "auto_key_splits", splits):
        store.store_kv_triton(codec, k2, v, b, slots)
    assert torch.equal(a, b)


def test_auto_key_splits():
    """The most splits whose launch (keys and values) fits one wave of the 4 stand-in SMs."""
    from tqattn.kernels.store import auto_key_splits
    assert [auto_key_splits(n, "cpu") for n in (0, 1, 2, 3)] == [4, 2, 1, 1]


@pytest.mark.parametrize("name", ["turboquant_k3v4_nc", "tq_k4v3", "tq_k3.5v3.5", "tq_k3o4v3.5"])
def test_store_tf32x3_rotation(name):
    """The GPU's rotation (hi/lo split, three dots; the interpreter computes each dot in fp32)
    lands within ~2^-22 of the reference: codes differ at most where a coordinate sits on a
    bucket boundary, i.e. (almost) never."""
    codec = TQCodec(name, 64)
    hk, n, nb, bs = 4, 64, 4, 16
    k, v = torch.randn(n, hk, 64) * 3, torch.randn(n, hk, 64)
    k[3, 1, 5] = math.nan
    slots = torch.randperm(nb * bs)[:n]
    a, b = _store_both(codec, k, v, slots, nb, bs, hk, interpreted=lambda device: False)
    assert (a != b).float().mean().item() < 1e-3


@pytest.mark.parametrize("name,splits", [
    ("turboquant_k3v4_nc", 1), ("turboquant_k3v4_nc", 2), ("tq_k4v3", 1), ("tq_k4v3", 4),
    ("tq_k3.5v3.5", 1), ("tq_k3o4v3.5", 1), ("turboquant_k8v4", 1), ("turboquant_3bit_nc", 2)])
@pytest.mark.parametrize("tf32x3", [False, True])
def test_store_centers_keys(name, splits, tf32x3):
    """key_offset (μ, μ·R): the kernel stores what the reference stores for k − μ (fp32), on
    keys whose energy is mostly the offset (as on Qwen2.5's worst layers); non-finite rows
    still store their markers. The kernel rotates k and subtracts μ·R (the reference rotates
    k − μ), so a code may differ where a coordinate sits on a bucket boundary: (almost) never."""
    from tqattn.attention.backend import AttentionLayerSpec
    from tqattn.attention.key_centering import KeyOffset
    from tqattn.kernels import store
    codec = TQCodec(name, 64)
    hk, n, nb, bs = 3, 40, 3, 16
    mu = torch.randn(hk, 64) * 4
    k = (mu + torch.randn(n, hk, 64)).to(torch.bfloat16)
    v = torch.randn(n, hk, 64).to(torch.bfloat16)
    k[5, 1, 9] = math.nan
    slots = torch.randperm(nb * bs)[:n]
    slots[7] = -1
    spec = AttentionLayerSpec(layer_idx=0, num_heads=hk, num_kv_heads=hk, head_size=64,
                              scale=0.125, dtype=torch.bfloat16, kv_cache_dtype=name)
    offset = KeyOffset(mu, spec).for_store(codec.rotation)
    init = torch.randint(0, 256, paged.kv_cache_shape(nb, bs, hk, codec), dtype=torch.uint8)
    a, b = init.clone(), init.clone()
    paged.store_ref(codec, k.float() - offset[0], v, a, slots)
    with mock.patch.object(store, "auto_key_splits", lambda n_kv, device: splits), \
            mock.patch.object(store, "interpreted", lambda device: not tf32x3):
        store.store_kv_triton(codec, k, v, b, slots, key_offset=offset)
    assert (a != b).float().mean().item() < 2e-3
    c = init.clone()
    paged.store_ref(codec, k, v, c, slots)      # uncentered: most bytes differ
    assert (a != c).float().mean().item() > 0.2


def test_store_refuses_a_key_offset_it_would_misread():
    from tqattn.kernels import store
    codec = TQCodec("tq_k4v3", 64)
    k = v = torch.randn(4, 2, 64)
    cache = torch.zeros(paged.kv_cache_shape(1, 16, 2, codec), dtype=torch.uint8)
    mu = torch.randn(2, 64)
    for bad in ((mu, mu.t().contiguous().t()), (mu, mu.double()), (mu.half(), mu), (mu, mu[:1])):
        with pytest.raises(ValueError, match=r"key_offset: contiguous fp32 \(μ, μ·R\) of shape \(2, 64\)"):
            store.store_kv_triton(codec, k, v, cache, torch.arange(4), key_offset=bad)


def test_store_half_inputs():
    codec = TQCodec("turboquant_k3v4_nc", 64)
    k = torch.randn(4, 2, 64).to(torch.bfloat16)
    v = torch.randn(4, 2, 64).to(torch.float16)
    a, b = _store_both(codec, k, v, torch.arange(4), 1, 16, 2)
    assert torch.equal(a, b)


def test_fp8_encoding_edge_values():
    codec = TQCodec("turboquant_k8v4", 16 * 4)
    special = torch.tensor([0.0, -0.0, 1e-9, 2 ** -10, 3 * 2 ** -10, 2 ** -9 * 1.5, 2 ** -6,
                            0.0137, 1.0625, 1.1875, 1.125 + 2 ** -5, 240.0, 447.0, 448.0, 460.0,
                            1e6, -1e6, -3.3, math.nan, math.inf, -math.inf, 2 ** -7 * 1.0625,
                            2 ** -8 + 2 ** -10, 17.5, -0.001953125, 0.0029296875, 0.5 + 2 ** -5,
                            2 ** -6 * 0.9375, 2 ** -6 * 0.96875, 300.0, 320.0, 352.0])
    k = torch.randn(1, 1, 64)
    k[0, 0, :special.numel()] = special
    a, b = _store_both(codec, k, torch.randn(1, 1, 64), torch.tensor([5]), 1, 16, 1)
    assert torch.equal(a, b)
