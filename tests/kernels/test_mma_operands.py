"""The tensor-core kernel's operand bookkeeping for 4-bit keys and rotated 3-bit values
(kernels/decode_mma.py: _load_keys4/_key_rows4, _load_values3/_value_rows3, the score
rows' scalars and the output's un-rotation), the 3-bit keys' trade into the column-major values'
token order (_parity_word) and the 3-bit uniform values' table, replayed on CPU: the same per-lane loads from a
page and the same join / reshape / permute, with the asm blocks' documented outputs (checked
against the PTX emulator in test_asm_blocks.py). Each built operand must hold, at every
(row, column), the code of the token and coordinate the kernel's index maps name. The kernel
itself runs on the GPU only (test_kernels_gpu.py)."""

import torch

from tests.kernels import _mma_replay as R
from tqattn.quant.codec import TQCodec

decode_mma = __import__("pytest").importorskip("tqattn.kernels.decode_mma")

BS = R.BS
_page, _codes, _stack, _j4, _j16 = R.page, R.codes, R.stack, R.j4, R.j16
_permute_reshape = R.permute_reshape


@__import__("pytest").mark.parametrize("preset,token_map", [("tq_k4v3", 1),
                                                             ("turboquant_4bit_nc", 0)])
def test_key_operand4_rows_and_columns(preset, token_map):
    """MAP 1 (rotated 3-bit values): the lane's tokens 16(g // 2) + g % 2 + 2j; MAP 0 (uniform
    4-bit values): tokens 8g + j — row ρ is then token 8(ρ % 8) + ρ // 8, the uniform values'
    order."""
    codec, page, slots = _page(preset)
    codes = _codes(codec, slots, "k_idx")
    k_off = BS * codec.layout.field("k_idx").offset
    lane = torch.arange(32)
    g, t = lane // 4, lane % 4

    def row_bytes(j):                     # _load_keys4: 16 bytes 16t.. of the lane's token j
        tok = 16 * (g // 2) + g % 2 + 2 * j if token_map else 8 * g + j
        return torch.stack([page[k_off + tok * 64 + 16 * t + b] for b in range(16)], -1)

    def key_row4(by):                     # [32, e, r0, r1, q0, q1]: byte 4q + r, nibble e
        quads = []
        for q in range(4):
            pairs = [_stack(by[:, 4 * q + r] & 15, by[:, 4 * q + r] >> 4) for r in range(4)]
            quads.append(_j4(*pairs))
        return _j4(*quads)

    rows = [key_row4(row_bytes(j)) for j in range(8)]
    x = _stack(_j4(*rows[:4]), _j4(*rows[4:]))            # [32, e, r0, r1, q0, q1, j0, j1, j2]
    x = x.permute(0, 2, 3, 4, 5, 6, 7, 8, 1)              # halves last, as _halves appends them
    op = _permute_reshape(x, [8, 7, 6, 0, 5, 4, 3, 2, 1, 9], (64, 128))
    rho, k = torch.arange(64), torch.arange(128)
    if token_map:                                               # the kernel's token of row ρ
        tau = 16 * ((rho % 8) // 2) + 2 * (rho // 8) + rho % 2
    else:
        tau = 8 * (rho % 8) + rho // 8
    coord = decode_mma.operand_coord(k, keys=1)
    assert sorted(tau.tolist()) == list(range(64)) and sorted(coord.tolist()) == list(range(128))
    assert torch.equal(op, codes[tau][:, coord])


def test_value_operand3_rows_and_columns():
    codec, page, slots = _page("tq_k4v3")
    codes = _codes(codec, slots, "v_idx")
    f = codec.layout.field("v_idx")
    v_off = BS * f.offset
    lane = torch.arange(32)
    g, t = lane // 4, lane % 4
    # the kernel's loads: sub-plane s of code word g + 8w at v_off + (16s + g + 8w)·BS, tokens
    # 16t.. (column-major)
    words = {}
    for w in range(2):
        for s in range(3):
            plane = 16 * s + g + 8 * w
            words[w, s] = torch.stack([page[v_off + plane * BS + 16 * t + i] for i in range(16)], -1)

    def code(w, tok):                     # the 3-bit code c of word g + 8w, token 16t + tok
        by = [words[w, s][:, tok].long() for s in range(3)]
        out = []
        for c in range(8):
            if c < 6:
                out.append((by[c // 2] >> (4 * (c % 2))) & 7)
            else:
                out.append(sum(((by[s] >> (3 + 4 * (c - 6))) & 1) << s for s in range(3)))
        return out

    def value_word3(w):                   # [32, e, h, c0, c1, c2, kb0, kb1]
        quads = []
        for kb in range(4):
            outs = []
            for c in range(8):
                for h in range(2):
                    a, b = code(w, 4 * kb + 2 * h), code(w, 4 * kb + 2 * h + 1)
                    outs.append(_stack(a[c], b[c]))          # LUT3_TOKENS output 2c + h
            quads.append(_j16(outs))
        return _j4(*quads)

    x = _stack(value_word3(0), value_word3(1))     # [32, e, h, c0, c1, c2, kb0, kb1, w]
    x = x.permute(0, 2, 3, 4, 5, 6, 7, 8, 1)       # halves last
    op = _permute_reshape(x, [8, 5, 4, 3, 0, 7, 6, 2, 1, 9], (128, 64))
    rows, k = torch.arange(128), torch.arange(64)
    coord = decode_mma.value_row_coord(rows, 128, 1)
    tok = 16 * ((k // 2) % 4) + 4 * (k // 16) + 2 * ((k // 8) % 2) + k % 2
    rho = k                                        # P's row ρ is the operand's column k
    assert torch.equal(tok, 16 * ((rho % 8) // 2) + 2 * (rho // 8) + rho % 2)
    assert sorted(coord.tolist()) == list(range(128)) and sorted(tok.tolist()) == list(range(64))
    assert torch.equal(op, codes[tok][:, coord].T)


def test_output_unrotation_and_query_rotation_tables():
    """Row ρ of the output accumulator holds coordinate value_row_coord(ρ) of Σ p·ṽ (rotated);
    s[coord]/√128 · (H·acc)[ρ] is the output at that coordinate; and the query operand of
    4-bit keys is q·R[:, σ] (fused_query_ref with keys=1)."""
    from tqattn.kernels import _spec
    codec = TQCodec("tq_k4v3", 128)
    spec = _spec.kernel_spec(codec, 16)
    assert spec.mma and (spec.mma.keys, spec.mma.vals, spec.mma.store) == (1, 1, True)
    tab, sgn, _, vtab, osgn = decode_mma._tables(spec, "cpu")
    r = codec.rotation.float()
    coord = decode_mma.value_row_coord(torch.arange(128), 128, spec.mma.vals)
    acc = torch.randn(128, 8, dtype=torch.float64)           # rotated coordinates, by row ρ
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < 128:                                  # Sylvester's Hadamard matrix
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    got = osgn.double()[:, None] * (h @ acc)                 # the kernel: WHT over ρ, × osgn
    natural = torch.zeros_like(acc)
    natural[coord] = acc
    want = (natural.T @ r.double().T).T                      # o = õ·Rᵀ, natural coordinates
    assert torch.allclose(got, want[coord], atol=1e-10)
    q = torch.randn(16, 128, dtype=torch.bfloat16) * 3
    got_q = decode_mma.fused_query_ref(q, sgn, 0.7, keys=1)
    want_q = ((q.float() @ r[:, decode_mma.operand_coord(torch.arange(128), 1)]) * 0.7).half()
    assert ((got_q.float() - want_q.float()).norm() / want_q.float().norm()) < 1e-3
    assert vtab.shape == tab.shape == (32, 4)


def test_parity_words_put_3bit_keys_in_the_column_major_values_token_order():
    """_parity_word (MAP 1): a lane's sub-plane word of tokens 8g..8g+7 becomes the word whose
    byte j is token 16(g // 2) + g % 2 + 2j — the token of score row g + 8j in that order."""
    from tests.kernels.ptx_emu import _prmt

    plane = torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(3))
    lane = torch.arange(32)
    g = lane // 4
    word = lambda by: sum(int(b) << (8 * i) for i, b in enumerate(by))   # noqa: E731
    own = [(word(plane[8 * int(x):8 * int(x) + 4]), word(plane[8 * int(x) + 4:8 * int(x) + 8]))
           for x in g]                                                  # _load_keys, _lo_hi
    ev = [_prmt(lo, hi, decode_mma.EVEN_BYTES.value) for lo, hi in own]
    od = [_prmt(lo, hi, decode_mma.ODD_BYTES.value) for lo, hi in own]
    odd = [(int(x) // 4) % 2 == 1 for x in lane]
    send = [e if o else d for e, d, o in zip(ev, od, odd)]
    for ln in range(32):
        keep = od[ln] if odd[ln] else ev[ln]
        got = send[ln ^ 4]                                              # _bfly(x, 4)
        first, last = (got, keep) if odd[ln] else (keep, got)
        bytes_ = [(first >> (8 * i)) & 0xFF for i in range(4)] + [(last >> (8 * i)) & 0xFF for i in range(4)]
        gg = ln // 4
        assert bytes_ == [int(plane[16 * (gg // 2) + gg % 2 + 2 * j]) for j in range(8)], ln
    rho = torch.arange(64)
    tau = 16 * ((rho % 8) // 2) + 2 * (rho // 8) + rho % 2                 # the kernel's MAP 1
    assert torch.equal(tau, 16 * ((rho % 8) // 2) + (rho % 8) % 2 + 2 * (rho // 8))


def test_3bit_uniform_values_format_and_table():
    """turboquant_3bit_nc reads as 3-bit centroid keys with 3-bit uniform column-major values
    (VALS 2; the kernel stores new tokens itself), whose table words give the codes 0..7 exactly:
    scale·code + zero point is the codec's v̂ = q·scale + min."""
    from tests.kernels.ptx_emu import run
    from tqattn.kernels import _asm, _spec
    from tqattn.quant.paged import page_word_bytes

    for preset, fmt in (("turboquant_3bit_nc", (0, 2, True)), ("tq_k3v3", (0, 1, True)),
                        ("turboquant_k3v4_nc", (0, 0, True)), ("tq_k4v3", (1, 1, True)),
                        ("turboquant_k8v4", (2, 0, False)), ("tq_k4v4", (1, 3, True)),
                        ("tq_k3v4", (0, 3, True))):
        mma = _spec.kernel_spec(TQCodec(preset, 128), 16).mma
        assert (mma.keys, mma.vals, mma.store) == fmt, preset
        assert mma.token_map == int(fmt[1] in (1, 2))
    spec = _spec.kernel_spec(TQCodec("turboquant_3bit_nc", 128), 16)
    vtab = decode_mma._tables(spec, "cpu")[3]
    assert vtab.shape == (32, 4) and vtab[0].tolist() == _asm.lut3_table_words(range(8))
    codes = torch.randint(0, 8, (4, 8), generator=torch.Generator().manual_seed(1))
    page = page_word_bytes(codes)
    words = [int(sum(int(page[e, s]) << (8 * e) for e in range(4))) for s in range(3)]
    tab = vtab[0].tolist()
    out = run(_asm.LUT3_TOKENS.value, {16: words[0], 17: words[1], 18: words[2],
                                       19: tab[0] & 0xFFFFFFFF, 20: tab[1] & 0xFFFFFFFF,
                                       21: tab[2] & 0xFFFFFFFF, 22: tab[3] & 0xFFFFFFFF})
    reference = run(_asm.lut3([float(c) for c in range(8)]), {16: words[0], 17: words[1], 18: words[2]})
    assert out == reference
    import numpy as np
    halves = sorted({float(np.array([v & 0xFFFF, v >> 16], dtype=np.uint16).view(np.float16)[i])
                     for v in out.values() for i in range(2)})
    assert set(halves) <= set(range(8)) and set(halves) == set(codes.flatten().tolist())


def test_key_operand8_rows_and_columns():
    """fp8 row keys (turboquant_k8v4, KEYS 2): the lane's 32 row bytes 32t.. of tokens 8g + j,
    each int32 word's bytes (0, 1), (2, 3) as fp16 pairs (cvt.rn.f16x2.e4m3x2: byte 0 in the low
    half) — the operand holds, at row ρ and column k, the key of token 8(ρ % 8) + ρ // 8 at
    coordinate operand_coord(k, 1), unrotated."""
    codec, page, slots = _page("turboquant_k8v4")
    f = codec.layout.field("k_fp8")
    keys = slots[:, f.offset:f.offset + f.nbytes].contiguous().view(torch.float8_e4m3fn).float()
    k_off = BS * f.offset
    lane = torch.arange(32)
    g, t = lane // 4, lane % 4

    def row_bytes(j):                     # _load_keys8: 32 bytes 32t.. of the lane's token j
        tok = 8 * g + j
        return torch.stack([page[k_off + tok * 128 + 32 * t + b] for b in range(32)], -1)

    def e4m3(b):
        return b.contiguous().view(torch.float8_e4m3fn).float()

    def key_row8(by):                     # [32, e, r0, c0, c1, c2]: bytes 4c + 2r0 + e
        outs = [_stack(e4m3(by[:, 4 * c + 2 * r0]), e4m3(by[:, 4 * c + 2 * r0 + 1]))
                for c in range(8) for r0 in range(2)]
        return _j16(outs)

    rows = [key_row8(row_bytes(j)) for j in range(8)]
    x = _stack(_j4(*rows[:4]), _j4(*rows[4:]))            # [32, e, r0, c0, c1, c2, j0, j1, j2]
    x = x.permute(0, 2, 3, 4, 5, 6, 7, 8, 1)              # halves last, as _halves appends them
    op = _permute_reshape(x, [8, 7, 6, 0, 5, 4, 3, 2, 1, 9], (64, 128))
    rho, k = torch.arange(64), torch.arange(128)
    tau = 8 * (rho % 8) + rho // 8
    coord = decode_mma.operand_coord(k, keys=2)
    assert torch.equal(op, keys[tau][:, coord])
    assert torch.equal(coord, decode_mma.operand_coord(k, keys=1))


def test_fp8_keys_take_only_row_values_and_an_unrotated_query():
    """fp8 keys load in the row values' token order only: with 3-bit values (column-major)
    the layout stays off the tensor-core kernel; the query twin of KEYS 2 is q[σ]·scale."""
    from tqattn.kernels import _spec
    from tqattn.quant.presets import KeySpec, TQPreset, ValueSpec
    k8v3 = TQPreset("k8v3_test", KeySpec("fp8"), ValueSpec("uniform", 3), rotation_signs=True,
                    codebook="exact")
    assert _spec.kernel_spec(TQCodec(k8v3, 128), 16).mma is None
    q = torch.randn(4, 128, dtype=torch.bfloat16)
    sk = decode_mma.operand_coord(torch.arange(128), 2)
    got = decode_mma.fused_query_ref(q, torch.ones(128), 0.5, keys=2)
    assert torch.equal(got, (q.float()[:, sk] * 0.5).half())
