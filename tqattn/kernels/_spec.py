"""Compile-time description of a codec's paged layout for the Triton kernels (no triton import).

Every packed code field is read as ``G`` words of ``W`` bytes per token (``W = 3`` for 3-bit
fields, whose page holds three byte sub-planes, else 1); a word holds ``CPW = 8W / bits`` codes,
code ``i`` of word ``g`` being coordinate ``start + g·CPW + i``. Kernels build a
``[tokens, GP·CPW]`` tile of codes (``GP`` = G padded to a power of two, at least 16 columns so
that the tile can feed ``tl.dot``) and gather the query / scatter the output through the same
coordinate order, so no shuffling back to natural order is needed inside the loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..quant.codec import TQCodec
from ..quant.paged import column_major, field_words
from ..quant.rotation import is_signed_hadamard


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

    @property
    def dp(self) -> int:
        return self.gp * self.cpw

    def meta(self, prefix: str) -> dict:
        return {f"{prefix}_OFF": self.off, f"{prefix}_BITS": self.bits, f"{prefix}_W": self.w,
                f"{prefix}_G": self.g, f"{prefix}_GP": self.gp, f"{prefix}_CPW": self.cpw,
                f"{prefix}_START": self.start, f"{prefix}_COUNT": self.count,
                f"{prefix}_LUT": self.lut, f"{prefix}_BND": self.bnd, f"{prefix}_CM": self.cm}


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

        def code_field(name, start, centroids=None, boundaries=None):
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
                             column_major(f))

        def scalar_codes(prefix, codes):
            names = ([f"{prefix}_hi"] if codes.n_hi else []) + [prefix]
            starts = [0, codes.n_hi] if codes.n_hi else [0]
            return [code_field(n, s, c, b) for n, s, c, b in
                    zip(names, starts, codes.centroids, codes.boundaries)]

        meta: dict = {"BS": block_size, "D": d}
        if p.key.codec == "fp8":
            fp8_vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
            kf = [code_field("k_fp8", 0, fp8_vals.float())]
            meta.update(K_FP8=True, K_CORR=0, KN_OFF=0)
            self.kfac = 1.0
        else:
            kf = scalar_codes("k_idx", codec.keys)
            meta.update(K_FP8=False, K_CORR=CORR[p.key.correction],
                        KN_OFF=block_size * lay.field("k_norm").offset)
            self.kfac = codec.keys.debias
        n_out = p.key.outliers
        meta.update(K_NOUT=n_out, K_NOUTP=next_pow2(max(n_out, 1)),
                    KOI_OFF=block_size * lay.field("k_out_idx").offset if n_out else 0,
                    KOV_OFF=block_size * lay.field("k_out_val").offset if n_out else 0)
        meta["HAS_K1"] = len(kf) == 2
        meta.update(kf[0].meta("K0"))
        meta.update((kf[1] if len(kf) == 2 else _NO_FIELD).meta("K1"))

        if p.value.codec == "uniform":
            vf = [code_field("v_q", 0)]
            meta.update(V_TQ=False, V_CORR=0, VN_OFF=0, V_LEVELS=2 ** int(p.value.bits) - 1,
                        VS_OFF=block_size * lay.field("v_scale").offset,
                        VZ_OFF=block_size * lay.field("v_zero").offset)
            self.vfac = 1.0
        else:
            vf = scalar_codes("v_idx", codec.values)
            meta.update(V_TQ=True, V_CORR=CORR[p.value.correction], V_LEVELS=0,
                        VN_OFF=block_size * lay.field("v_norm").offset, VS_OFF=0, VZ_OFF=0)
            self.vfac = codec.values.debias
        meta["HAS_V1"] = len(vf) == 2
        meta.update(vf[0].meta("V0"))
        meta.update((vf[1] if len(vf) == 2 else _NO_FIELD).meta("V1"))

        used = max(f.offset + f.nbytes for f in lay.fields.values())
        meta.update(PAD_OFF=block_size * used, PAD_N=lay.slot_bytes - used)
        meta["DP"] = next_pow2(d)
        self.meta = meta
        self.key_fields, self.value_fields = kf, vf
        self.table = torch.cat(tables) if tables else torch.zeros(1)
        self._dev: dict = {}
        self.asm_meta: dict = {}      # decode._asm_meta per "asm on" flag
        self.mma = _mma_layout(self)

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


def _mma_layout(spec: KernelSpec) -> bool:
    """Whether the tensor-core kernel (kernels/decode_mma.py) reads this layout and stores a
    step's new token into it: 3-bit centroid keys (one column-major field of 16 words, folded
    norm, no outliers), 4-bit uniform values of 64 bytes, head size 128, no padding bytes, and a
    rotation diag(s)·H/√128 (every head size 128 rotation of quant/rotation.py)."""
    m, kf, vf = spec.meta, spec.key_fields, spec.value_fields
    return (m["D"] == 128 and len(kf) == 1 and kf[0].cm and kf[0].lut >= 0 and kf[0].g == 16
            and kf[0].bits == 3 and not m["K_FP8"] and m["K_NOUT"] == 0 and m["K_CORR"] == 1
            and not m["V_TQ"] and len(vf) == 1 and vf[0].bits == 4 and vf[0].w == 1
            and vf[0].g == 64 and m["V_LEVELS"] == 15 and m["PAD_N"] == 0
            and is_signed_hadamard(spec.codec.rotation.float().cpu()))


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
