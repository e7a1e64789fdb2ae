"""The inline-asm code → fp16 blocks of the tensor-core decode kernel (kernels/_asm.py), run by
a small PTX interpreter against the page format's reference decode (CPU)."""

import random

import numpy as np
import pytest
import torch

from tests.kernels.ptx_emu import run
from tqattn.quant.codec import TQCodec
from tqattn.quant.paged import page_word_bytes

_asm = pytest.importorskip("tqattn.kernels._asm")


def _fp16(x: int) -> float:
    return float(np.array([x & 0xFFFF], dtype=np.uint16).view(np.float16)[0])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lut3_rows_decodes_page_words(seed):
    """Three sub-plane words of 4 tokens → codes (2p, 2p+1) of token e in output e + 4p."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 8, (4, 8), generator=g)            # 4 tokens × one 8-code word
    page = page_word_bytes(codes)                                 # (4, 3) page-order bytes
    words = [int(sum(int(page[e, s]) << (8 * e) for e in range(4))) for s in range(3)]
    centroids = TQCodec("turboquant_k3v4_nc", 128).keys.centroids[0]
    table = _asm.lut3_table_words(centroids.tolist())
    out = run(_asm.LUT3_ROWS.value, {16: words[0], 17: words[1], 18: words[2],
                                     19: table[0], 20: table[1], 21: table[2], 22: table[3]})
    want = centroids.to(torch.float16)
    assert sorted(out) == list(range(16))
    for e in range(4):
        for p in range(4):
            r = out[e + 4 * p]
            assert _fp16(r) == float(want[codes[e, 2 * p]]), (e, p)
            assert _fp16(r >> 16) == float(want[codes[e, 2 * p + 1]]), (e, p)


def test_lut3_table_words_rejects_bad_codebook():
    with pytest.raises(ValueError, match="8 centroids"):
        _asm.lut3_table_words([0.0] * 7)


def test_u4_pairs_decodes_two_token_rows():
    """Words A, B (8 nibble codes each, little-endian) → (A, B) pairs per nibble position."""
    rnd = random.Random(0)
    for _ in range(20):
        a, b = rnd.getrandbits(32), rnd.getrandbits(32)
        out = run(_asm.U4_PAIRS.value, {8: a, 9: b})
        assert sorted(out) == list(range(8))
        for byte in range(4):
            for h in range(2):
                shift = 8 * byte + 4 * h
                r = out[2 * byte + h]
                assert _fp16(r) == (a >> shift) & 0xF
                assert _fp16(r >> 16) == (b >> shift) & 0xF


def test_lut3_column_major_pairs():
    """The Triton kernel's block: code j of elements (0, 1) in $2j, of (2, 3) in $2j+1."""
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 8, (4, 8), generator=g)
    page = page_word_bytes(codes)
    words = [int(sum(int(page[e, s]) << (8 * e) for e in range(4))) for s in range(3)]
    table = torch.linspace(-1.5, 2.0, 8)
    out = run(_asm.lut3(table.tolist()), {16: words[0], 17: words[1], 18: words[2]})
    want = table.to(torch.float16)
    for j in range(8):
        for half, e in ((0, 0), (1, 1)):
            assert _fp16(out[2 * j] >> (16 * half)) == float(want[codes[e, j]])
            assert _fp16(out[2 * j + 1] >> (16 * half)) == float(want[codes[e + 2, j]])


def test_u4_values_nibbles():
    """The Triton kernel's block: low nibbles of bytes (0,1) / (2,3) in $0 / $1, high in $2 / $3."""
    rnd = random.Random(1)
    for _ in range(20):
        w = rnd.getrandbits(32)
        out = run(_asm.U4_VALUES.value, {4: w})
        byte = [(w >> (8 * i)) & 0xFF for i in range(4)]
        for reg, (b0, b1, sh) in enumerate([(0, 1, 0), (2, 3, 0), (0, 1, 4), (2, 3, 4)]):
            assert _fp16(out[reg]) == (byte[b0] >> sh) & 0xF
            assert _fp16(out[reg] >> 16) == (byte[b1] >> sh) & 0xF


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("preset,sm", [("turboquant_4bit_nc", False), ("tq_k4v3", True)])
def test_lut4_rows_decodes_symmetric_codebook(seed, preset, sm):
    """A token-row word of 4-bit codes (byte b: coordinates 2b, 2b+1) → the fp16 centroid pair
    of byte b in output b, through the magnitude table and the sign of each code: codes in
    bucket order (vLLM's preset) or in sign-and-magnitude order (ours)."""
    codes = TQCodec(preset, 128).keys
    assert codes.sm == [sm]
    centroids = codes.centroids[0]  # in the order the codes are stored
    table = _asm.symmetric_table_words(centroids.tolist(), sm=sm)
    block = _asm.LUT4_ROWS_SM if sm else _asm.LUT4_ROWS
    want = centroids.to(torch.float16)
    rnd = random.Random(seed)
    words = [rnd.getrandbits(32) for _ in range(30)] + [0x76543210, 0xFEDCBA98]  # every code
    for x in words:
        out = run(block.value, {4: x, 5: table[0], 6: table[1], 7: table[2], 8: table[3]})
        assert sorted(out) == [0, 1, 2, 3]
        for b in range(4):
            lo, hi = (x >> (8 * b)) & 0xF, (x >> (8 * b + 4)) & 0xF
            assert _fp16(out[b]) == float(want[lo]) and _fp16(out[b] >> 16) == float(want[hi]), (hex(x), b)


@pytest.mark.parametrize("preset", ["tq_k4v4", "tq_k3v4"])
def test_lut4_pairs_decodes_two_token_rows(preset):
    """Words A, B of rotated 4-bit value codes (8 nibbles each) → the fp16 (A, B) centroid pair
    of each nibble position, in :data:`U4_PAIRS`' output order."""
    codes = TQCodec(preset, 128).values
    assert codes.sm == [True]
    centroids = codes.centroids[0]
    table = _asm.symmetric_table_words(centroids.tolist(), sm=True)
    want = centroids.to(torch.float16)
    rnd = random.Random(3)
    words = [(rnd.getrandbits(32), rnd.getrandbits(32)) for _ in range(30)]
    words += [(0x76543210, 0xFEDCBA98), (0xFEDCBA98, 0x76543210)]    # every code on each side
    for a, b in words:
        out = run(_asm.LUT4_PAIRS.value, {8: a, 9: b, 10: table[0], 11: table[1],
                                         12: table[2], 13: table[3]})
        assert sorted(out) == list(range(8))
        for byte in range(4):
            for h in range(2):
                shift = 8 * byte + 4 * h
                r = out[2 * byte + h]
                assert _fp16(r) == float(want[(a >> shift) & 0xF]), (hex(a), byte, h)
                assert _fp16(r >> 16) == float(want[(b >> shift) & 0xF]), (hex(b), byte, h)


@pytest.mark.parametrize("preset,sm", [("turboquant_4bit_nc", False), ("tq_k4v3", True)])
def test_symmetric_table_words_rejects_asymmetric_codebooks(preset, sm):
    c = TQCodec(preset, 128).keys.centroids[0].clone()
    with pytest.raises(ValueError, match="16 centroids"):
        _asm.symmetric_table_words(c[:8].tolist(), sm=sm)
    with pytest.raises(ValueError, match="not symmetric"):  # the other order
        _asm.symmetric_table_words(c.tolist(), sm=not sm)
    assert len(_asm.symmetric_table_words(c.tolist(), sm=sm)) == 4
    c[3] += 0.01
    with pytest.raises(ValueError, match="not symmetric"):
        _asm.symmetric_table_words(c.tolist(), sm=sm)


def test_lut3_tokens_matches_the_immediate_table_block():
    """The register-table block equals :func:`lut3` (element pairs) for the same table."""
    g = torch.Generator().manual_seed(5)
    table = TQCodec("tq_k4v3", 128).values.centroids[0]
    words_tab = _asm.lut3_table_words(table.tolist())
    for _ in range(5):
        codes = torch.randint(0, 8, (4, 8), generator=g)
        page = page_word_bytes(codes)
        words = [int(sum(int(page[e, s]) << (8 * e) for e in range(4))) for s in range(3)]
        ins = {16: words[0], 17: words[1], 18: words[2]}
        a = run(_asm.lut3(table.tolist()), ins)
        b = run(_asm.LUT3_TOKENS.value, {**ins, 19: words_tab[0], 20: words_tab[1],
                                         21: words_tab[2], 22: words_tab[3]})
        assert a == b
