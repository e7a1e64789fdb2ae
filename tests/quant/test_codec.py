import math

import pytest
import torch

from tqattn.quant.attention_ref import attention_on_codes, dense_attention
from tqattn.quant.codec import TQCodec
from tqattn.quant.presets import PRESETS, KeySpec, TQPreset, ValueSpec, split_bits

HEAD_SIZES = [64, 80, 96, 128, 192, 256, 512]
THEORY_MSE = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.00950}


def theory(bits, dim):
    low, n_hi, n_lo = split_bits(bits, dim)
    return (THEORY_MSE[low + 1] * n_hi + THEORY_MSE[low] * n_lo) / dim if n_hi else THEORY_MSE[low]


def nmse(x, y):
    return ((x - y).pow(2).sum(-1) / y.pow(2).sum(-1)).mean().item()


# outlier channels are bytes: head size <= 256 (test_outlier_preset_limits)
@pytest.mark.parametrize("name,dim", [(n, d) for n, p in PRESETS.items() if not p.key.qjl
                                      for d in HEAD_SIZES if d <= 256 or not p.key.outliers])
def test_round_trip_within_theory(name, dim):
    codec = TQCodec(name, dim, seed=1)
    k = torch.randn(2, 128, 3, dim, dtype=torch.bfloat16)
    v = torch.randn(2, 128, 3, dim, dtype=torch.float16)
    slots = codec.encode(k, v)
    assert slots.shape == (2, 128, 3, codec.slot_bytes) and slots.dtype == torch.uint8
    kh, vh = codec.decode(slots)
    assert kh.shape == k.shape and vh.shape == v.shape
    p = codec.preset
    if p.key.codec == "mse":
        assert nmse(kh, k.float()) <= 1.2 * theory(p.key.bits, dim)
    else:
        assert nmse(kh, k.float()) < 1e-3  # fp8 e4m3: 3 mantissa bits
    if p.value.codec == "tq":
        assert nmse(vh, v.float()) <= 1.2 * theory(p.value.bits, dim)
    else:  # uniform codes: error of a uniform quantizer, step (max − min)/(2^b − 1)
        vf = v.float()
        step = (vf.amax(-1) - vf.amin(-1)) / (2 ** int(p.value.bits) - 1)
        expected = (dim * step ** 2 / 12 / vf.pow(2).sum(-1)).mean().item()
        assert nmse(vh, vf) <= 1.2 * expected


def test_vllm_math_k3v4_nc():
    """Encode one key by hand with vLLM's recipe (plain Hadamard, Gaussian levels) and compare."""
    from tqattn.quant.codebook import get_codebook
    from tqattn.quant.packing import pack_bits
    from tqattn.quant.rotation import hadamard

    codec = TQCodec("turboquant_k3v4_nc", 128)
    k = torch.randn(128)
    v = torch.randn(128)
    s = codec.encode(k, v)
    n = k.norm()
    y = (k / (n + 1e-8)) @ hadamard(128).float()
    idx = torch.bucketize(y, torch.tensor(get_codebook(128, 3, "gaussian").boundaries, dtype=torch.float32))
    assert torch.equal(s[:48], pack_bits(idx, 3))
    assert s[48:50].view(torch.float16).item() == n.half().item()
    scale = (v.max() - v.min()) / 15
    q = torch.floor((v - v.min()) / scale + 0.5).clamp(0, 15).to(torch.int64)
    assert torch.equal(s[50:114], pack_bits(q, 4))
    assert s[114:116].view(torch.float16).item() == scale.half().item()
    assert s[116:118].view(torch.float16).item() == v.min().half().item()
    # norm correction: decoded key = n · ĉ/‖ĉ‖ rotated back
    c = torch.tensor(get_codebook(128, 3, "gaussian").centroids, dtype=torch.float32)[idx]
    expect = n.half().float() * (c / c.norm()) @ hadamard(128).float().T
    assert torch.allclose(codec.decode_keys(s), expect, atol=1e-5)


def _slope(codec, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4000, codec.head_dim, generator=g)
    y = torch.randn(4000, codec.head_dim, generator=g)
    est = (codec.decode_keys(codec.encode(x, x)) * y).sum(-1)
    true = (x * y).sum(-1)
    return ((est * true).sum() / (true * true).sum()).item()


def _key_preset(bits, correction="none", qjl=False):
    return TQPreset("ab", KeySpec("mse", bits, correction, qjl), ValueSpec("tq", 4), True, "exact")


def test_qjl_is_unbiased_and_mse_shrinks_by_one_minus_d():
    from tqattn.quant.codebook import get_codebook
    d = 128
    plain = [_slope(TQCodec(_key_preset(2), d, seed=s), s) for s in range(3)]
    qjl = [_slope(TQCodec(_key_preset(3, qjl=True), d, seed=s), s) for s in range(3)]
    debias = [_slope(TQCodec(_key_preset(2, "debias"), d, seed=s), s) for s in range(3)]
    shrink = 1 - get_codebook(d, 2).mse     # ≈ 0.884
    assert sum(plain) / 3 == pytest.approx(shrink, abs=0.015)
    assert sum(qjl) / 3 == pytest.approx(1.0, abs=0.015)
    assert sum(debias) / 3 == pytest.approx(1.0, abs=0.015)


def test_qjl_uses_an_independent_projection():
    c = TQCodec("tq_k4v4_qjl", 128, seed=0)
    r = c.rotation
    assert not torch.allclose(c.qjl_matrix / c.qjl_matrix.norm(), r / r.norm(), atol=1e-2)


@pytest.mark.parametrize("name", list(PRESETS))
def test_zero_vectors_round_trip_to_zero(name):
    codec = TQCodec(name, 128)
    z = torch.zeros(4, 2, 128)
    k, v = codec.decode(codec.encode(z, z))
    assert torch.equal(k, torch.zeros_like(k)) and torch.equal(v, torch.zeros_like(v))


def test_bad_input_errors():
    codec = TQCodec("turboquant_k3v4_nc", 128)
    good = torch.randn(3, 128)
    with pytest.raises(TypeError, match="float16/bfloat16/float32"):
        codec.encode(good.to(torch.int32), good)
    with pytest.raises(TypeError, match="float16/bfloat16/float32"):
        codec.encode(good.double(), good)
    with pytest.raises(ValueError, match="last dimension .* head size 128"):
        codec.encode(torch.randn(3, 64), torch.randn(3, 64))
    with pytest.raises(ValueError, match="shape"):
        codec.encode(good, torch.randn(4, 128))
    with pytest.raises(ValueError, match="slots must be uint8"):
        codec.decode(torch.zeros(3, 100, dtype=torch.uint8))


@pytest.mark.parametrize("name", ["turboquant_k8v4", "turboquant_k3v4_nc", "tq_k3v4", "tq_k4v4_qjl"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nonfinite_raise_or_propagate(name, bad):
    codec = TQCodec(name, 128)
    k, v = torch.randn(4, 128), torch.randn(4, 128)
    k[2, 7] = bad
    with pytest.raises(ValueError, match="non-finite"):
        codec.encode(k, v)
    kh, vh = codec.decode(codec.encode(k, v, on_nonfinite="propagate"))
    assert not torch.isfinite(kh[2]).all()          # the poisoned vector is marked, loudly
    assert torch.isfinite(kh[[0, 1, 3]]).all() and torch.isfinite(vh).all()
    v[1, 0] = bad
    _, vh = codec.decode(codec.encode(k, v, on_nonfinite="propagate"))
    assert not torch.isfinite(vh[1]).all() and torch.isfinite(vh[[0, 2, 3]]).all()


@pytest.mark.parametrize("name", ["tq_k4v3", "turboquant_k3v4_nc", "tq_k4v4_qjl", "turboquant_k8v4"])
def test_finite_vectors_past_fp16_range_are_refused(name):
    codec = TQCodec(name, 64)
    k, v = torch.randn(3, 64), torch.randn(3, 64)
    codec.decode(codec.encode(k / k.norm(dim=-1, keepdim=True) * 60000, v))  # in range: fine
    big = k.clone()
    big[1] *= 66000 / big[1].norm()
    if codec.preset.key.codec != "fp8":  # fp8 keys saturate per element instead
        with pytest.raises(ValueError, match=r"key norm of 1 vector\(s\) \(first at index \[1\]\) exceeds 65504"):
            codec.encode(big, v)
    v[2] -= 70000
    with pytest.raises(ValueError, match=r"value (norm|minimum) .*index \[2\]"):
        codec.encode(k, v)
    _, vh = codec.decode(codec.encode(k, v, on_nonfinite="propagate"))  # the kernel's path
    assert not torch.isfinite(vh[2]).all() and torch.isfinite(vh[[0, 1]]).all()


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("dim", [64, 96, 128])
def test_attention_on_codes_equals_dense_on_decoded(name, dim):
    codec = TQCodec(name, dim, seed=2)
    k, v = torch.randn(70, 2, dim), torch.randn(70, 2, dim)
    slots = codec.encode(k, v)
    kh, vh = codec.decode(slots)
    q = torch.randn(5, 8, dim)
    lens = torch.tensor([70, 69, 40, 1, 70])
    for window, cap in [(None, 0.0), (16, 0.0), (None, 30.0)]:
        out, lse = attention_on_codes(codec, q, slots, kv_lens=lens, window=window, softcap=cap,
                                      return_lse=True)
        ref = dense_attention(q, kh, vh, kv_lens=lens, window=window, softcap=cap)
        assert torch.allclose(out, ref, atol=2e-5), (window, cap)
        assert lse.shape == (5, 8) and torch.isfinite(lse).all()


@pytest.mark.parametrize("shape", [(80,), (1, 80), (0, 80)])
def test_odd_offset_fp16_fields_decode_for_any_batch(shape):
    codec = TQCodec("tq_k3.5v3.5", 80)          # k_norm sits at byte 35
    assert codec.layout.field("k_norm").offset % 2 == 1
    x = torch.randn(shape)
    k, v = codec.decode(codec.encode(x, x))
    assert k.shape == x.shape and v.shape == x.shape
    # each vector decodes as it does in a batch of other vectors (its norm read at byte 35;
    # the batch's GEMM rounds differently in the last fp32 bits)
    flat = x.reshape(-1, 80)
    batch = torch.cat([torch.randn(3, 80), flat])
    kb, vb = codec.decode(codec.encode(batch, batch))
    torch.testing.assert_close(k.reshape(-1, 80), kb[3:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v.reshape(-1, 80), vb[3:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("precision", ["high", "medium"])
def test_encode_ignores_reduced_matmul_precision(precision):
    """A user's TF32 / bf16 matmul setting changes neither the codes (the rotation GEMM runs at
    full fp32) nor survives changed past the encode."""
    codec = TQCodec("tq_k3v4", 64)
    k, v = torch.randn(40, 2, 64), torch.randn(40, 2, 64)
    ref = codec.encode(k, v)
    apis = (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul)
    initial = [api.fp32_precision for api in apis]
    torch.set_float32_matmul_precision(precision)
    try:
        before = [api.fp32_precision for api in apis]
        assert torch.equal(codec.encode(k, v), ref)
        assert torch.get_float32_matmul_precision() == precision
        assert [api.fp32_precision for api in apis] == before
    finally:
        torch.set_float32_matmul_precision("highest")
        for api, prec in zip(apis, initial):
            api.fp32_precision = prec


def test_outlier_split_keys():
    """The m largest-|k| channels are stored apart (channel byte + e4m3 byte, largest first) and
    taken out before the rotation: on keys with large per-token channels the decoded error is a
    fraction of plain 3-bit TurboQuant's at the same bytes (tq_k3v4: 116 bytes, as this)."""
    codec, plain = TQCodec("tq_k3o4v3.5", 128), TQCodec("tq_k3v4", 128)
    assert codec.slot_bytes == plain.slot_bytes == 116
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(256, 128, generator=gen)
    chans = torch.stack([torch.randperm(128, generator=gen)[:4] for _ in range(256)])
    big = torch.tensor([20.0, -14.0, 11.0, -9.0]).expand(256, 4)
    k.scatter_(-1, chans, big)
    v = torch.randn(256, 128, generator=gen)
    slots = codec.encode(k, v)
    f_idx, f_val = codec.layout.field("k_out_idx"), codec.layout.field("k_out_val")
    assert torch.equal(slots[:, f_idx.offset:f_idx.offset + 4].long(), chans)
    vals = slots[:, f_val.offset:f_val.offset + 4].contiguous().view(torch.float8_e4m3fn)
    assert torch.equal(vals.float(), big.to(torch.float8_e4m3fn).float())
    err = nmse(codec.decode_keys(slots), k)
    assert err < 0.4 * nmse(plain.decode_keys(plain.encode(k, v)), k)
    assert err < 1.2 * theory(3, 128)  # the residual's error, relative to the whole key


def test_outlier_ties_saturation_and_nonfinite():
    codec = TQCodec("tq_k3o4v3.5", 64)
    f_idx, f_val = codec.layout.field("k_out_idx"), codec.layout.field("k_out_val")
    k = torch.ones(3, 64)
    k[1, 10] = -1000.0                      # saturates at e4m3's 448; the rest goes to the codes
    k[2, 5] = math.nan
    slots = codec.encode(k, torch.randn(3, 64), on_nonfinite="propagate")
    assert slots[0, f_idx.offset:f_idx.offset + 4].tolist() == [0, 1, 2, 3]   # ties: lowest
    assert slots[1, f_idx.offset:f_idx.offset + 4].tolist() == [10, 0, 1, 2]
    val = slots[1, f_val.offset:f_val.offset + 4].contiguous().view(torch.float8_e4m3fn)
    assert val.float().tolist() == [-448.0, 1.0, 1.0, 1.0]
    kh = codec.decode_keys(slots)
    assert abs(kh[1, 10].item() + 1000.0) < 60.0
    assert bool(torch.isnan(kh[2]).all()) and bool(torch.isfinite(kh[:2]).all())
    with pytest.raises(ValueError, match="non-finite"):
        codec.encode(k, torch.randn(3, 64))


def test_outlier_preset_limits():
    with pytest.raises(ValueError, match="one byte"):
        TQCodec("tq_k3o4v3.5", 512)
    for key in (KeySpec("fp8", outliers=4), KeySpec("mse", 3, outliers=17),
                KeySpec("mse", 3, qjl=True, outliers=2)):
        with pytest.raises(ValueError, match="outliers"):
            TQPreset("bad", key, ValueSpec("tq", 3), rotation_signs=True, codebook="exact")


def test_outlier_channels_past_the_head_size_add_nothing():
    """Never-written slots hold any bytes: a channel byte >= D must not index out of range."""
    codec = TQCodec("tq_k3o4v3.5", 64)
    slots = codec.encode(torch.randn(2, 64), torch.randn(2, 64))
    f_idx = codec.layout.field("k_out_idx")
    want = codec.outlier_keys(slots)
    slots[0, f_idx.offset] = 200
    got = codec.outlier_keys(slots)
    assert torch.equal(got[1], want[1]) and int((got[0] != 0).sum()) == 3
