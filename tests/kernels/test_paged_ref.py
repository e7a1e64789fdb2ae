"""The paged reference (layout, store, gather, decode, dequant) against the codec itself."""

import math

import pytest
import torch

from tests.kernels._util import filled_cache, random_block_table, slots_for
from tqattn.quant import paged
from tqattn.quant.attention_ref import attention_on_codes
from tqattn.quant.codec import TQCodec
from tqattn.quant.presets import PRESETS as PRESETS_BY_NAME

PRESETS = ["turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc",
           "tq_k4v4", "tq_k3.5v3.5", "tq_k4v2", "tq_k3v3", "tq_k2.5v2.5", "tq_k4v4_qjl"]


@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("d", [64, 80, 96])
@pytest.mark.parametrize("name", PRESETS)
def test_page_positions_are_a_permutation(name, d, bs):
    codec = TQCodec(name, d)
    pos = paged.page_positions(codec, bs)
    assert pos.shape == (bs, codec.slot_bytes)
    assert torch.equal(pos.flatten().sort().values, torch.arange(bs * codec.slot_bytes))


def test_fp16_fields_are_plain_arrays():
    codec = TQCodec("turboquant_k3v4_nc", 128)
    f = codec.layout.field("k_norm")
    pos = paged.page_positions(codec, 16)
    assert torch.equal(pos[:, f.offset], 16 * f.offset + 2 * torch.arange(16))


@pytest.mark.parametrize("name", PRESETS)
def test_store_gather_roundtrip(name):
    codec = TQCodec(name, 64)
    bt, nb = random_block_table([20, 7], 16)
    cache = torch.zeros(paged.kv_cache_shape(nb, 16, 2, codec), dtype=torch.uint8)
    k, v = torch.randn(27, 2, 64), torch.randn(27, 2, 64)
    k[3, 1, 0] = math.nan
    slots = torch.cat([slots_for(bt, 0, torch.arange(20), 16), slots_for(bt, 1, torch.arange(7), 16)])
    paged.store_ref(codec, k, v, cache, slots)
    got = paged.gather_slots_ref(codec, cache, bt, torch.tensor([20, 7]))
    want = codec.encode(k, v, on_nonfinite="propagate", fold_nc=True)
    assert torch.equal(torch.cat(got), want)


def test_page_word_bit_order():
    codes = torch.randint(0, 8, (5, 24))
    b = paged.page_word_bytes(codes)
    assert torch.equal(paged.page_word_codes(b), codes)
    by = b.view(5, 3, 3).long()
    w = codes.view(5, 3, 8)
    for s in range(3):   # byte & 0x77: codes 2s and 2s+1 as nibbles; bits 3/7: bit s of codes 6/7
        assert torch.equal(by[..., s] & 7, w[..., 2 * s])
        assert torch.equal((by[..., s] >> 4) & 7, w[..., 2 * s + 1])
        assert torch.equal((by[..., s] >> 3) & 1, (w[..., 6] >> s) & 1)
        assert torch.equal((by[..., s] >> 7) & 1, (w[..., 7] >> s) & 1)


def test_3bit_planes_are_column_major():
    codec = TQCodec("turboquant_k3v4_nc", 128)
    pos = paged.page_positions(codec, 16)
    k, v = codec.layout.field("k_idx"), codec.layout.field("v_q")
    t = torch.arange(16)
    # 48 key bytes = 16 words of 3 bytes: byte 3g + s in sub-plane s at column g
    for j in (0, 1, 2, 3, 47):
        s, g = j % 3, j // 3
        assert torch.equal(pos[:, k.offset + j], 16 * k.offset + s * 16 * 16 + g * 16 + t)
    assert torch.equal(pos[:, v.offset + 5], 16 * v.offset + t * 64 + 5)
    # 3-bit values too (rotated or uniform codes): sub-plane s, byte position g, token t
    for name, field in (("tq_k4v3", "v_idx"), ("turboquant_3bit_nc", "v_q")):
        c3 = TQCodec(name, 128)
        f3, pos3 = c3.layout.field(field), paged.page_positions(c3, 16)
        assert paged.column_major(f3)
        for j in (0, 4, 47):
            s, g = j % 3, j // 3
            assert torch.equal(pos3[:, f3.offset + j], 16 * f3.offset + s * 16 * 16 + g * 16 + t)
    k4 = TQCodec("tq_k4v3", 128).layout.field("k_idx")                # 4-bit keys: token rows
    assert not paged.column_major(k4)
    f8 = TQCodec("turboquant_k8v4", 128).layout.field("k_fp8")   # other key widths: token rows
    pos8 = paged.page_positions(TQCodec("turboquant_k8v4", 128), 16)
    assert torch.equal(pos8[:, f8.offset + 5], 16 * f8.offset + t * 128 + 5)


@pytest.mark.parametrize("name", ["turboquant_k3v4_nc", "tq_k4v3", "tq_k3v4_debias"])
def test_folded_norms_decode_like_vllm(name):
    """Pages store n/‖ĉ‖ for "nc" fields: one fp16 rounding away from vLLM's n·ĉ/‖ĉ‖."""
    codec = TQCodec(name, 64)
    k, v = torch.randn(50, 64) * 3, torch.randn(50, 64)
    plain = codec.decode(codec.encode(k, v))
    folded = codec.folded().decode(codec.encode(k, v, fold_nc=True))
    for a, b in zip(plain, folded):
        err = ((a - b).norm(dim=-1) / a.norm(dim=-1)).max().item()
        assert err < 2 ** -10
    if codec.preset.key.correction != "nc" and codec.preset.value.correction != "nc":
        assert codec.folded() is codec


def test_negative_slots_are_skipped():
    codec = TQCodec("tq_k4v4", 64)
    cache = torch.full(paged.kv_cache_shape(2, 16, 2, codec), 7, dtype=torch.uint8)
    paged.store_ref(codec, torch.randn(2, 2, 64), torch.randn(2, 2, 64), cache,
                    torch.tensor([-1, 17]))
    assert bool((cache[0] == 7).all()) and not bool((cache[1] == 7).all())


def test_kv_cache_shape_and_checks():
    codec = TQCodec("turboquant_k3v4_nc", 128)
    assert paged.kv_cache_shape(10, 16, 8, codec) == (10, 8, 16 * 118)
    with pytest.raises(ValueError, match="uint8"):
        paged.cache_block_size(codec, torch.zeros(10, 8, 100, dtype=torch.uint8))


ALL_PRESETS = list(PRESETS_BY_NAME)


@pytest.mark.parametrize("name", ALL_PRESETS)
@pytest.mark.parametrize("window,softcap", [(None, 0.0), (9, 3.0)])
def test_decode_ref_equals_attention_on_codes(name, window, softcap):
    """The page reader (planes, table lookups, all sequences at once) against the slot path
    (gathered slots in vLLM's order, the codec's own decode), on caches whose page tails hold
    stale bytes; head size 40 gives 3-bit fields that are not whole words (20 codes)."""
    codec = TQCodec(name, 40 if name == "tq_k3.5v3" else 64)
    lens = [40, 23, 1]
    cache, bt, seq_lens = filled_cache(codec, lens, 2, 16, key_scale=2.0, stale=True)
    rows = [3, 1, 1]
    qsl = torch.tensor([0, 3, 4, 5])
    q = torch.randn(5, 6, codec.head_dim)
    out, lse = paged.decode_attention_ref(codec, q, cache, bt, seq_lens, qsl, window=window,
                                          softcap=softcap, return_lse=True)
    slots = paged.gather_slots_ref(codec, cache, bt, seq_lens)
    for b, (n, r) in enumerate(zip(lens, rows)):
        r0 = int(qsl[b])
        kv_lens = torch.arange(n - r + 1, n + 1)
        o, l = attention_on_codes(codec.folded(), q[r0:r0 + r], slots[b], kv_lens=kv_lens,
                                  window=window, softcap=softcap, return_lse=True)
        torch.testing.assert_close(out[r0:r0 + r], o, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[r0:r0 + r], l, rtol=1e-5, atol=1e-5)


def test_decode_ref_rows_without_keys():
    codec = TQCodec("turboquant_4bit_nc", 64)
    cache, bt, seq_lens = filled_cache(codec, [10, 10], 1, 16)
    q = torch.randn(2, 2, 64)
    out, lse = paged.decode_attention_ref(codec, q, cache, bt, torch.tensor([0, 10]),
                                          return_lse=True)
    assert bool((out[0] == 0).all()) and bool(torch.isinf(lse[0]).all())
    assert bool(torch.isfinite(lse[1]).all())


def test_continuation_rows_see_the_prefix_only():
    codec = TQCodec("turboquant_k3v4_nc", 64)
    cache, bt, seq_lens = filled_cache(codec, [30], 2, 16)
    q = torch.randn(4, 4, 64)
    qsl = torch.tensor([0, 4])
    a = paged.decode_attention_ref(codec, q, cache, bt, seq_lens, qsl, seq_lens.clone())
    # every row sees all 30 cached keys: each equals a plain decode of the same query
    for i in range(4):
        b = paged.decode_attention_ref(codec, q[i:i + 1], cache, bt, seq_lens)
        torch.testing.assert_close(a[i], b[0])


@pytest.mark.parametrize("name", ["tq_k3.5v3.5", "turboquant_k8v4", "turboquant_3bit_nc",
                                  "tq_k3o4v3.5", "tq_k4v4_qjl", "tq_k3v4_debias"])
def test_dequant_ref_matches_codec(name):
    codec = TQCodec(name, 80)
    cache, bt, lens = filled_cache(codec, [33, 5], 2, 16, stale=True)
    k, v = paged.dequant_ref(codec, cache, bt, lens)
    slots = paged.gather_slots_ref(codec, cache, bt, lens)
    kk, vv = codec.folded().decode(torch.cat(slots))
    torch.testing.assert_close(k, kk, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v, vv, rtol=1e-5, atol=1e-6)


def test_single_slot_with_odd_fp16_offset():
    # tq_k3.5v3.5 at D=80 keeps k_norm at byte 35; one slot / empty sequences must still work
    codec = TQCodec("tq_k3.5v3.5", 80)
    assert codec.layout.field("k_norm").offset % 2 == 1
    cache = torch.zeros(paged.kv_cache_shape(2, 16, 1, codec), dtype=torch.uint8)
    k, v = torch.randn(1, 1, 80), torch.randn(1, 1, 80)
    paged.store_ref(codec, k, v, cache, torch.tensor([0]))
    bt = torch.tensor([[0], [1]], dtype=torch.int32)
    lens = torch.tensor([1, 0])
    kk, vv = paged.dequant_ref(codec, cache, bt, lens)
    assert kk.shape == (1, 1, 80)
    q = torch.randn(2, 2, 80)
    out, lse = paged.decode_attention_ref(codec, q, cache, bt, lens, return_lse=True)
    # one visible key: softmax weight 1 on it, the output is its value
    torch.testing.assert_close(out[0], vv[0].expand(2, -1), rtol=1e-4, atol=1e-4)
    assert bool(torch.isinf(lse[1]).all())


def test_page_word_values_are_the_table_at_the_codes():
    codes = torch.randint(0, 8, (4, 5, 24))
    table = torch.randn(8)
    planes = paged.page_word_bytes(codes).unflatten(-1, (-1, 3)).unbind(-1)
    assert torch.equal(paged.page_word_values(planes, paged.page_word_lut(table)), table[codes])


def test_batched_decode_equals_one_sequence_at_a_time():
    """Sequences of very different lengths and row counts in one call give what each gives alone."""
    codec = TQCodec("tq_k4v3", 64)
    lens = [70, 3, 33, 0]
    cache, bt, seq_lens = filled_cache(codec, lens, 2, 16, stale=True)
    qsl = torch.tensor([0, 4, 5, 7, 8])
    q = torch.randn(9, 4, 64)                    # the last row belongs to no sequence
    out, lse = paged.decode_attention_ref(codec, q, cache, bt, seq_lens, qsl, return_lse=True)
    for b in range(len(lens)):
        r0, r1 = int(qsl[b]), int(qsl[b + 1])
        o, l = paged.decode_attention_ref(codec, q[r0:r1], cache, bt[b:b + 1], seq_lens[b:b + 1],
                                          torch.tensor([0, r1 - r0]), return_lse=True)
        torch.testing.assert_close(out[r0:r1], o, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse[r0:r1], l, rtol=1e-5, atol=1e-6)
    assert bool((out[7:] == 0).all()) and bool(torch.isinf(lse[7:]).all())


# The page reader must follow the layout functions, not a fixed plane order: under another
# assignment of column_major() the store writes other bytes, and the reader must still agree
# with the slot path, which reads through page_positions.
SHIPPED_COLUMN_MAJOR = paged.column_major
OTHER_LAYOUTS = {
    "every field token-major": lambda f: False,
    "every field column-major": lambda f: True,
}


@pytest.fixture
def other_layout(request, monkeypatch):
    monkeypatch.setattr(paged, "column_major", OTHER_LAYOUTS[request.param])
    paged._page_positions.cache_clear()
    yield
    paged._page_positions.cache_clear()   # before monkeypatch restores the shipped layout


@pytest.mark.parametrize("other_layout", list(OTHER_LAYOUTS), indirect=True)
@pytest.mark.parametrize("name", ["tq_k4v3", "turboquant_3bit_nc", "tq_k3o4v3.5", "tq_k2.5v2.5"])
def test_page_reader_follows_the_layout(name, other_layout):
    codec = TQCodec(name, 64)
    changed = [f.name for f in codec.layout.fields.values()
               if f.nbytes > 1 and paged.column_major(f) != SHIPPED_COLUMN_MAJOR(f)]
    assert changed                                  # the store really writes another layout
    cache, bt, seq_lens = filled_cache(codec, [37, 16], 2, 16, stale=True)
    slots = paged.gather_slots_ref(codec, cache, bt, seq_lens)
    q = torch.randn(2, 4, 64)
    out = paged.decode_attention_ref(codec, q, cache, bt, seq_lens)
    for b, n in enumerate((37, 16)):
        o = attention_on_codes(codec.folded(), q[b:b + 1], slots[b], kv_lens=torch.tensor([n]))
        torch.testing.assert_close(out[b:b + 1], o, rtol=1e-5, atol=1e-5)
    k, v = paged.dequant_ref(codec, cache, bt, seq_lens)
    kk, vv = codec.folded().decode(torch.cat(slots))
    torch.testing.assert_close(k, kk, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v, vv, rtol=1e-5, atol=1e-6)
