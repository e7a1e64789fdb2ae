"""Compile-time description of a codec's paged layout for the Triton kernels (no triton import).

Every packed code field is read as ``G`` words of ``W`` bytes per token (``W = 3`` for 3-bit
fields, whose page holds three byte sub-planes, else 1); a word holds ``CPW = 8W / bits`` codes,
code ``i`` of word ``g`` being coordinate ``start + g·CPW + i``. Kernels build a
``[tokens, GP·CPW]`` tile of codes (``GP`` = G padded to a power of two, at least 16 columns so
that the tile can feed ``tl.dot``) and gather the query / scatter the output through the same
coordinate order, so no shuffling back to natural order is needed inside the loop.

The kernels take this description as five constexpr arguments (``KernelSpec.constexprs``): ``L``
(:class:`PageLayout`, the page's scalar offsets and flags) and the fields ``K0``, ``K1``, ``V0``,
``V1`` (:class:`CodeField`; fractional widths split keys / values over two fields, ``K1`` / ``V1``
unused otherwise). Triton passes a frozen dataclass as a constexpr and reads its attributes at
compile time; the kernels compile to the same code as with one constexpr per value. Its helpers
take the values they use (a dataclass read from another one's attribute is not a constexpr
argument under the compiler), so the aggregates stop at the kernels and their tile loaders.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..quant.codec import TQCodec
from ..quant.paged import column_major, field_words
from ..quant.rotation import is_signed_hadamard


# head sizes the tensor-core decode kernel runs (kernels/decode_mma.py)
MMA_HEAD_SIZES = (64, 128, 256)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class CodeField:
    off: int      # plane offset inside the page
    bits: int
    w: int
    g: int
    gp: int
    cpw: int
    start: int    # first coordinate
    count: int
    lut: int      # offset of its fp32 centroid table in the shared table (-1: none)
    bnd: int      # offset of its boundaries (store)
    cm: bool      # column-major plane: byte g of token t at g·block_size + t (else t·G + g)
    sm: bool = False  # 4-bit codes in sign-and-magnitude order (tqattn.quant.codec.sign_magnitude)

    @property
    def dp(self) -> int:
        return self.gp * self.cpw



@dataclass(frozen=True)
class PageLayout:
    """The page's scalars (offsets are of the plane inside a block's page, in bytes)."""
    bs: int          # block size (tokens per page)
    d: int           # head size
    dp: int          # head size padded to a power of two
    k_fp8: bool      # fp8 keys (one byte per coordinate, no norm)
    k_corr: int      # CORR of the keys' correction
    kn_off: int      # key norms (fp16)
    k_nout: int      # outlier channels per key (0: none)
    k_noutp: int     # k_nout padded to a power of two
    koi_off: int     # outlier channel bytes
    kov_off: int     # outlier e4m3 values
    has_k1: bool     # keys in two fields
    v_tq: bool       # rotated (TurboQuant) values, else uniform
    v_corr: int
    v_levels: int    # uniform values: 2^bits − 1
    vn_off: int      # rotated values' norms
    vs_off: int      # uniform values' scales / zero points (fp16)
    vz_off: int
    has_v1: bool
    pad_off: int     # padding bytes of a slot (zeroed by the store)
    pad_n: int


_NO_FIELD = CodeField(0, 8, 1, 16, 16, 1, 0, 0, 0, 0, False)
CORR = {"none": 0, "nc": 1, "debias": 2}


class KernelSpec:
    """Constexpr arguments + lookup tables of one (codec, block size)."""

    def __init__(self, codec: TQCodec, block_size: int):
        p, lay, d = codec.preset, codec.layout, codec.head_dim
        if block_size < 16 or block_size & (block_size - 1):
            raise NotImplementedError(f"Triton kernels need a power-of-two block size >= 16, "
                                      f"got {block_size}")
        if p.key.qjl:
            raise NotImplementedError(f"preset {p.name}: the QJL residual has no Triton kernel "
                                      f"(use the PyTorch reference)")
        self.codec, self.block_size = codec, block_size
        tables: list[torch.Tensor] = []

        def table(x: torch.Tensor) -> int:
            off = sum(t.numel() for t in tables)
            tables.append(x.float().cpu().flatten())
            return off

        def code_field(name, start, centroids=None, boundaries=None, sm=False):
            f = lay.field(name)
            w = field_words(f)
            if f.nbytes * 8 != f.count * f.bits or (f.bits == 3 and w != 3):
                raise NotImplementedError(f"preset {p.name} at head size {d}: field {name} "
                                          f"({f.count} codes of {f.bits} bits) does not fill whole "
                                          f"words; no Triton kernel for it")
            g = f.nbytes // w
            cpw = 8 * w // f.bits
            gp = max(next_pow2(g), 16)  # each code of a word feeds its own tl.dot (K >= 16)
            lut = table(centroids) if centroids is not None else -1
            bnd = table(boundaries) if boundaries is not None else -1
            return CodeField(block_size * f.offset, f.bits, w, g, gp, cpw, start, f.count, lut, bnd,
                             column_major(f), sm)

        def scalar_codes(prefix, codes):
            names = ([f"{prefix}_hi"] if codes.n_hi else []) + [prefix]
            starts = [0, codes.n_hi] if codes.n_hi else [0]
            return [code_field(n, s, c, b, sm) for n, s, c, b, sm in
                    zip(names, starts, codes.centroids, codes.boundaries, codes.sm)]

        m: dict = {"bs": block_size, "d": d, "dp": next_pow2(d)}
        if p.key.codec == "fp8":
            fp8_vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
            kf = [code_field("k_fp8", 0, fp8_vals.float())]
            m.update(k_fp8=True, k_corr=0, kn_off=0)
            self.kfac = 1.0
        else:
            kf = scalar_codes("k_idx", codec.keys)
            m.update(k_fp8=False, k_corr=CORR[p.key.correction],
                     kn_off=block_size * lay.field("k_norm").offset)
            self.kfac = codec.keys.debias
        n_out = p.key.outliers
        m.update(k_nout=n_out, k_noutp=next_pow2(max(n_out, 1)),
                 koi_off=block_size * lay.field("k_out_idx").offset if n_out else 0,
                 kov_off=block_size * lay.field("k_out_val").offset if n_out else 0,
                 has_k1=len(kf) == 2)

        if p.value.codec == "uniform":
            vf = [code_field("v_q", 0)]
            m.update(v_tq=False, v_corr=0, vn_off=0, v_levels=2 ** int(p.value.bits) - 1,
                     vs_off=block_size * lay.field("v_scale").offset,
                     vz_off=block_size * lay.field("v_zero").offset)
            self.vfac = 1.0
        else:
            vf = scalar_codes("v_idx", codec.values)
            m.update(v_tq=True, v_corr=CORR[p.value.correction], v_levels=0,
                     vn_off=block_size * lay.field("v_norm").offset, vs_off=0, vz_off=0)
            self.vfac = codec.values.debias
        used = max(f.offset + f.nbytes for f in lay.fields.values())
        m.update(has_v1=len(vf) == 2, pad_off=block_size * used, pad_n=lay.slot_bytes - used)
        self.layout = PageLayout(**m)
        self.key_fields, self.value_fields = kf, vf
        # the kernels' constexpr arguments (module docstring)
        self.constexprs = {"L": self.layout, "K0": kf[0], "V0": vf[0],
                           "K1": kf[1] if len(kf) == 2 else _NO_FIELD,
                           "V1": vf[1] if len(vf) == 2 else _NO_FIELD}
        self.table = torch.cat(tables) if tables else torch.zeros(1)
        self._dev: dict = {}
        self.asm_meta: dict = {}      # decode._asm_meta per "asm on" flag
        self.mma = mma_layout(self)

    def tables_on(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(lookup/boundary table fp32, rotation fp32) on device, cached."""
        key = str(device)
        if key not in self._dev:
            self._dev[key] = (self.table.to(device), self.codec.rotation.to(device).contiguous())
        return self._dev[key]


_SPECS: dict = {}


def kernel_spec(codec: TQCodec, block_size: int) -> KernelSpec:
    key = (codec.preset, codec.head_dim, codec.seed, block_size)
    spec = _SPECS.get(key)
    if spec is None:
        spec = _SPECS[key] = KernelSpec(codec, block_size)
    return spec


@dataclass(frozen=True)
class MmaFormat:
    """How the tensor-core decode kernel (kernels/decode_mma.py) reads a layout."""
    keys: int     # 0: 3-bit centroid keys, column-major planes; 1: 4-bit codes of a symmetric
                  # codebook in token rows; 2: fp8 (e4m3) keys in token rows, unrotated
    vals: int     # 0: 4-bit uniform values in token rows; 1: 3-bit rotated values, column-major;
                  # 2: 3-bit uniform values, column-major; 3: 4-bit rotated values of a
                  # symmetric codebook in token rows
    store: bool   # the kernel encodes a decode step's new token itself (rotated keys, no padding)

    @property
    def token_map(self) -> int:
        """The score rows' token order, which the values' format fixes: 0 for row token
        values, 1 for column-major ones (kernels/decode_mma.py, MAP)."""
        return int(self.vals in (1, 2))

    @property
    def rotated_values(self) -> bool:
        return self.vals in (1, 3)


def mma_layout(spec: KernelSpec) -> MmaFormat | None:
    """How the tensor-core kernel reads this layout, or None where it cannot: head size 64, 128
    or 256, one key and one value field, no outliers, stored norms plain or "nc"-folded, a rotation
    diag(s)·H/√d where keys or values are rotated (every power-of-two head size rotation of
    quant/rotation.py), keys of 3-bit centroid codes in column-major planes or 4-bit codes of a
    symmetric codebook in token rows, values 4-bit (uniform, or rotated of a symmetric codebook)
    in token rows, or 3-bit (rotated or uniform) in column-major planes — ``turboquant_k3v4_nc``,
    ``turboquant_4bit_nc``, ``turboquant_3bit_nc``, ``tq_k4v3``, ``tq_k3v3``, ``tq_k4v4``,
    ``tq_k3v4`` — and, at head size 128, fp8 keys (unrotated, no rotation needed) with 4-bit
    uniform values: ``turboquant_k8v4``. The kernel stores a decode step's new token itself at
    head sizes 128 and 256 (rotated keys, no padding)."""
    m, kf, vf = spec.layout, spec.key_fields, spec.value_fields
    d = m.d
    if d not in MMA_HEAD_SIZES or len(kf) != 1 or len(vf) != 1 or m.k_nout:
        return None
    k, v = kf[0], vf[0]
    hadamard = is_signed_hadamard(spec.codec.rotation.float().cpu())
    if m.k_fp8 and not k.cm and k.g == 128 and d == 128:
        keys = 2
    elif not hadamard or m.k_fp8:
        return None
    elif k.cm and k.lut >= 0 and k.g == d // 8 and k.bits == 3 and m.k_corr == 1:
        keys = 0
    elif (not k.cm and k.lut >= 0 and k.bits == 4 and k.w == 1 and k.g == d // 2
          and m.k_corr in (0, 1) and _symmetric(spec.table[k.lut:k.lut + 16], k.sm)):
        keys = 1
    else:
        return None
    if not m.v_tq and v.bits == 4 and v.w == 1 and v.g == d // 2 and m.v_levels == 15:
        vals = 0
    elif (m.v_tq and v.cm and v.bits == 3 and v.g == d // 8 and v.lut >= 0 and m.v_corr in (0, 1)
          and hadamard):
        vals = 1
    elif not m.v_tq and v.cm and v.bits == 3 and v.g == d // 8 and m.v_levels == 7:
        vals = 2
    elif (m.v_tq and not v.cm and v.bits == 4 and v.w == 1 and v.g == d // 2 and v.lut >= 0
          and m.v_corr in (0, 1) and hadamard and v.sm
          and _symmetric(spec.table[v.lut:v.lut + 16], v.sm)):
        vals = 3
    else:
        return None
    if keys == 2 and vals != 0:  # fp8 keys load in the row values' token order only
        return None
    return MmaFormat(keys, vals, store=keys != 2 and m.pad_n == 0 and d in (128, 256))


def _symmetric(centroids: torch.Tensor, sm: bool = False) -> bool:
    """In fp16, c[8..15] >= 0 and the other half their negatives — c[15 - i] = -c[i] in bucket
    order, c[i] = -c[8 + i] in sign-and-magnitude order (sm): the lookup of 4-bit codes by
    magnitude and sign (kernels/_asm.py)."""
    h = centroids.half()
    neg = h[:8] if sm else h[:8].flip(0)
    return bool(torch.equal(neg, -h[8:]) and (h[8:] >= 0).all())


def interpreted(device) -> bool:
    """Whether kernels on this device run under triton's interpreter (CPU tensors: the inline
    asm, native fp8 conversions and TF32 dots exist only in compiled kernels)."""
    return torch.device(device).type != "cuda"


def num_sms(device) -> int:
    """Streaming multiprocessors of a CUDA device (4 stand-ins elsewhere: the interpreter)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def default_scale(codec: TQCodec, scale: float | None) -> float:
    return 1.0 / math.sqrt(codec.head_dim) if scale is None else float(scale)
