"""bench/fa3.py: the fp8 (e4m3) inputs of FA3's paged decode, checked on the CPU against their
dequantized values and an attention reference (FA3 itself only runs on the GPU)."""

import pytest
import torch
import torch.nn.functional as F

from bench import fa3


def _paged(b=3, l=48, hq=8, hk=2, d=64, bs=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    nblk = b * l // bs
    k = torch.randn(nblk, bs, hk, d, generator=g).to(torch.bfloat16) * 3
    v = torch.randn(nblk, bs, hk, d, generator=g).to(torch.bfloat16)
    bt = torch.randperm(nblk, generator=g).to(torch.int32).view(b, l // bs)
    q = torch.randn(b, hq, d, generator=g).to(torch.bfloat16)
    return q, k, v, bt, torch.full((b,), l, dtype=torch.int32)


def fake_fa3(q, k_cache, v_cache, cache_seqlens, page_table, causal, q_descale=None,
             k_descale=None, v_descale=None):
    """FA3's flash_attn_with_kvcache semantics for a decode (one query row, full cache), with
    its fp8 contract: e4m3 inputs come with (batch, KV heads) fp32 descales."""
    b, _, hq, d = q.shape
    hk = k_cache.shape[2]
    if q.dtype == fa3.FP8:
        for x in (k_cache, v_cache):
            assert x.dtype == fa3.FP8
        for s in (q_descale, k_descale, v_descale):
            assert s is None or (s.shape == (b, hk) and s.dtype == torch.float32
                                 and s.is_contiguous())
    one = torch.ones(b, hk)
    qd, kd, vd = (one if s is None else s for s in (q_descale, k_descale, v_descale))
    out = torch.empty(b, 1, hq, d)
    for i in range(b):
        n = int(cache_seqlens[i])
        kk = k_cache[page_table[i].long()].reshape(-1, hk, d)[:n].float() * kd[i, :, None]
        vv = v_cache[page_table[i].long()].reshape(-1, hk, d)[:n].float() * vd[i, :, None]
        qq = q[i, 0].float().view(hk, hq // hk, d) * qd[i, :, None, None]
        out[i, 0] = F.scaled_dot_product_attention(
            qq, kk.transpose(0, 1), vv.transpose(0, 1)).reshape(hq, d)
    return out.to(torch.bfloat16)


def test_per_tensor_fp8_round_trip():
    x = torch.randn(40, 7, 16) * 5
    x[3, 2, 1] = 123.0                       # the amax sets the scale
    x8, s = fa3.per_tensor_fp8(x)
    assert x8.dtype == fa3.FP8 and x8.shape == x.shape and s.dtype == torch.float32
    assert s.item() == pytest.approx(123.0 / fa3.FP8_MAX)
    back = x8.float() * s
    assert back[3, 2, 1].item() == pytest.approx(123.0)
    # e4m3 keeps 3 mantissa bits: within half an ulp (1/16 relative) above the subnormals
    big = x.abs() > 2 ** -6 * s
    assert ((back - x).abs()[big] <= x.abs()[big] / 16 + 1e-6).all()
    zero8, zs = fa3.per_tensor_fp8(torch.zeros(4, 4))
    assert zs.item() == 1.0 and not zero8.float().any()


def test_per_tensor_fp8_in_slices(monkeypatch):
    monkeypatch.setattr(fa3, "_CHUNK", 10)     # one row per step
    x = torch.randn(6, 4, 5)
    a = fa3.per_tensor_fp8(x)
    monkeypatch.setattr(fa3, "_CHUNK", 1 << 26)
    b = fa3.per_tensor_fp8(x)
    assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and a[1] == b[1]


def test_fp8_inputs_and_decode():
    """The descales passed to FA3 undo the scales: attention on the fp8 inputs ≈ bf16 attention
    (an e4m3-level cosine), while the same inputs without their descales are far off."""
    q, k, v, bt, lens = _paged()
    inp = fa3.fp8_inputs(q, k, v)
    assert inp.q.shape == (3, 1, 8, 64) and inp.q.dtype == fa3.FP8
    assert inp.k_cache.shape == k.shape and inp.v_cache.dtype == fa3.FP8
    for s, x in ((inp.q_descale, q), (inp.k_descale, k), (inp.v_descale, v)):
        assert s.shape == (3, 2) and torch.allclose(s, x.float().abs().max() / fa3.FP8_MAX)
    want = fa3.decode_bf16(fake_fa3, q, k, v, lens, bt)
    got = fa3.decode_fp8(fake_fa3, inp, lens, bt)
    assert got.shape == want.shape == (3, 8, 64)
    cos = F.cosine_similarity(got.float().flatten(), want.float().flatten(), dim=0).item()
    assert cos > 0.995
    bare = fake_fa3(inp.q, inp.k_cache, inp.v_cache, lens, bt, True).view(3, 8, 64)
    assert (bare.float() - want.float()).norm() > 10 * (got.float() - want.float()).norm()


class _Timer:
    """Stands in for bench.common.Timer: calls the function once, reports a fixed time."""
    mode = "memset"

    def __init__(self):
        self.calls = 0

    def graph_us(self, fn):
        fn()
        self.calls += 1
        return {"us": 100.0 * self.calls, "reps": 1}


def test_fa3_rows_of_bench_decode():
    """bench/decode.py's FA3 rows with a stand-in FA3: bf16 and fp8 rows from the same inputs,
    the fp8 row's bytes half the bf16 cache's, its time ratio to FA3 bf16 and its cosines."""
    pytest.importorskip("triton")
    from bench import decode
    q, k, v, bt, lens = _paged()
    ref = fa3.decode_bf16(fake_fa3, q, k, v, lens, bt)
    base = {"batch": 3, "ctx": 48}
    rows = decode.fa3_rows([_Timer()], fake_fa3, q, k, v, lens, bt, ref, base, 1000)
    assert [r["method"] for r in rows] == ["fa3_bf16_paged", "fa3_fp8_paged"]
    bf16, fp8 = rows
    assert bf16["kv_bytes"] == 1000 and fp8["kv_bytes"] == 500 and fp8["bits_per_elem"] == 8.0
    assert bf16["cos"] > 0.9999 and 0.995 < fp8["cos"] < 1.0
    assert fp8["x_fa3"] == fp8["us"] / bf16["us"] and fp8["cos_vs_fa3_bf16"] > 0.995
    assert decode.fa3_rows([_Timer()], None, q, k, v, lens, bt, ref, base, 1000) == []
