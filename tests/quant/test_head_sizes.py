"""Every preset at every even head size 8..300: it encodes and round-trips through the paged
cache, or ``check_head_dim`` refuses it up front with a reason — never a crash inside the codec.

Head sizes 12 and 14 once passed validation and then failed in the paged store: 6 or 14 codes of
3 bits fill 3 or 6 bytes, which the page took for whole 8-code words.

Two parts, because solving the codebooks of 147 head sizes takes minutes on 2 cores:
* the layout and the page (every field's packing, the page order of its bytes, the 3-bit word
  reorder) at every head size, from random codes — what depends on the head size's residues;
* the real codec through the paged store, gather and dequantize at 8..30 (every residue of an
  even size mod 16, which fixes how each field splits into bytes and words) and at 256..300.
"""

import pytest
import torch

from tqattn.quant import paged
from tqattn.quant.codec import TQCodec
from tqattn.quant.layout import build_layout
from tqattn.quant.packing import pack_bits
from tqattn.quant.presets import MAX_OUTLIER_HEAD_DIM, PRESETS

ALL_SIZES = list(range(8, 302, 2))
CODEC_SIZES = list(range(8, 32, 2)) + [256, 258, 300]
BLOCK = 16


def _expected_refusals(preset, sizes):
    return [d for d in sizes if d > MAX_OUTLIER_HEAD_DIM] if preset.key.outliers else []


def _random_slots(layout, n, gen):
    """n slots whose packed fields hold random codes (pad bits 0, as the codec leaves them)."""
    slots = torch.zeros(n, layout.slot_bytes, dtype=torch.uint8)
    for f in layout.fields.values():
        if f.count:
            codes = torch.randint(0, 2 ** f.bits, (n, f.count), generator=gen)
            slots[:, f.offset:f.offset + f.nbytes] = pack_bits(codes, f.bits)
        else:
            slots[:, f.offset:f.offset + f.nbytes] = torch.randint(0, 256, (n, f.nbytes), generator=gen,
                                                                   dtype=torch.uint8)
    return slots


class _LayoutOnly:
    """What the page helpers read of a codec, without solving its codebooks."""

    def __init__(self, name, d):
        self.layout = build_layout(name, d)
        self.preset, self.head_dim = self.layout.preset, d


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_head_size_has_a_layout_and_a_page_or_is_refused(name):
    preset, gen = PRESETS[name], torch.Generator().manual_seed(0)
    refused = []
    for d in ALL_SIZES:
        reason = preset.head_dim_unsupported_reason(d)
        if reason is not None:
            refused.append(d)
            assert str(d) in reason and not preset.supports_head_dim(d)
            with pytest.raises(ValueError, match=str(d)):
                build_layout(name, d)
            continue
        codec = _LayoutOnly(name, d)
        pos = paged.page_positions(codec, BLOCK)
        assert torch.equal(pos.flatten().sort().values, torch.arange(BLOCK * codec.layout.slot_bytes))
        slots = _random_slots(codec.layout, 5, gen)
        page = paged._reorder_words(codec, slots, to_page=True)
        assert torch.equal(paged._reorder_words(codec, page, to_page=False), slots), (name, d)
    assert refused == _expected_refusals(preset, ALL_SIZES)


@pytest.mark.parametrize("name", list(PRESETS))
def test_codec_roundtrips_through_the_page_or_is_refused(name):
    preset = PRESETS[name]
    refused = []
    for d in CODEC_SIZES:
        if not preset.supports_head_dim(d):
            refused.append(d)
            with pytest.raises(ValueError, match=f"head size {d}"):
                TQCodec(name, d)
            continue
        codec = TQCodec(name, d)
        gen = torch.Generator().manual_seed(d)
        k, v = torch.randn(3, 1, d, generator=gen), torch.randn(3, 1, d, generator=gen)
        rows, table, lens = [5, 0, 11], torch.tensor([[0]]), torch.tensor([12])
        cache = torch.zeros(paged.kv_cache_shape(1, BLOCK, 1, codec), dtype=torch.uint8)
        paged.store_ref(codec, k, v, cache, torch.tensor(rows))
        got = paged.gather_slots_ref(codec, cache, table, lens)[0][rows]
        assert torch.equal(got, codec.encode(k, v, on_nonfinite="propagate", fold_nc=True)), (name, d)
        kh, vh = codec.folded().decode(got)
        cos = torch.nn.functional.cosine_similarity(kh.flatten(1), k.flatten(1), dim=-1)
        assert bool((cos > 0.5).all()), (name, d, cos)  # loose: ~2-bit codes at d = 8 are coarse
        dk, dv = paged.dequant_ref(codec, cache, table, lens)
        torch.testing.assert_close(dk[rows], kh, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dv[rows], vh, atol=1e-5, rtol=1e-5)
    assert refused == _expected_refusals(preset, CODEC_SIZES)


@pytest.mark.parametrize("d", [0, 7, 13, 63, -2, 12.0, True, "64"])
def test_bad_head_sizes_are_refused_with_the_value(d):
    for preset in PRESETS.values():
        assert not preset.supports_head_dim(d)
        with pytest.raises(ValueError, match="head size"):
            preset.check_head_dim(d)
