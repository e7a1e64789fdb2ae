"""The tensor-core kernel at head size 256 (kernels/decode_mma.py with D = 256), replayed on CPU
as test_mma_operands.py does at 128: each 128-coordinate half is read as a head-128 page with
the second half's offset (K_OFF + 16·BS for 3-bit keys' code words, + 64 row bytes for 4-bit
keys and values, V_OFF + 16·BS for 3-bit values) and twice the strides, through the head-128
operand permutes; its operand must hold the codes of coordinates 128h + (the head-128 map).
The query's transform of length 256 ([H(a + b); H(a − b)]) and the output's un-rotation from
the halves' accumulators must be the codec's. The kernel itself runs on the GPU only."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.kernels import _mma_replay as R
from tqattn.kernels import _spec
from tqattn.quant import paged
from tqattn.quant.codec import TQCodec

decode_mma = pytest.importorskip("tqattn.kernels.decode_mma")

BS, D = R.BS, 256
LANE = torch.arange(32)
G, T = LANE // 4, LANE % 4
RHO = torch.arange(64)
TAU = {0: 8 * (RHO % 8) + RHO // 8, 1: 16 * ((RHO % 8) // 2) + 2 * (RHO // 8) + RHO % 2}
S = R.stack


def _off(codec, name):
    return BS * codec.layout.field(name).offset


def _word3(page, off, word, tok):
    """The 8 codes of 3-bit code word `word` (of 32) of tokens tok: byte s at
    off + (32s + word)·BS + tok."""
    by = torch.stack([page[off + (32 * s + word) * BS + tok] for s in range(3)], -1)
    return paged.page_word_codes(by)                                     # (32, 8)


@pytest.mark.parametrize("h", [0, 1])
def test_key_operand_3bit_halves(h):
    """3-bit keys: half h's words t + 4m (m = 0..3) of tokens 8g.., through LUT3_ROWS (output
    e + 4p: codes 2p, 2p + 1 of token e) and the head-128 permute."""
    codec, page, slots = R.page("turboquant_k3v4_nc", D)
    codes = R.codes(codec, slots, "k_idx")
    off = _off(codec, "k_idx")

    def lut3_rows(m, first):              # [32, h, e0, e1, p0, p1]
        c = [_word3(page, off, 16 * h + T + 4 * m, 8 * G + first + e) for e in range(4)]
        return R.j16([S(c[i % 4][:, 2 * (i // 4)], c[i % 4][:, 2 * (i // 4) + 1])
                      for i in range(16)])

    lows = [lut3_rows(m, 0) for m in range(4)]
    highs = [lut3_rows(m, 4) for m in range(4)]
    x = S(R.j4(*lows), R.j4(*highs))               # [32, h, e0, e1, p0, p1, m0, m1, r7]
    x = x.permute(0, 2, 3, 4, 5, 6, 7, 8, 1)
    op = R.permute_reshape(x, [8, 3, 2, 0, 7, 6, 5, 4, 1, 9], (64, 128))
    coord = decode_mma.operand_coord(torch.arange(D), 0, D)[128 * h:128 * (h + 1)]
    assert sorted(coord.tolist()) == list(range(128 * h, 128 * (h + 1)))
    assert torch.equal(op, codes[TAU[0]][:, coord])


@pytest.mark.parametrize("h", [0, 1])
def test_key_operand4_halves(h):
    """4-bit row keys (MAP 1): half h's row bytes 64h + 16t.. of 128-byte rows of the lane's
    tokens 16(g // 2) + g % 2 + 2j."""
    codec, page, slots = R.page("tq_k4v3", D)
    codes = R.codes(codec, slots, "k_idx")
    off = _off(codec, "k_idx")

    def key_row(j):                       # [32, e, r0, r1, q0, q1]
        tok = 16 * (G // 2) + G % 2 + 2 * j
        by = torch.stack([page[off + tok * 128 + 64 * h + 16 * T + b] for b in range(16)], -1)
        return R.j4(*[R.j4(*[S(by[:, 4 * q + r] & 15, by[:, 4 * q + r] >> 4) for r in range(4)])
                      for q in range(4)])

    rows = [key_row(j) for j in range(8)]
    x = S(R.j4(*rows[:4]), R.j4(*rows[4:])).permute(0, 2, 3, 4, 5, 6, 7, 8, 1)
    op = R.permute_reshape(x, [8, 7, 6, 0, 5, 4, 3, 2, 1, 9], (64, 128))
    coord = decode_mma.operand_coord(torch.arange(D), 1, D)[128 * h:128 * (h + 1)]
    assert torch.equal(op, codes[TAU[1]][:, coord])


@pytest.mark.parametrize("h", [0, 1])
def test_value_rows_halves(h):
    """4-bit row values: half h's bytes 64h + 8g.. of 128-byte rows (tokens 16t + j and
    16t + 8 + j), U4_PAIRS and the head-128 permute: row ρ of half h is coordinate
    128h + 16(ρ % 8) + ρ // 8."""
    codec, page, slots = R.page("turboquant_k3v4_nc", D)
    codes = R.codes(codec, slots, "v_q")
    off = _off(codec, "v_q")

    def nibbles(tok):                     # (32, 16): nibble k of the lane's 8 bytes
        by = torch.stack([page[off + 128 * tok + 64 * h + 8 * G + b] for b in range(8)], -1)
        return torch.stack([(by[:, k // 2] >> (4 * (k % 2))) & 15 for k in range(16)], -1)

    calls = []
    for j in range(8):
        a, b = nibbles(16 * T + j), nibbles(16 * T + 8 + j)
        calls.append(S(R.j8([S(a[:, k], b[:, k]) for k in range(8)]),
                       R.j8([S(a[:, 8 + k], b[:, 8 + k]) for k in range(8)])))
    x = S(R.j4(*calls[:4]), R.j4(*calls[4:]))      # [32, h, nib, b0, b1, w, j0, j1, j2]
    x = x.permute(0, 2, 3, 4, 5, 6, 7, 8, 1)
    op = R.permute_reshape(x, [5, 4, 3, 2, 0, 8, 7, 6, 1, 9], (128, 64))
    coord = decode_mma.value_row_coord(torch.arange(D), D)[128 * h:128 * (h + 1)]
    assert sorted(coord.tolist()) == list(range(128 * h, 128 * (h + 1)))
    assert torch.equal(op, codes[TAU[0]][:, coord].T)


@pytest.mark.parametrize("h", [0, 1])
def test_value_rows3_halves(h):
    """3-bit column-major values: half h's code words 16h + g + 8w (sub-planes 32·BS apart)
    of the lane's tokens 16t.., LUT3_TOKENS and the head-128 permute."""
    codec, page, slots = R.page("tq_k4v3", D)
    codes = R.codes(codec, slots, "v_idx")
    off = _off(codec, "v_idx")

    def value_word3(w):                   # [32, e, h, c0, c1, c2, kb0, kb1]
        per_tok = [_word3(page, off, 16 * h + G + 8 * w, 16 * T + i) for i in range(16)]
        quads = []
        for kb in range(4):
            pair = [S(per_tok[4 * kb + 2 * hh][:, c], per_tok[4 * kb + 2 * hh + 1][:, c])
                    for c in range(8) for hh in range(2)]
            quads.append(R.j16(pair))
        return R.j4(*quads)

    x = S(value_word3(0), value_word3(1)).permute(0, 2, 3, 4, 5, 6, 7, 8, 1)
    op = R.permute_reshape(x, [8, 5, 4, 3, 0, 7, 6, 2, 1, 9], (128, 64))
    coord = decode_mma.value_row_coord(torch.arange(D), D, 1)[128 * h:128 * (h + 1)]
    assert torch.equal(op, codes[TAU[1]][:, coord].T)


@pytest.mark.parametrize("preset", ["turboquant_k3v4_nc", "tq_k4v3"])
def test_query_rotation_and_output_unrotation_head256(preset):
    """The query operands of the halves (fused_query_ref: [H(a + b); H(a − b)] of the σ-ordered
    halves) are q·R[:, σ]·scale; the rotated values' output, s[coord]/16 · [H(a + b);
    H(a − b)] of the halves' accumulators, is õ·Rᵀ."""
    codec = TQCodec(preset, D)
    spec = _spec.kernel_spec(codec, 16)
    keys = spec.mma.keys
    _, sgn, _, _, osgn = decode_mma._tables(spec, "cpu")
    r = codec.rotation.float()
    q = torch.randn(16, D, dtype=torch.bfloat16) * 3
    got = decode_mma.fused_query_ref(q, sgn, 0.7, keys=keys)
    want = ((q.float() @ r[:, decode_mma.operand_coord(torch.arange(D), keys, D)]) * 0.7).half()
    assert ((got.float() - want.float()).norm() / want.float().norm()) < 1e-3
    if spec.mma.rotated_values:
        coord = decode_mma.value_row_coord(torch.arange(D), D, spec.mma.vals)
        acc = torch.randn(D, 8, dtype=torch.float64)             # rows: the halves' ρ
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < 128:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        a, b = acc[:128], acc[128:]
        got_o = osgn.double()[:, None] * torch.cat([h @ (a + b), h @ (a - b)])
        natural = torch.zeros_like(acc)
        natural[coord] = acc
        want_o = (natural.T @ r.double().T).T
        assert torch.allclose(got_o, want_o[coord], atol=1e-10)


def test_head256_formats():
    """Every head size 128 tensor-core format but fp8 keys reads at 256, and stores a decode
    step's new token itself."""
    for preset, fmt in (("turboquant_k3v4_nc", (0, 0)), ("tq_k4v3", (1, 1)),
                        ("turboquant_4bit_nc", (1, 0)), ("turboquant_3bit_nc", (0, 2)),
                        ("tq_k3v3", (0, 1)), ("tq_k4v4", (1, 3)), ("tq_k3v4", (0, 3))):
        mma = _spec.kernel_spec(TQCodec(preset, D), 16).mma
        assert mma and (mma.keys, mma.vals) == fmt and mma.store, preset
    assert not _spec.kernel_spec(TQCodec("turboquant_k8v4", D), 16).mma


_COMPILE = """
import json, sys
from bench.sass_stats import compile_decode
kernel, _ = compile_decode(sys.argv[1], 256, 2)
print(json.dumps({"copies": "cp.async.commit_group" in kernel.asm["ptx"],
                  "shared": kernel.metadata.shared}))
"""


@pytest.mark.parametrize("preset,copies", [("turboquant_k3v4_nc", True), ("tq_k4v3", False)])
def test_head256_async_copies(preset, copies):
    """The head-256 build the product launches, compiled for sm_90 on CPU (in a process without
    the interpreter): in turboquant_k3v4_nc's format the tiles' words travel by cp.async into
    one 256-byte shared slot per word (_key_slots + _value_slots of them), in the other formats
    they load into registers."""
    pytest.importorskip("triton.experimental.gluon")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", _COMPILE, preset], env=env, cwd=root,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    slots = decode_mma._key_slots(0, 0) + decode_mma._value_slots(0)
    assert got["copies"] == copies
    assert (got["shared"] >= 256 * slots) == copies, got
