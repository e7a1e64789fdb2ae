"""The tensor-core kernel's operand bookkeeping for 4-bit keys and rotated 3-bit values
(kernels/decode_mma.py: _load_keys4/_key_operand4, _load_values3/_value_operand3, the score
rows' scalars and the output's un-rotation), replayed on CPU: the same per-lane loads from a
page and the same join / reshape / permute, with the asm blocks' documented outputs (checked
against the PTX emulator in test_asm_blocks.py). Each built operand must hold, at every
(row, column), the code of the token and coordinate the kernel's index maps name. The kernel
itself runs on the GPU only (test_kernels_gpu.py)."""

import torch

from tqattn.quant import paged
from tqattn.quant.codec import TQCodec
from tqattn.quant.packing import unpack_bits

decode_mma = __import__("pytest").importorskip("tqattn.kernels.decode_mma")

BS = 64  # one page holds the whole 64-token tile


def _page(preset="tq_k4v3", seed=0):
    codec = TQCodec(preset, 128)
    g = torch.Generator().manual_seed(seed)
    cache = torch.zeros(paged.kv_cache_shape(1, BS, 1, codec), dtype=torch.uint8)
    k, v = torch.randn(BS, 1, 128, generator=g), torch.randn(BS, 1, 128, generator=g)
    paged.store_ref(codec, k, v, cache, torch.arange(BS))
    slots = paged.gather_slots_ref(codec, cache, torch.zeros(1, 1, dtype=torch.int32),
                                   torch.tensor([BS]))
    return codec, cache[0, 0], slots[0].reshape(BS, -1)


def _codes(codec, slots, name):
    f = codec.layout.field(name)
    return unpack_bits(slots[:, f.offset:f.offset + f.nbytes], f.bits, f.count)   # (BS, 128)


def _stack(*xs):
    return torch.stack(xs, -1)           # gl.join: a new last dimension


def _j4(a, b, c, d):
    return _stack(_stack(a, b), _stack(c, d))


def _permute_reshape(x, order, shape):
    return x.reshape(8, 4, *x.shape[1:]).permute(order).reshape(shape)


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
    codec, page, slots = _page()
    codes = _codes(codec, slots, "v_idx")
    f = codec.layout.field("v_idx")
    v_off = BS * f.offset
    lane = torch.arange(32)
    g, t = lane // 4, lane % 4
    # the kernel's loads: sub-plane s of code word 2g + w at v_off + (16s + 2g + w)·BS, tokens
    # 16t.. (column-major)
    words = {}
    for w in range(2):
        for s in range(3):
            plane = 16 * s + 2 * g + w
            words[w, s] = torch.stack([page[v_off + plane * BS + 16 * t + i] for i in range(16)], -1)

    def code(w, tok):                     # the 3-bit code c of word 2g + w, token 16t + tok
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
    coord = decode_mma.value_row_coord(rows)
    tok = 16 * ((k // 2) % 4) + 4 * (k // 16) + 2 * ((k // 8) % 2) + k % 2
    rho = k                                        # P's row ρ is the operand's column k
    assert torch.equal(tok, 16 * ((rho % 8) // 2) + 2 * (rho // 8) + rho % 2)
    assert sorted(coord.tolist()) == list(range(128)) and sorted(tok.tolist()) == list(range(64))
    assert torch.equal(op, codes[tok][:, coord].T)


def _j16(o):
    return _stack(_stack(_j4(*o[0:4]), _j4(*o[4:8])), _stack(_j4(*o[8:12]), _j4(*o[12:16])))


def test_output_unrotation_and_query_rotation_tables():
    """Row ρ of the output accumulator holds coordinate value_row_coord(ρ) of Σ p·ṽ (rotated);
    s[coord]/√128 · (H·acc)[ρ] is the output at that coordinate; and the query operand of
    4-bit keys is q·R[:, σ] (fused_query_ref with keys=1)."""
    from tqattn.kernels import _spec
    codec = TQCodec("tq_k4v3", 128)
    spec = _spec.kernel_spec(codec, 16)
    assert spec.mma and (spec.mma.keys, spec.mma.vals, spec.mma.store) == (1, 1, False)
    tab, sgn, _, vtab, osgn = decode_mma._tables(spec, "cpu")
    r = codec.rotation.float()
    coord = decode_mma.value_row_coord(torch.arange(128))
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
