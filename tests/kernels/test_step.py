"""kernels/step.py: where a decode call's new K/V are written, for each case (CPU)."""

import pytest
import torch

from tests.kernels import conftest
from tests.kernels._util import filled_cache
from tqattn.kernels import step
from tqattn.quant import paged
from tqattn.quant.codec import TQCodec

needs_triton = pytest.mark.skipif(not (conftest.INTERPRET and conftest.KERNELS_IMPORTED),
                                  reason="needs triton (the interpreter on CPU)")


def _case(preset="turboquant_k3v4_nc", d=128, hq=8, hk=2, bs=16):
    codec = TQCodec(preset, d)
    cache = torch.zeros(paged.kv_cache_shape(4, bs, hk, codec), dtype=torch.uint8)
    return codec, torch.zeros(2, hq, d), cache


def test_cpu_tensors_take_the_reference(monkeypatch):
    monkeypatch.delenv("TQATTN_FORCE_TRITON", raising=False)
    assert step.plan_decode_store(*_case()) == step.REFERENCE


@needs_triton
def test_forced_triton(monkeypatch):
    """With the Triton kernels on CPU tensors: the store kernel, then the portable decode (no
    tensor cores); the reference where no Triton kernel exists (QJL, odd block sizes)."""
    monkeypatch.setenv("TQATTN_FORCE_TRITON", "1")
    assert step.plan_decode_store(*_case()) == step.STORE_KERNEL
    assert step.plan_decode_store(*_case("tq_k3v4_qjl")) == step.REFERENCE
    assert step.plan_decode_store(*_case(bs=24)) == step.REFERENCE


@needs_triton
def test_tensor_core_device(monkeypatch):
    """On a tensor-core device the decode kernel stores the step's tokens itself exactly where
    it runs with rotated keys: its layouts at head size 128 (not fp8 keys), one row per
    sequence, no window or soft-cap, up to 8 query heads per KV head; everything else stores
    first."""
    monkeypatch.setenv("TQATTN_FORCE_TRITON", "1")
    monkeypatch.setattr(step, "tensor_cores", lambda device: True)
    codec, q, cache = _case()
    assert step.plan_decode_store(codec, q, cache) == step.DECODE_KERNEL
    assert step.plan_decode_store(*_case(hq=16)) == step.DECODE_KERNEL      # GQA 8
    assert step.plan_decode_store(*_case(hq=32)) == step.STORE_KERNEL       # GQA 16
    assert step.plan_decode_store(*_case("tq_k4v3")) == step.DECODE_KERNEL
    assert step.plan_decode_store(*_case("turboquant_4bit_nc")) == step.DECODE_KERNEL
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert step.plan_decode_store(*_case("turboquant_k8v4")) == step.STORE_KERNEL
    assert step.plan_decode_store(*_case("tq_k3o4v3.5")) == step.STORE_KERNEL
    assert step.plan_decode_store(*_case(d=64)) == step.STORE_KERNEL
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    for kw in ({"window": 128}, {"softcap": 30.0}, {"query_start_loc": qsl},
               {"query_pos_start": torch.tensor([3, 4])}):
        assert step.plan_decode_store(codec, q, cache, **kw) == step.STORE_KERNEL, kw
    monkeypatch.setattr(step, "tensor_cores", lambda device: False)
    assert step.plan_decode_store(codec, q, cache) == step.STORE_KERNEL


def test_tensor_cores_need_cuda():
    assert not step.tensor_cores("cpu")


def test_decode_attention_stores_where_planned(monkeypatch):
    """kernels.decode_attention with new K/V on the reference path: stored first (the cache
    holds them), then the reference decode reads them."""
    from tqattn import kernels
    monkeypatch.delenv("TQATTN_FORCE_TRITON", raising=False)
    codec = TQCodec("turboquant_k3v4_nc", 64)
    cache, bt, lens = filled_cache(codec, [20, 3], 2, 16)
    k, v = torch.randn(2, 2, 2, 64)
    slots = torch.stack([bt[0, 19 // 16].long() * 16 + 19 % 16, bt[1, 0].long() * 16 + 2])
    want = cache.clone()
    paged.store_ref(codec, k, v, want, slots)
    q = torch.randn(2, 4, 64)
    out = kernels.decode_attention(codec, q, cache, bt, lens, new_kv=(k, v, slots))
    assert torch.equal(cache, want)
    assert torch.equal(out, paged.decode_attention_ref(codec, q, want, bt, lens))


@pytest.mark.parametrize("groups,head_size,want", [
    (32 * 8, 128, 4),      # 32/8/128, B = 32: one wave of 8 programs on 132 SMs
    (32 * 4, 256, 8),      # 8/4/256, B = 32: one wave, not halved
    (128, 256, 8),         # 4/1/256, B = 128
    (32, 256, 16),         # 4/1/256, B = 32: 33 halved
    (32, 128, 33),         # head 128 keeps the whole wave
    (1, 256, 32),          # capped at 64, then halved
    (2000, 256, 1),        # more groups than resident programs: one split
])
def test_mma_split_count(groups, head_size, want):
    decode_mma = pytest.importorskip("tqattn.kernels.decode_mma")
    assert decode_mma.num_splits(8 * 132, groups, head_size) == want
