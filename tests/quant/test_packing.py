import pytest
import torch

from tqattn.quant.packing import gather_rows, lookup_table, pack_bits, packed_nbytes, unpack_bits, unpack_lookup


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("n", [8, 64, 80, 96, 128, 12])
def test_round_trip(bits, n):
    codes = torch.randint(0, 2 ** bits, (5, 3, n))
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 3, packed_nbytes(n, bits))
    assert torch.equal(unpack_bits(packed, bits, n), codes)


def test_vllm_byte_layouts():
    # 4-bit: even coordinate in the low nibble
    assert pack_bits(torch.tensor([0x3, 0xA]), 4).tolist() == [0xA3]
    # 3-bit: eight codes as one little-endian 24-bit word, code i at bit 3i
    codes = torch.tensor([1, 2, 3, 4, 5, 6, 7, 0])
    word = sum(int(c) << (3 * i) for i, c in enumerate(codes))
    assert pack_bits(codes, 3).tolist() == [word & 0xFF, (word >> 8) & 0xFF, word >> 16]
    assert packed_nbytes(128, 3) == 48 and packed_nbytes(128, 4) == 64


def test_bad_input():
    with pytest.raises(ValueError, match="bit width"):
        pack_bits(torch.zeros(8, dtype=torch.int64), 5)
    with pytest.raises(TypeError):
        pack_bits(torch.zeros(8), 4)
    with pytest.raises(ValueError, match="need"):
        unpack_bits(torch.zeros(3, dtype=torch.uint8), 4, 8)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("nbytes", [1, 2])
@pytest.mark.parametrize("n", [64, 12, 6])
def test_unpack_lookup_is_the_table_at_the_codes(bits, nbytes, n):
    codes = torch.randint(0, 2 ** bits, (4, 3, n))
    table = torch.randn(2 ** bits)
    lut = lookup_table(table, bits, nbytes)
    assert lut.shape == (256 ** nbytes, 8 * nbytes // bits)
    assert torch.equal(unpack_lookup(pack_bits(codes, bits), bits, n, lut), table[codes])


def test_lookup_table_needs_a_width_that_divides_a_byte():
    with pytest.raises(ValueError, match="divides 8"):
        lookup_table(torch.randn(8), 3)
    with pytest.raises(ValueError, match="rows"):
        unpack_lookup(torch.zeros(2, 4, dtype=torch.uint8), 4, 8, torch.randn(16, 2))


@pytest.mark.parametrize("w", [1, 2, 4, 8])
def test_gather_rows_is_indexing(w):
    table = torch.randn(300, w)
    table[7, 0] = float("nan")                          # bits are moved, not computed
    idx = torch.randint(0, 300, (5, 3, 4), dtype=torch.int32)
    idx[0, 0, 0] = 7
    got = gather_rows(table, idx)
    assert got.shape == (5, 3, 4, w)
    assert torch.equal(got.view(torch.int32), table[idx.long()].view(torch.int32))
    with pytest.raises(ValueError, match="float32 table"):
        gather_rows(table.double(), idx)
