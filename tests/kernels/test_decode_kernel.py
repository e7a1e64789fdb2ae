"""Decode attention kernel vs decode_attention_ref under triton's interpreter (CPU, tiny shapes).

Small tiles (BLOCK_N=16) and several splits so that every program walks several tiles
(register prefetch) and the LSE merge has work to do.
"""

import math
import types

import pytest
import torch

from tests.kernels import conftest
from tests.kernels._util import filled_cache, rel_err
from tqattn.quant import paged
from tqattn.quant.codec import TQCodec
from tqattn.quant.rotation import haar_rotation

pytestmark = pytest.mark.skipif(not (conftest.INTERPRET and conftest.KERNELS_IMPORTED),
                                reason="CPU interpreter tests (GPU runs test_kernels_gpu.py)")

SMALL = {"BLOCK_N": 16, "num_splits": 2}


def _check(name, d=64, hk=1, group=2, lens=(37, 6), bs=16, dtype=torch.float32, rows=None,
           continuation=False, tune=SMALL, **kw):
    from tqattn.kernels.decode import decode_attention_triton
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
    out, lse = decode_attention_triton(codec, q, cache, bt, seq_lens, qsl, qpos,
                                       return_lse=True, **kw, **tune)
    assert out.dtype == dtype and out.shape == ref.shape
    assert rel_err(out, ref) < 2e-3 if dtype == torch.float32 else 1e-2
    fin = torch.isfinite(lse_ref)
    assert torch.equal(fin, torch.isfinite(lse))
    assert (lse[fin] - lse_ref[fin]).abs().max().item() < 2e-3
    return out, lse


@pytest.mark.parametrize("name", ["turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
                                  "turboquant_3bit_nc", "tq_k4v4", "tq_k3.5v3.5", "tq_k4v2",
                                  "tq_k3v4_debias", "tq_k3o4v3.5"])
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


def test_without_prefetch_and_default_tiles():
    _check("turboquant_4bit_nc", tune={"PREFETCH": False, "BLOCK_N": 16})
    _check("turboquant_k8v4", tune={})


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
    assert math.isfinite(1.0)


def test_rotate_query():
    """The tensor-core decode kernel's query operand (kernels/qrot.py) vs its PyTorch twin."""
    from tqattn.kernels.qrot import rotate_query, rotate_query_ref
    q = torch.randn(3, 6, 64, dtype=torch.bfloat16)          # 18 rows: two blocks, one partial
    r = torch.linalg.qr(torch.randn(64, 64))[0][:, torch.randperm(64)].contiguous()
    ref = rotate_query_ref(q, r, 0.7)
    for block in (None, 16, 32, 64):
        out = rotate_query(q, r, 0.7, block=block)
        assert out.dtype == torch.float16 and out.shape == q.shape
        assert rel_err(out.float(), ref.float()) < 1e-3
    with pytest.raises(ValueError, match="block=48"):
        rotate_query(q, r, 1.0, block=48)
    with pytest.raises(ValueError, match="rotation must be"):
        rotate_query(q, r.double(), 1.0)


def test_mma_dispatch_plumbing(monkeypatch):
    """The tensor-core path's host side (kernel launch stubbed: it needs a GPU): split count =
    one wave of the resident programs, prefetch by default, outputs allocated in q's
    dtype, LSE only on request, the rotated query as the kernel sees it."""
    from tqattn.kernels import decode, decode_mma
    from tqattn.kernels.qrot import rotate_query_ref
    calls = []
    monkeypatch.setattr(decode_mma, "supported", lambda spec, q, group, plain: plain)
    monkeypatch.setattr(decode_mma, "programs_per_sm", lambda *a, **kw: 7)
    monkeypatch.setattr(decode_mma, "launch", lambda *a, **kw: calls.append(a + (kw,)))
    monkeypatch.setattr(decode_mma, "pdl_supported", lambda device: False)  # as on sm_80
    codec = TQCodec("turboquant_k3v4_nc", 128)
    cache, bt, seq_lens = filled_cache(codec, [40, 9], 2, 16)
    q = torch.randn(2, 8, 128, dtype=torch.bfloat16)
    # the rotation kernel's path (the default rotates in the decode kernel: mma_qrot below)
    out, lse = decode.decode_attention_triton(codec, q, cache, bt, seq_lens, return_lse=True,
                                              mma_qrot=False)
    (spec, qk, _, _, _, part, plse, o, l, group, splits, prefetch, pdl, kw), = calls
    assert o is out and l is lse and out.dtype == torch.bfloat16 and lse.shape == (2, 8)
    # 4 "SMs" on CPU; the words of the next tile are prefetched by default
    assert (group, splits, prefetch, pdl, kw) == (4, 7 * 4 // (2 * 2), True, False,
                                                  {"early_loads": True, "maxnreg": None,
                                                   "qscale": None, "new_kv": None})
    assert part.shape == (2, 8, splits, 128) and plse.shape == (2, 8, splits)
    r = decode_mma._tables(spec, q.device)[1]
    want = rotate_query_ref(q, r, 1.4426950408889634 / math.sqrt(128))
    assert qk.dtype == torch.float16 and rel_err(qk.float(), want.float()) < 1e-3
    decode.decode_attention_triton(codec, q, cache, bt, seq_lens, mma_prefetch=False,
                                   num_splits=3, mma_maxnreg=168, mma_qrot=False)
    assert calls[-1][-4:-1] == (3, False, False) and calls[-1][8] is None
    assert calls[-1][-1]["maxnreg"] == 168
    decode.decode_attention_triton(codec, q, cache, bt, seq_lens, window=8, num_splits=3,
                                   BLOCK_N=16)
    assert len(calls) == 2  # windows run the Triton kernel
    # a step's new K/V: stored by the rotation launch; the first tile is read before the wait
    # except in the program whose first tile holds a sequence's last token
    k, v = torch.randn(2, 2, 2, 128)
    slots = torch.tensor([int(bt[0, 39 // 16]) * 16 + 39 % 16, int(bt[1, 0]) * 16 + 8])
    decode.decode_attention_triton(codec, q, cache, bt, seq_lens, new_kv=(k, v, slots),
                                   mma_fused_store=False)
    assert calls[-1][-1] == {"early_loads": "except_last", "maxnreg": None, "qscale": None,
                             "new_kv": None}


def test_mma_fused_query_rotation(monkeypatch):
    """mma_qrot: the tensor-core kernel gets the raw query and the scale (its Walsh–Hadamard
    rotation's twin, decode_mma.fused_query_ref, equals the rotation kernel's reference up to
    fp16 rounding); with new K/V the store runs alone before it. Bad prefetch modes fail."""
    from tqattn.kernels import decode, decode_mma
    from tqattn.kernels._spec import kernel_spec
    from tqattn.kernels.qrot import rotate_query_ref
    codec = TQCodec("turboquant_k3v4_nc", 128)
    spec = kernel_spec(codec, 16)
    assert decode_mma.fused_rotation_supported(spec)
    _, r, sgn, _ = decode_mma._tables(spec, "cpu")
    q = torch.randn(64, 128, dtype=torch.bfloat16) * 3
    got, want = decode_mma.fused_query_ref(q, sgn, 0.7), rotate_query_ref(q, r, 0.7)
    assert got.dtype == torch.float16 and rel_err(got.float(), want.float()) < 1e-3
    assert (got != want).float().mean() < 0.01   # single fp16 roundings, not a wrong column
    # a non-Hadamard rotation (Haar) cannot be rotated this way
    haar = types.SimpleNamespace(key_fields=spec.key_fields, table=spec.table,
                                 codec=types.SimpleNamespace(rotation=haar_rotation(128)))
    assert not decode_mma.fused_rotation_supported(haar)

    calls, stores = [], []
    monkeypatch.setattr(decode_mma, "supported", lambda spec, q, group, plain: plain)
    monkeypatch.setattr(decode_mma, "programs_per_sm", lambda *a, **kw: 7)
    monkeypatch.setattr(decode_mma, "launch", lambda *a, **kw: calls.append(a + (kw,)))
    monkeypatch.setattr(decode_mma, "pdl_supported", lambda device: True)
    monkeypatch.setattr(decode.store, "store_kv_triton", lambda *a, **kw: stores.append(kw))
    cache, bt, seq_lens = filled_cache(codec, [40, 9], 2, 16)
    q = torch.randn(2, 8, 128, dtype=torch.bfloat16)
    decode.decode_attention_triton(codec, q, cache, bt, seq_lens, scale=0.5)   # the default
    qk, pdl, kw = calls[-1][1], calls[-1][12], calls[-1][-1]
    assert qk is q and pdl is False and kw["qscale"] == pytest.approx(0.5 * math.log2(math.e))
    k, v = torch.randn(2, 2, 2, 128)
    decode.decode_attention_triton(codec, q, cache, bt, seq_lens, mma_qrot=True,
                                   new_kv=(k, v, torch.tensor([3, 20])), mma_fused_store=False)
    assert calls[-1][1] is q and calls[-1][12] is True
    assert calls[-1][-1]["early_loads"] == "except_last" and stores[-1]["launch_dependents"]
    # without the fused store a step with new K/V keeps the store + rotation launch
    decode.decode_attention_triton(codec, q, cache, bt, seq_lens, mma_fused_store=False,
                                   new_kv=(k, v, torch.tensor([3, 20])))
    assert calls[-1][-1]["qscale"] is None and calls[-1][1].dtype == torch.float16
    assert "query" in stores[-1]   # the launch that stores and rotates
    # mma_fused_store (the default): one launch, the decode kernel stores the new token itself
    n_stores = len(stores)
    decode.decode_attention_triton(codec, q, cache, bt, seq_lens,
                                   new_kv=(k, v, torch.tensor([3, 20])))
    kw = calls[-1][-1]
    assert len(stores) == n_stores and calls[-1][1] is q and calls[-1][12] is False
    assert kw["new_kv"][0] is k and kw["early_loads"] is True and "qscale" in kw
    assert decode_mma.fused_store_supported(spec)
    assert not decode_mma.fused_store_supported(kernel_spec(TQCodec("tq_k3o4v3.5", 128), 16))
    with pytest.raises(ValueError, match="prefetch="):
        decode_mma._args(spec, q, cache, bt, seq_lens, None, None, None, None, 4, 1, "bogus",
                         False, True, None)


def test_mma_timeline_buffer_checked():
    """The per-program timeline (a diagnostic of the tensor-core kernel) takes int64 [n, 8]
    only, and is off again after its block."""
    from tqattn.kernels import decode_mma
    with pytest.raises(ValueError, match="int64"):
        with decode_mma.recording_timeline(torch.zeros(4, 8, dtype=torch.int32)):
            pass
    buf = torch.zeros(4, 8, dtype=torch.int64)
    with decode_mma.recording_timeline(buf) as got:
        assert got is buf and decode_mma._TIMELINE[0] is buf
    assert decode_mma._TIMELINE[0] is None
