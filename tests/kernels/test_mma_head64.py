"""The tensor-core kernel at head size 64 (kernels/decode_mma.py with D = 64), replayed on CPU as
test_mma_operands.py does at 128: the per-lane loads from a page, the asm blocks' documented
outputs, and the same join / reshape / permute. Each operand must hold, at every (row, column),
the code of the token and coordinate that the kernel's index maps name; the query's rotation
and the output's un-rotation must be the codec's. The kernel itself runs on the GPU only
(test_kernels_gpu.py)."""

import pytest
import torch

from tests.kernels import _mma_replay as R
from tqattn.kernels import _spec
from tqattn.quant import paged
from tqattn.quant.codec import TQCodec

decode_mma = pytest.importorskip("tqattn.kernels.decode_mma")

BS, D = R.BS, 64
_stack, _j4, _j8, _j16, _permute_reshape = R.stack, R.j4, R.j8, R.j16, R.permute_reshape


def _page(preset):
    return R.page(preset, D)


def _off(codec, name):
    return BS * codec.layout.field(name).offset


LANE = torch.arange(32)
G, T = LANE // 4, LANE % 4
RHO = torch.arange(64)
TAU = {0: 8 * (RHO % 8) + RHO // 8, 1: 16 * ((RHO % 8) // 2) + 2 * (RHO // 8) + RHO % 2}


def _word3_codes(page, off, word, tok):
    """The 8 codes of 3-bit code word `word` (per lane) of tokens tok (per lane), read as the
    kernel reads them: byte s at off + (8s + word)·BS + tok (column-major sub-planes)."""
    by = torch.stack([page[off + (8 * s + word) * BS + tok] for s in range(3)], -1)
    return paged.page_word_codes(by)                                     # (32, 8)


@pytest.mark.parametrize("preset", ["turboquant_k3v4_nc", "tq_k3v3"])
def test_key_operand_3bit_head64(preset):
    """3-bit keys: the lane's words t and t + 4 (6 sub-plane words: _load_keys with D = 64) of
    tokens 8g..8g+7, through LUT3_ROWS (output e + 4p: codes 2p, 2p + 1 of token e), two
    _key_calls and the permute [7, 3, 2, 0, 6, 5, 4, 1, 8]; MAP 1 (rotated 3-bit values)
    trades tokens after the load (test_mma_operands covers _parity_word), so the page order
    checked here is MAP 0's."""
    codec, page, slots = _page(preset)
    codes = R.codes(codec, slots, "k_idx")
    off = _off(codec, "k_idx")

    def lut3_rows(word, first):          # [32, h, e0, e1, p0, p1]
        c = [_word3_codes(page, off, word, 8 * G + first + e) for e in range(4)]
        return _j16([_stack(c[i % 4][:, 2 * (i // 4)], c[i % 4][:, 2 * (i // 4) + 1])
                     for i in range(16)])

    l0, h0 = lut3_rows(T, 0), lut3_rows(T, 4)
    l1, h1 = lut3_rows(T + 4, 0), lut3_rows(T + 4, 4)
    x = _stack(_stack(l0, l1), _stack(h0, h1))     # [32, h, e0, e1, p0, p1, m0, r7]
    x = x.permute(0, 2, 3, 4, 5, 6, 7, 1)          # halves last
    op = _permute_reshape(x, [7, 3, 2, 0, 6, 5, 4, 1, 8], (64, 64))
    coord = decode_mma.operand_coord(torch.arange(64), 0, 64)
    assert sorted(coord.tolist()) == list(range(64))
    assert torch.equal(op, codes[TAU[0]][:, coord])


@pytest.mark.parametrize("preset,token_map", [("tq_k4v3", 1), ("turboquant_4bit_nc", 0)])
def test_key_operand4_head64(preset, token_map):
    """4-bit row keys: the lane's 8 row bytes 8t.. (one int64) of its 8 tokens (MAP 1: tokens
    16(g // 2) + g % 2 + 2j; MAP 0: 8g + j), LUT4_ROWS per int32, the permute
    [7, 6, 5, 0, 4, 3, 2, 1, 8]: column e + 2t + 8r + 32q is byte 4q + r's nibble e."""
    codec, page, slots = _page(preset)
    codes = R.codes(codec, slots, "k_idx")
    off = _off(codec, "k_idx")

    def key_row(j):                       # [32, e, r0, r1, q0]
        tok = 16 * (G // 2) + G % 2 + 2 * j if token_map else 8 * G + j
        by = torch.stack([page[off + tok * 32 + 8 * T + b] for b in range(8)], -1)
        quads = [_j4(*[_stack(by[:, 4 * q + r] & 15, by[:, 4 * q + r] >> 4) for r in range(4)])
                 for q in range(2)]
        return _stack(*quads)

    rows = [key_row(j) for j in range(8)]
    x = _stack(_j4(*rows[:4]), _j4(*rows[4:]))     # [32, e, r0, r1, q0, j0, j1, j2]
    x = x.permute(0, 2, 3, 4, 5, 6, 7, 1)
    op = _permute_reshape(x, [7, 6, 5, 0, 4, 3, 2, 1, 8], (64, 64))
    coord = decode_mma.operand_coord(torch.arange(64), 1, 64)
    assert sorted(coord.tolist()) == list(range(64))
    assert torch.equal(op, codes[TAU[token_map]][:, coord])


@pytest.mark.parametrize("preset,field", [("turboquant_k3v4_nc", "v_q"), ("tq_k4v4", "v_idx")])
def test_value_operand_rows_head64(preset, field):
    """4-bit row values: the lane's int32 of row bytes 4g.. of tokens 16t + j and 16t + 8 + j
    (_load_values with D = 64), through U4_PAIRS / LUT4_PAIRS (output k: nibble k of both
    tokens), the permute [4, 3, 2, 0, 7, 6, 5, 1, 8]: row ρ is coordinate 8(ρ % 8) + ρ // 8,
    column c the score row c's token (MAP 0)."""
    codec, page, slots = _page(preset)
    codes = R.codes(codec, slots, field)
    off = _off(codec, field)

    def nibbles(tok):                     # (32, 8): nibble k of the lane's int32, k = 2 byte + h
        by = torch.stack([page[off + 32 * tok + 4 * G + b] for b in range(4)], -1)
        return torch.stack([(by[:, k // 2] >> (4 * (k % 2))) & 15 for k in range(8)], -1)

    calls = []
    for j in range(8):
        a, b = nibbles(16 * T + j), nibbles(16 * T + 8 + j)
        calls.append(_j8([_stack(a[:, k], b[:, k]) for k in range(8)]))   # [32, h, nib, b0, b1]
    x = _stack(_j4(*calls[:4]), _j4(*calls[4:]))   # [32, h, nib, b0, b1, j0, j1, j2]
    x = x.permute(0, 2, 3, 4, 5, 6, 7, 1)
    op = _permute_reshape(x, [4, 3, 2, 0, 7, 6, 5, 1, 8], (64, 64))
    coord = decode_mma.value_row_coord(torch.arange(64), 64)
    assert sorted(coord.tolist()) == list(range(64))
    assert torch.equal(op, codes[TAU[0]][:, coord].T)


@pytest.mark.parametrize("preset,field", [("tq_k4v3", "v_idx"), ("turboquant_3bit_nc", "v_q")])
def test_value_operand3_head64(preset, field):
    """3-bit column-major values: sub-plane s of code word g (at (8s + g)·BS) of the lane's
    tokens 16t.. (_load_values3 with D = 64), LUT3_TOKENS (output 2c + h: code c of tokens
    4kb + 2h, +1), the permute [5, 4, 3, 0, 7, 6, 2, 1, 8]: row g + 8c is coordinate 8g + c."""
    codec, page, slots = _page(preset)
    codes = R.codes(codec, slots, field)
    off = _off(codec, field)
    per_tok = [_word3_codes(page, off, G, 16 * T + i) for i in range(16)]
    quads = []
    for kb in range(4):
        outs = []
        for c in range(8):
            for h in range(2):
                outs.append(_stack(per_tok[4 * kb + 2 * h][:, c], per_tok[4 * kb + 2 * h + 1][:, c]))
        quads.append(_j16(outs))
    x = _j4(*quads)                                # [32, e, h, c0, c1, c2, kb0, kb1]
    x = x.permute(0, 2, 3, 4, 5, 6, 7, 1)
    op = _permute_reshape(x, [5, 4, 3, 0, 7, 6, 2, 1, 8], (64, 64))
    coord = decode_mma.value_row_coord(torch.arange(64), 64)
    assert torch.equal(op, codes[TAU[1]][:, coord].T)


@pytest.mark.parametrize("preset", ["turboquant_k3v4_nc", "tq_k4v3"])
def test_query_rotation_and_output_unrotation_head64(preset):
    """The query operand (fused_query_ref, the twin of _fused_query with its 64-row transform)
    is q·R[:, σ]·scale; the rotated values' output rows, s[coord]/√64 · (H·acc)[ρ], are õ·Rᵀ."""
    codec = TQCodec(preset, D)
    spec = _spec.kernel_spec(codec, 16)
    keys = spec.mma.keys
    assert spec.mma and not spec.mma.store
    _, sgn, _, _, osgn = decode_mma._tables(spec, "cpu")
    r = codec.rotation.float()
    q = torch.randn(16, D, dtype=torch.bfloat16) * 3
    got = decode_mma.fused_query_ref(q, sgn, 0.7, keys=keys)
    want = ((q.float() @ r[:, decode_mma.operand_coord(torch.arange(D), keys, D)]) * 0.7).half()
    assert got.shape == (16, D)
    assert ((got.float() - want.float()).norm() / want.float().norm()) < 1e-3
    if spec.mma.rotated_values:
        coord = decode_mma.value_row_coord(torch.arange(D), D)
        acc = torch.randn(D, 8, dtype=torch.float64)
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < D:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        natural = torch.zeros_like(acc)
        natural[coord] = acc
        want_o = (natural.T @ r.double().T).T
        assert torch.allclose(osgn.double()[:, None] * (h @ acc), want_o[coord], atol=1e-10)


def test_head64_formats():
    """Every head size 128 tensor-core format but fp8 keys reads at 64 too, without the fused
    store (the store kernel writes the step's token first); 80 and 96 stay on the portable
    kernel."""
    for preset, fmt in (("turboquant_k3v4_nc", (0, 0)), ("tq_k4v3", (1, 1)),
                        ("turboquant_4bit_nc", (1, 0)), ("turboquant_3bit_nc", (0, 2)),
                        ("tq_k3v3", (0, 1)), ("tq_k4v4", (1, 3)), ("tq_k3v4", (0, 3))):
        mma = _spec.kernel_spec(TQCodec(preset, 64), 16).mma
        assert mma and (mma.keys, mma.vals) == fmt and not mma.store, preset
        assert not _spec.kernel_spec(TQCodec(preset, 80), 16).mma, preset
    assert not _spec.kernel_spec(TQCodec("turboquant_k8v4", 64), 16).mma
