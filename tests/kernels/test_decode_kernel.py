"""Decode attention kernel vs decode_attention_ref under triton's interpreter (CPU, tiny shapes).

Small tiles (BLOCK_N=16, patched in for the test) and several splits so that every program walks
several tiles (register prefetch) and the LSE merge has work to do.
"""

import contextlib
import types
from unittest import mock

import pytest
import torch

from tests.kernels import conftest
from tests.kernels._util import filled_cache, kernel_presets, rel_err
from tqattn.quant import paged
from tqattn.quant.codec import TQCodec
from tqattn.quant.rotation import haar_rotation

pytestmark = pytest.mark.skipif(not (conftest.INTERPRET and conftest.KERNELS_IMPORTED),
                                reason="CPU interpreter tests (GPU runs test_kernels_gpu.py)")


def _check(name, d=64, hk=1, group=2, lens=(37, 6), bs=16, dtype=torch.float32, rows=None,
           continuation=False, block_n=16, num_splits=2, **kw):
    """block_n: the portable kernel's tile (None: its own choice for the layout)."""
    from tqattn.kernels import decode
    codec = TQCodec(name, d)
    cache, bt, seq_lens = filled_cache(codec, list(lens), hk, bs, key_scale=2.0, stale=True)
    qsl = qpos = None
    n = len(lens)
    if rows is not None:
        qsl = torch.tensor([0] + torch.tensor(rows).cumsum(0).tolist(), dtype=torch.int32)
        n = sum(rows)
        qpos = seq_lens.clone() if continuation else None
    q = torch.randn(n, hk * group, d).to(dtype)
    ref, lse_ref = paged.decode_attention_ref(codec, q, cache, bt, seq_lens, qsl, qpos,
                                              return_lse=True, **kw)
    with (mock.patch.object(decode, "_block_n", lambda spec: block_n) if block_n
          else contextlib.nullcontext()):
        out, lse = decode.decode_attention_triton(codec, q, cache, bt, seq_lens, qsl, qpos,
                                                  return_lse=True, num_splits=num_splits, **kw)
    assert out.dtype == dtype and out.shape == ref.shape
    assert rel_err(out, ref) < (2e-3 if dtype == torch.float32 else 1e-2)
    fin = torch.isfinite(lse_ref)
    assert torch.equal(fin, torch.isfinite(lse))
    assert (lse[fin] - lse_ref[fin]).abs().max().item() < 2e-3
    return out, lse


@pytest.mark.parametrize("name", kernel_presets())
def test_presets(name):
    _check(name)


def test_window_softcap():
    _check("turboquant_k3v4_nc", lens=(45, 3), window=12, softcap=4.0)


def test_rows_and_continuation():
    # short chunked-prefill continuation: rows see exactly the compressed prefix, with a window
    _check("turboquant_k8v4", lens=(30, 20, 9), rows=[4, 0, 2], continuation=True, window=10)
    # several causal rows per sequence (their own tokens are the last ones in the cache)
    _check("tq_k4v4", lens=(30, 20), rows=[5, 3])


def test_rows_without_keys():
    out, lse = _check("turboquant_4bit_nc", lens=(0, 17))
    assert bool((out[0] == 0).all()) and bool(torch.isinf(lse[0]).all())


def test_outlier_keys_rows_dtype_head_size():
    """Outlier-split keys gather the unrotated query: several rows, a window, bf16, head size 80."""
    _check("tq_k3o4v3.5", d=80, hk=2, group=3, lens=(40, 7), bs=32, dtype=torch.bfloat16,
           rows=[3, 2], window=9)


def test_gqa_dtype_block_size_head_size():
    _check("turboquant_k3v4_nc", d=80, hk=2, group=3, lens=(40, 7), bs=32, dtype=torch.float16)
    _check("turboquant_k8v4", hk=2, group=1, dtype=torch.bfloat16)


def test_default_tiles_and_splits():
    _check("turboquant_k8v4", block_n=None, num_splits=None)
    _check("turboquant_4bit_nc", lens=(300, 70), block_n=None, num_splits=None)


def test_rejects_bad_shapes():
    from tqattn.kernels.decode import decode_attention_triton
    codec = TQCodec("turboquant_k3v4_nc", 64)
    cache, bt, lens = filled_cache(codec, [5], 2, 16)
    with pytest.raises(ValueError, match="does not fit"):
        decode_attention_triton(codec, torch.randn(1, 3, 64), cache, bt, lens)
    with pytest.raises(NotImplementedError, match="QJL"):
        decode_attention_triton(TQCodec("tq_k3v4_qjl", 64), torch.randn(1, 2, 64),
                                torch.zeros(1, 2, 16 * TQCodec("tq_k3v4_qjl", 64).slot_bytes,
                                            dtype=torch.uint8), bt, lens)
    with pytest.raises(ValueError, match="num_splits=65"):
        decode_attention_triton(codec, torch.randn(1, 2, 64), cache, bt, lens, num_splits=65)


def _mma_stubs(monkeypatch, calls):
    """The tensor-core path's host side on CPU: a pretend tensor-core device, 7 resident programs
    per SM, the launch recorded instead of run (it needs a GPU)."""
    from tqattn.kernels import decode_mma, step
    monkeypatch.setattr(step, "tensor_cores", lambda device: True)
    monkeypatch.setattr(decode_mma, "programs_per_sm", lambda *a, **kw: 7)
    monkeypatch.setattr(decode_mma, "launch", lambda *a, **kw: calls.append(a + (kw,)))


def _spec_mma(name):
    from tqattn.kernels import _spec
    return _spec.kernel_spec(TQCodec(name, 128), 16).mma


def test_mma_dispatch_plumbing(monkeypatch):
    """The tensor-core path's host side (kernel launch stubbed): split count = one wave of the
    resident programs, the raw query and the softmax scale, outputs allocated in q's dtype, LSE
    only on request, a step's new K/V handed to the kernel (no store launch); windows, several
    rows, GQA groups over 8 and other layouts run the portable kernel, after the store kernel;
    fp8 keys (no rotation in the kernel's store) on the tensor-core kernel after it."""
    from tqattn.kernels import decode
    calls, stores = [], []
    _mma_stubs(monkeypatch, calls)
    monkeypatch.setattr(decode.store, "store_kv_triton", lambda *a, **kw: stores.append(a))
    codec = TQCodec("turboquant_k3v4_nc", 128)
    cache, bt, seq_lens = filled_cache(codec, [40, 9], 2, 16)
    q = torch.randn(2, 8, 128, dtype=torch.bfloat16)
    out, lse = decode.decode_attention_triton(codec, q, cache, bt, seq_lens, return_lse=True,
                                              scale=0.5)
    (spec, qk, _, _, _, part, plse, o, l, group, splits, scale, new_kv, kw), = calls
    assert o is out and l is lse and out.dtype == torch.bfloat16 and lse.shape == (2, 8)
    # 4 "SMs" on CPU, 7 programs each, over 2 sequences × 2 KV heads
    assert qk is q and (group, splits, scale, new_kv, kw) == (4, 7 * 4 // (2 * 2), 0.5, None, {})
    assert part.shape == (2, 8, splits, 128) and plse.shape == (2, 8, splits)
    decode.decode_attention_triton(codec, q, cache, bt, seq_lens, num_splits=3)
    assert calls[-1][10] == 3 and calls[-1][8] is None
    k, v = torch.randn(2, 2, 2, 128)
    slots = torch.tensor([int(bt[0, 39 // 16]) * 16 + 39 % 16, int(bt[1, 0]) * 16 + 8])
    decode.decode_attention_triton(codec, q, cache, bt, seq_lens, new_kv=(k, v, slots))
    assert calls[-1][12][0] is k and calls[-1][12][2] is slots and not stores
    n = len(calls)
    decode.decode_attention_triton(codec, q, cache, bt, seq_lens, window=8, num_splits=3,
                                   new_kv=(k, v, slots))
    q16 = torch.randn(2, 32, 128)       # GQA 16: more heads than a tensor-core tile holds
    decode.decode_attention_triton(codec, q16, cache, bt, seq_lens, num_splits=2)
    assert len(calls) == n and len(stores) == 1   # the portable kernel, after the store kernel
    # every other tensor-core format with rotated keys stores its new token itself too
    for name, want in (("tq_k4v3", (1, 1)), ("turboquant_4bit_nc", (1, 0)),
                       ("turboquant_3bit_nc", (0, 2)), ("tq_k3v3", (0, 1)), ("tq_k4v4", (1, 3)),
                       ("tq_k3v4", (0, 3))):
        other = TQCodec(name, 128)
        c2, bt2, lens2 = filled_cache(other, [40, 9], 2, 16)
        decode.decode_attention_triton(other, q, c2, bt2, lens2, new_kv=(k, v, slots))
        assert (calls[-1][0].mma.keys, calls[-1][0].mma.vals) == want, name
        assert calls[-1][12][0] is k and len(stores) == 1, name
    # fp8 keys: the tensor-core kernel, after the store kernel
    assert _spec_mma("turboquant_k8v4").store is False
    c3 = TQCodec("turboquant_k8v4", 128)
    c3c, bt3, lens3 = filled_cache(c3, [40, 9], 2, 16)
    n = len(calls)
    with mock.patch.object(torch.cuda, "get_device_capability", lambda *a: (9, 0)):
        decode.decode_attention_triton(c3, q, c3c, bt3, lens3, new_kv=(k, v, slots))
    assert len(calls) == n + 1 and len(stores) == 2 and calls[-1][12] is None
    # head size 64: the tensor-core kernel with scratch rows of 64, after the store kernel
    c4 = TQCodec("tq_k4v3", 64)
    c4c, bt4, lens4 = filled_cache(c4, [40, 9], 2, 16)
    q64 = torch.randn(2, 6, 64, dtype=torch.bfloat16)
    k64, v64 = torch.randn(2, 2, 2, 64)
    decode.decode_attention_triton(c4, q64, c4c, bt4, lens4, new_kv=(k64, v64, slots))
    assert len(calls) == n + 2 and len(stores) == 3 and calls[-1][12] is None
    assert calls[-1][5].shape[-1] == 64 and calls[-1][7].shape == (2, 6, 64)


def test_mma_fused_query_rotation():
    """The tensor-core kernel rotates the raw query itself: decode_mma.fused_query_ref (its
    Walsh–Hadamard rotation's twin) equals q·R[:, σ] up to fp16 rounding; a rotation that is
    not diag(s)·H/√128 keeps the layout off the tensor-core kernel."""
    from tqattn.kernels import _spec, decode_mma
    codec = TQCodec("turboquant_k3v4_nc", 128)
    spec = _spec.kernel_spec(codec, 16)
    assert spec.mma
    sgn = decode_mma._tables(spec, "cpu")[1]
    r = codec.rotation.float()[:, decode_mma.operand_coord(torch.arange(128))]
    q = torch.randn(64, 128, dtype=torch.bfloat16) * 3
    got = decode_mma.fused_query_ref(q, sgn, 0.7)
    want = ((q.float() @ r) * 0.7).to(torch.float16)
    assert got.dtype == torch.float16 and rel_err(got.float(), want.float()) < 1e-3
    assert (got != want).float().mean() < 0.01   # single fp16 roundings, not a wrong column
    haar = types.SimpleNamespace(layout=spec.layout, key_fields=spec.key_fields,
                                 value_fields=spec.value_fields,
                                 codec=types.SimpleNamespace(rotation=haar_rotation(128)))
    assert _spec.mma_layout(spec) and not _spec.mma_layout(haar)
    assert not _spec.kernel_spec(TQCodec("tq_k3o4v3.5", 128), 16).mma
    assert _spec.kernel_spec(TQCodec("turboquant_k3v4_nc", 64), 16).mma.store is False
    assert _spec.kernel_spec(TQCodec("turboquant_k3v4_nc", 256), 16).mma.store is True
    assert not _spec.kernel_spec(TQCodec("turboquant_k3v4_nc", 96), 16).mma


def test_fp8_key_tensor_core_path_needs_sm89(monkeypatch):
    """The e4m3 → fp16 conversion exists from sm_89: turboquant_k8v4 stays on the portable
    kernel on sm_80/86, the other tensor-core formats do not."""
    from tqattn.kernels import _spec, step
    monkeypatch.setattr(step, "tensor_cores", lambda device: True)
    q = torch.zeros(1, 8, 128)
    specs = {n: _spec.kernel_spec(TQCodec(n, 128), 16) for n in ("turboquant_k8v4", "tq_k4v3")}
    for cap, want in (((8, 6), {"turboquant_k8v4": False, "tq_k4v3": True}),
                      ((9, 0), {"turboquant_k8v4": True, "tq_k4v3": True})):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, cap=cap: cap)
        assert {n: step.tensor_core_decode(s, q, 1, True) for n, s in specs.items()} == want, cap


def test_resident_programs():
    """One-warp programs per SM: whole warps per 16K-register bank (4 banks), capped by shared
    memory where a program uses it (1 KB reserved per block)."""
    from tqattn.kernels.decode_mma import resident_programs
    assert resident_programs(256) == 8 and resident_programs(232) == 8
    assert resident_programs(168) == 12 and resident_programs(128) == 16
    assert resident_programs(64) == 32 and resident_programs(512) == 4
    # the head-256 copies (15.5 KB) fit 8 programs in an H100's 228 KB; 40 KB each fit 5
    assert resident_programs(216, 15872, 233472) == 8
    assert resident_programs(216, 40960, 233472) == 5
    assert resident_programs(168, 40960, 0) == 12          # the SM's shared memory unknown
