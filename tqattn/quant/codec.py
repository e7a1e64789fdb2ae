"""The TurboQuant KV codec in plain PyTorch: encode K/V into cache slots and decode them back.

This is the reference every Triton kernel is tested against (CPU and CUDA).

Keys ("mse"): n = ‖k‖ (fp32), x̂ = k / (n + 1e-8), y = x̂ @ R, code_i = bucketize(y_i, midpoints),
stored as packed codes + fp16 n. Decoded in the rotated basis as n · ĉ, where ĉ is the centroid
vector after the optional correction: "nc" rescales ĉ to unit norm (vLLM's norm correction),
"debias" multiplies it by 1/(1 − D_b) (the zero-storage inner-product debias). With QJL
(TurboQuant_prod) the mse part uses one bit less and the residual r = x̂ − ĉ @ Rᵀ is stored as
sign(r @ Sᵀ) (S a seeded Gaussian D×D matrix, independent of R) plus fp16 ‖r‖; its estimate is
‖r‖·√(π/2)/D · sign(r Sᵀ) @ S.
Outlier-split mse keys (``outliers`` = m > 0): first the m channels of largest |k| (ties: the
lower channel) are taken out as o = e4m3(k_c) (±448 saturation), stored as (channel byte, e4m3
byte), and k_c is replaced by k_c − o; that vector is then coded as above. Decoded: the above
plus o at each stored channel; scored: ⟨q R, n ĉ⟩ + Σ q_c·o.
Keys ("fp8"): e4m3, unscaled and unrotated (vLLM); values beyond ±448 saturate.
Values ("uniform"): per token and KV head, scale = (max − min)/(2^b − 1) (at least 1e-8),
q = clamp(floor((v − min)/scale + 0.5)), stored with fp16 scale and fp16 min; v̂ = q·scale + min.
Values ("tq"): same as mse keys on v, decoded n · ĉ @ Rᵀ.

Non-finite input: ``on_nonfinite="raise"`` (default) raises ValueError naming how many elements
are bad and where; ``"propagate"`` encodes the vector's fp16 norm/scale as NaN so attention over
that slot yields NaN — what a bf16 cache holding NaN would give, and what the store kernel does
(it cannot raise without a host sync). Garbage is never written as if it were a valid vector.
Norms, value scales and minima are stored in fp16: a finite vector whose norm (or value minimum
or range) passes 65504 is stored as infinite and reads back as non-finite; "raise" refuses it.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace

import torch

from .codebook import get_codebook
from .layout import SlotLayout, build_layout
from .packing import pack_bits, unpack_bits
from .presets import TQPreset, get_preset, split_bits
from .rotation import rotation_matrix

FP8_MAX = 448.0
NORM_EPS = 1e-8
SCALE_MIN = 1e-8
QJL_SEED_OFFSET = 0x5EED_0F_0A  # keeps S independent of the rotation's seed
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# fp16 fields of a slot -> what they hold, for errors
FP16_FIELDS = {"k_norm": "key norm", "k_rnorm": "key residual norm", "v_norm": "value norm",
               "v_scale": "value step (max - min) / levels", "v_zero": "value minimum"}


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).reshape(*x.shape, 1).contiguous().view(torch.uint8)


@contextlib.contextmanager
def full_fp32_matmul():
    """fp32 matmuls inside run at full fp32 precision, whatever the user chose with
    ``torch.set_float32_matmul_precision`` / ``torch.backends.cuda.matmul.allow_tf32`` /
    ``fp32_precision`` (restored on exit). TF32 (or oneDNN bf16 on CPU) would change the rotated
    coordinates by ~1e-3 relative and hence the codes. Host-side flags only: free when nothing
    needs changing, and CUDA-graph capturable."""
    try:
        legacy = torch.get_float32_matmul_precision()
    except RuntimeError:  # the legacy and the new precision API were mixed
        legacy = None
    if legacy == "highest":
        yield
        return
    apis = (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul)
    saved = [api.fp32_precision for api in apis]
    if legacy is not None:
        torch.set_float32_matmul_precision("highest")
    for api in apis:
        api.fp32_precision = "ieee"
    try:
        yield
    finally:
        if legacy is not None:
            torch.set_float32_matmul_precision(legacy)
        for api, prec in zip(apis, saved):
            api.fp32_precision = prec


def dense_outliers(idx_bytes: torch.Tensor, val_bytes: torch.Tensor, d: int) -> torch.Tensor:
    """Outliers stored as (channel byte, e4m3 byte) pairs (..., m) scattered into dense (..., d)
    vectors (0 elsewhere). Channels >= d (bytes never written) add nothing, as in the kernels."""
    idx = idx_bytes.long().clamp(max=d)
    val = val_bytes.contiguous().view(torch.float8_e4m3fn)
    dense = torch.zeros(*idx.shape[:-1], d + 1, device=idx.device)
    return dense.scatter_add_(-1, idx, val.float())[..., :d]


def _read_fp16(slots: torch.Tensor, off: int) -> torch.Tensor:
    # clone, not contiguous(): an already-contiguous slice at an odd offset cannot be viewed as fp16
    return slots[..., off:off + 2].clone(memory_format=torch.contiguous_format).view(torch.float16)[..., 0].float()


def sign_magnitude(idx: torch.Tensor) -> torch.Tensor:
    """4-bit Lloyd–Max codes in bucket order (0 = most negative) ↔ sign-and-magnitude order
    (bit 3 set for the positive half, bits 0-2 the magnitude's rank): the negative half's low
    bits reversed. Its own inverse."""
    return idx ^ torch.where(idx < 8, 7, 0).to(idx.dtype)


class _ScalarCodes:
    """Lloyd–Max codes of a rotated unit vector, possibly at two widths (fractional bits).

    ``sm_order``: 4-bit fields store their codes in :func:`sign_magnitude` order (and
    ``centroids`` lists each code's centroid in that order), so that a decoder takes a code's
    magnitude index with one AND (kernels/_asm.py); other widths keep bucket order."""

    def __init__(self, layout: SlotLayout, prefix: str, bits: float, dim: int, kind: str,
                 correction: str, device, sm_order: bool = False):
        low, n_hi, _ = split_bits(bits, dim)
        self.n_hi = n_hi
        self.fields = ([layout.field(f"{prefix}_hi")] if n_hi else []) + [layout.field(prefix)]
        books = ([get_codebook(dim, low + 1, kind)] if n_hi else []) + [get_codebook(dim, low, kind)]
        self.sm = [sm_order and b.bits == 4 for b in books]
        self.centroids = []
        for b, sm in zip(books, self.sm):
            c = torch.tensor(b.centroids, dtype=torch.float32, device=device)
            self.centroids.append(c[sign_magnitude(torch.arange(16, device=device))] if sm else c)
        self.boundaries = [torch.tensor(b.boundaries, dtype=torch.float32, device=device) for b in books]
        self.correction = correction
        # Debias uses the D_b of the widths in use, weighted by coordinate count.
        d_b = sum(b.mse * n for b, n in zip(books, ([n_hi] if n_hi else []) + [dim - n_hi])) / dim
        self.debias = 1.0 / (1.0 - d_b)

    def _parts(self, y: torch.Tensor) -> list[torch.Tensor]:
        return [y[..., :self.n_hi], y[..., self.n_hi:]] if self.n_hi else [y]

    def encode(self, y: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Write the codes of rotated unit vectors y into slots; return the raw centroid vector."""
        recon = []
        for part, f, bnd, cen, sm in zip(self._parts(y), self.fields, self.boundaries,
                                         self.centroids, self.sm):
            idx = torch.bucketize(part.contiguous(), bnd)
            if sm:
                idx = sign_magnitude(idx)
            slots[..., f.offset:f.offset + f.nbytes] = pack_bits(idx, f.bits)
            recon.append(cen[idx])
        return torch.cat(recon, -1)

    def centroid_vectors(self, slots: torch.Tensor, *, corrected: bool = True) -> torch.Tensor:
        c = torch.cat([cen[unpack_bits(slots[..., f.offset:f.offset + f.nbytes], f.bits, f.count)]
                       for f, cen in zip(self.fields, self.centroids)], -1)
        if not corrected or self.correction == "none":
            return c
        if self.correction == "nc":
            return c / c.norm(dim=-1, keepdim=True)
        return c * self.debias


class TQCodec:
    """Encoder/decoder for one (preset, head size); holds the rotation and codebooks."""

    def __init__(self, preset: str | TQPreset, head_dim: int, *, device=None, seed: int = 0):
        # normal tensors even when built under torch.inference_mode(): a cached codec is used
        # later where autograd records (a transformers forward with gradients on)
        with torch.inference_mode(False):
            self._build(preset, head_dim, device, seed)

    def _build(self, preset, head_dim: int, device, seed: int) -> None:
        self.preset = get_preset(preset)
        self.layout = build_layout(self.preset, head_dim)
        self.head_dim = head_dim
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.seed = seed
        p, d = self.preset, head_dim
        self.rotation = rotation_matrix(d, signs=p.rotation_signs, seed=seed, device=self.device)
        self.keys = None
        if p.key.codec == "mse":
            self.keys = _ScalarCodes(self.layout, "k_idx", p.key.mse_bits, d, p.codebook,
                                     p.key.correction, self.device, not p.vllm)
        self.values = None
        if p.value.codec == "tq":
            self.values = _ScalarCodes(self.layout, "v_idx", p.value.bits, d, p.codebook,
                                       p.value.correction, self.device, not p.vllm)
        self._folded = None
        self.qjl_matrix = None
        if p.key.qjl:
            gen = torch.Generator().manual_seed(seed + QJL_SEED_OFFSET)
            self.qjl_matrix = torch.randn(d, d, generator=gen).to(self.device)

    @property
    def slot_bytes(self) -> int:
        return self.layout.slot_bytes

    # ---- validation ------------------------------------------------------------------------------

    def _check(self, x: torch.Tensor, what: str, on_nonfinite: str) -> None:
        if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES:
            got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"{what} must be a float16/bfloat16/float32 tensor, got {got}")
        if x.shape[-1:] != (self.head_dim,):
            raise ValueError(f"{what} last dimension is {tuple(x.shape)[-1:]}, expected head size "
                             f"{self.head_dim} for preset {self.preset.name}")
        if on_nonfinite not in ("raise", "propagate"):
            raise ValueError(f"on_nonfinite={on_nonfinite!r}; valid: 'raise', 'propagate'")
        if on_nonfinite == "raise":
            bad = ~torch.isfinite(x)
            if bool(bad.any()):
                where = bad.nonzero()[0].tolist()
                raise ValueError(f"{what} holds {int(bad.sum())} non-finite element(s) (first at "
                                 f"index {where}); refusing to write them into the cache "
                                 f"(pass on_nonfinite='propagate' to store NaN markers instead)")

    # ---- encode ----------------------------------------------------------------------------------

    def encode(self, k: torch.Tensor, v: torch.Tensor, *, on_nonfinite: str = "raise",
               fold_nc: bool = False) -> torch.Tensor:
        """K, V (..., D) → uint8 slots (..., slot_bytes).

        ``fold_nc``: store ``n / ‖ĉ‖`` as the norm of "nc" fields (the paged cache's form, read
        back by :meth:`folded`); the default stores ``n`` as vLLM does."""
        self._check(k, "key", on_nonfinite)
        self._check(v, "value", on_nonfinite)
        if k.shape != v.shape:
            raise ValueError(f"key shape {tuple(k.shape)} != value shape {tuple(v.shape)}")
        slots = torch.zeros(*k.shape[:-1], self.slot_bytes, dtype=torch.uint8, device=k.device)
        self._encode_keys(k.float(), slots, fold_nc)
        self._encode_values(v.float(), slots, fold_nc)
        if on_nonfinite == "raise":
            self._check_fp16_range(slots)
        return slots

    def _check_fp16_range(self, slots: torch.Tensor) -> None:
        # the inputs were finite, so a non-finite fp16 field is a value past float16's range
        for name, what in FP16_FIELDS.items():
            if not self.layout.has(name):
                continue
            bad = ~torch.isfinite(_read_fp16(slots, self.layout.field(name).offset))
            if bool(bad.any()):
                where = bad.nonzero()[0].tolist()
                raise ValueError(f"the {what} of {int(bad.sum())} vector(s) (first at index {where}) "
                                 f"exceeds 65504, the largest float16, which the cache stores it in")

    def folded(self) -> "TQCodec":
        """The codec that reads slots written with ``fold_nc=True``: "nc" corrections become
        "none" (the stored norm already holds ``n / ‖ĉ‖``); rotation and codebooks are shared."""
        p = self.preset
        if "nc" not in (p.key.correction, p.value.correction):
            return self
        if self._folded is None:
            key = replace(p.key, correction="none") if p.key.correction == "nc" else p.key
            val = replace(p.value, correction="none") if p.value.correction == "nc" else p.value
            self._folded = TQCodec(replace(p, name=f"{p.name}+folded", key=key, value=val),
                                   self.head_dim, device=self.device, seed=self.seed)
        return self._folded

    def _put_fp16(self, slots, name, x):
        f = self.layout.field(name)
        slots[..., f.offset:f.offset + 2] = _fp16_bytes(x)

    def _encode_unit(self, x: torch.Tensor, codes: _ScalarCodes, slots, norm_field: str,
                     fold: bool):
        bad = ~torch.isfinite(x).all(-1)
        x = torch.where(bad[..., None], torch.zeros_like(x), x)
        n = x.norm(dim=-1)
        unit = x / (n[..., None] + NORM_EPS)
        with full_fp32_matmul():
            y = unit @ self.rotation
        c = codes.encode(y, slots)
        if fold and codes.correction == "nc":
            # fp64: Σĉ² of fp32 centroids is exact up to the last bits, so the store kernel's
            # fp16 result matches whatever its summation order
            store = (n.double() / c.double().square().sum(-1).sqrt()).float()
        else:
            store = n
        self._put_fp16(slots, norm_field, torch.where(bad, torch.full_like(n, math.nan), store))
        return unit, c

    def _encode_keys(self, k: torch.Tensor, slots: torch.Tensor, fold: bool) -> None:
        if self.preset.key.codec == "fp8":
            f = self.layout.field("k_fp8")
            k = torch.where(torch.isfinite(k), k.clamp(-FP8_MAX, FP8_MAX), math.nan)
            k8 = k.to(torch.float8_e4m3fn)
            slots[..., f.offset:f.offset + f.nbytes] = k8.view(torch.uint8)
            return
        if self.preset.key.outliers:
            k = self._split_outliers(k, slots)
        unit, c = self._encode_unit(k, self.keys, slots, "k_norm", fold)
        if self.qjl_matrix is not None:
            r = unit - c @ self.rotation.T
            f = self.layout.field("k_qjl")
            slots[..., f.offset:f.offset + f.nbytes] = pack_bits((r @ self.qjl_matrix.T >= 0).to(torch.uint8), 1)
            self._put_fp16(slots, "k_rnorm", r.norm(dim=-1))

    def _split_outliers(self, k: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Store the outlier channels of k; return k with them replaced by their e4m3 residual
        (non-finite vectors stay non-finite: their norm becomes the NaN marker)."""
        bad = ~torch.isfinite(k).all(-1, keepdim=True)
        kz = torch.where(bad, torch.zeros_like(k), k)
        m = self.preset.key.outliers
        # stable descending sort: equal magnitudes keep the lower channel first (as the kernel)
        idx = torch.sort(kz.abs(), dim=-1, descending=True, stable=True).indices[..., :m]
        o8 = kz.gather(-1, idx).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        for name, x in (("k_out_idx", idx.to(torch.uint8)), ("k_out_val", o8.view(torch.uint8))):
            f = self.layout.field(name)
            slots[..., f.offset:f.offset + f.nbytes] = x
        rest = kz.scatter_add(-1, idx, -o8.float())
        return torch.where(bad, k, rest)

    def outlier_keys(self, slots: torch.Tensor) -> torch.Tensor:
        """The stored outliers scattered into dense (..., D) vectors (0 elsewhere). Bytes of
        slots never written may name channels >= D: those add nothing (as in the kernels)."""
        fi, fv = self.layout.field("k_out_idx"), self.layout.field("k_out_val")
        return dense_outliers(slots[..., fi.offset:fi.offset + fi.nbytes],
                              slots[..., fv.offset:fv.offset + fv.nbytes], self.head_dim)

    def _encode_values(self, v: torch.Tensor, slots: torch.Tensor, fold: bool) -> None:
        if self.values is not None:
            self._encode_unit(v, self.values, slots, "v_norm", fold)
            return
        levels = 2 ** int(self.preset.value.bits) - 1
        bad = ~torch.isfinite(v).all(-1)
        v = torch.where(bad[..., None], torch.zeros_like(v), v)
        vmin, vmax = v.amin(-1), v.amax(-1)
        scale = ((vmax - vmin) / levels).clamp_min(SCALE_MIN)
        q = torch.floor((v - vmin[..., None]) / scale[..., None] + 0.5).clamp(0, levels)
        f = self.layout.field("v_q")
        slots[..., f.offset:f.offset + f.nbytes] = pack_bits(q.to(torch.int32), f.bits)
        self._put_fp16(slots, "v_scale", torch.where(bad, torch.full_like(scale, math.nan), scale))
        self._put_fp16(slots, "v_zero", vmin)

    # ---- decode ----------------------------------------------------------------------------------

    def _check_slots(self, slots: torch.Tensor) -> None:
        if slots.dtype != torch.uint8 or slots.shape[-1] != self.slot_bytes:
            raise ValueError(f"slots must be uint8 (..., {self.slot_bytes}) for preset "
                             f"{self.preset.name} at head size {self.head_dim}, got "
                             f"{slots.dtype} {tuple(slots.shape)}")

    def key_norms(self, slots: torch.Tensor) -> torch.Tensor:
        return _read_fp16(slots, self.layout.field("k_norm").offset)

    def rotated_keys(self, slots: torch.Tensor) -> torch.Tensor:
        """mse keys in the rotated basis, n · ĉ (corrected); QJL term excluded."""
        return self.key_norms(slots)[..., None] * self.keys.centroid_vectors(slots)

    def qjl_parts(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(±1 signs (..., D), coefficient n·‖r‖·√(π/2)/D (...)) of the QJL residual."""
        f = self.layout.field("k_qjl")
        signs = unpack_bits(slots[..., f.offset:f.offset + f.nbytes], 1, f.count).float() * 2 - 1
        coef = (self.key_norms(slots) * _read_fp16(slots, self.layout.field("k_rnorm").offset)
                * math.sqrt(math.pi / 2) / self.head_dim)
        return signs, coef

    def decode_keys(self, slots: torch.Tensor) -> torch.Tensor:
        self._check_slots(slots)
        if self.preset.key.codec == "fp8":
            f = self.layout.field("k_fp8")
            return slots[..., f.offset:f.offset + f.nbytes].contiguous().view(torch.float8_e4m3fn).float()
        k = self.rotated_keys(slots) @ self.rotation.T
        if self.preset.key.outliers:
            k = k + self.outlier_keys(slots)
        if self.qjl_matrix is not None:
            signs, coef = self.qjl_parts(slots)
            k = k + coef[..., None] * (signs @ self.qjl_matrix)
        return k

    def rotated_values(self, slots: torch.Tensor) -> torch.Tensor:
        """tq values in the rotated basis, n · ĉ (corrected)."""
        n = _read_fp16(slots, self.layout.field("v_norm").offset)
        return n[..., None] * self.values.centroid_vectors(slots)

    def decode_values(self, slots: torch.Tensor) -> torch.Tensor:
        self._check_slots(slots)
        if self.values is not None:
            return self.rotated_values(slots) @ self.rotation.T
        f = self.layout.field("v_q")
        q = unpack_bits(slots[..., f.offset:f.offset + f.nbytes], f.bits, f.count).float()
        scale = _read_fp16(slots, self.layout.field("v_scale").offset)
        zero = _read_fp16(slots, self.layout.field("v_zero").offset)
        return q * scale[..., None] + zero[..., None]

    def decode(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots → (K̂, V̂) float32 in the original basis."""
        return self.decode_keys(slots), self.decode_values(slots)
