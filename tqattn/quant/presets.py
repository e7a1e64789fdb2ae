"""Named KV-cache quantization presets (the values of ``kv_cache_dtype``).

The four ``turboquant_*`` names reproduce vLLM's math and bytes exactly: plain Sylvester
Hadamard (no random signs), vLLM's Gaussian Lloyd–Max recipe, unrotated uniform values with an
fp16 scale and minimum, and norm correction on MSE keys.

The ``tq_*`` presets are this project's: seeded randomized Hadamard, exact-law codebooks and
TurboQuant-style rotated values (Lloyd–Max codes + one fp16 norm, which costs 2 bytes less per
slot than a scale and a minimum). Fractional widths (``k3.5``) are the paper's 2.5/3.5-bit
splits: after the rotation every coordinate has the same law, so the first ``round(f·D)``
rotated coordinates get one more bit — no per-token outlier bookkeeping. Variants kept for A/B
measurement (QJL residual, 1/(1−D_b) debias, uniform values) are marked ``experimental``.

Outlier-split keys (``o4`` in a name): before the rotation, the ``n`` largest-|k| channels of each
key are stored apart as (channel byte, e4m3 value) and replaced by what e4m3 missed (k − fp8(k)),
so the rotated vector no longer carries their energy; a key decodes to the TurboQuant part plus
the scattered outliers. Data-oblivious (per vector, no calibration); one byte-pair per outlier.
Which preset we recommend, and why, is decided by the measurements in the README.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KEY_CODECS = ("mse", "fp8")
VALUE_CODECS = ("uniform", "tq")
CORRECTIONS = ("none", "nc", "debias")
MAX_OUTLIERS = 16
MAX_OUTLIER_HEAD_DIM = 256  # an outlier's channel index is one byte


@dataclass(frozen=True)
class KeySpec:
    codec: str                 # "mse" (rotation + Lloyd–Max + fp16 norm) or "fp8" (e4m3, unscaled)
    bits: float = 8            # mse: 1..4, may be fractional (mixed widths after rotation)
    correction: str = "none"   # "nc": renormalise the centroid vector; "debias": × 1/(1−D_b)
    qjl: bool = False          # TurboQuant_prod: mse at bits−1 + 1-bit QJL residual + its fp16 norm
    outliers: int = 0          # mse: the n largest-|k| channels of each vector kept apart (below)

    @property
    def mse_bits(self) -> float:
        return self.bits - 1 if self.qjl else self.bits


@dataclass(frozen=True)
class ValueSpec:
    codec: str                 # "uniform" (fp16 scale + min, unrotated) or "tq" (rotated Lloyd–Max)
    bits: float = 4
    correction: str = "none"   # tq values only


@dataclass(frozen=True)
class TQPreset:
    name: str
    key: KeySpec
    value: ValueSpec
    rotation_signs: bool       # randomized Hadamard (True) or plain Sylvester Hadamard (vLLM)
    codebook: str              # "exact" or "gaussian" (vLLM's recipe)
    vllm: bool = False         # reproduces a vLLM preset bit for bit
    experimental: bool = False
    description: str = ""

    def __post_init__(self):
        _validate(self)

    def head_dim_unsupported_reason(self, head_dim) -> str | None:
        """Why this preset cannot encode vectors of ``head_dim`` coordinates (None: it can)."""
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 8 or head_dim % 2:
            return f"head size {head_dim!r} not supported: need an even integer >= 8 (a Python int)"
        if self.key.outliers >= head_dim:
            return (f"preset {self.name} keeps {self.key.outliers} outlier channels apart, so head "
                    f"size {head_dim} needs to be larger")
        if self.key.outliers and head_dim > MAX_OUTLIER_HEAD_DIM:
            return (f"preset {self.name} stores each outlier channel index in one byte, so head "
                    f"size {head_dim} > {MAX_OUTLIER_HEAD_DIM} is not supported")
        return None

    def supports_head_dim(self, head_dim) -> bool:
        return self.head_dim_unsupported_reason(head_dim) is None

    def check_head_dim(self, head_dim) -> None:
        """Raise ValueError naming the head size and the rule it breaks."""
        reason = self.head_dim_unsupported_reason(head_dim)
        if reason is not None:
            raise ValueError(reason)


def split_bits(bits: float, dim: int) -> tuple[int, int, int]:
    """Fractional width → (low bits, number of coordinates at low+1 bits, low-bit coordinates)."""
    low = math.floor(bits)
    n_hi = round((bits - low) * dim)
    return low, n_hi, dim - n_hi


def _validate(p: TQPreset) -> None:
    k, v = p.key, p.value
    if k.codec not in KEY_CODECS:
        raise ValueError(f"preset {p.name}: key codec {k.codec!r} not in {KEY_CODECS}")
    if v.codec not in VALUE_CODECS:
        raise ValueError(f"preset {p.name}: value codec {v.codec!r} not in {VALUE_CODECS}")
    if k.codec == "fp8" and (k.bits != 8 or k.qjl or k.correction != "none"):
        raise ValueError(f"preset {p.name}: fp8 keys take no bits/qjl/correction options")
    if k.codec == "mse":
        if not 1 <= k.mse_bits <= 4:
            raise ValueError(f"preset {p.name}: key mse bits {k.mse_bits} not in 1..4")
        if k.qjl and (k.bits != int(k.bits) or k.correction != "none"):
            raise ValueError(f"preset {p.name}: QJL needs integer bits and no correction")
        if not 0 <= k.outliers <= MAX_OUTLIERS or (k.outliers and k.qjl):
            raise ValueError(f"preset {p.name}: key outliers {k.outliers} not in "
                             f"0..{MAX_OUTLIERS} (and not with QJL)")
    elif k.outliers:
        raise ValueError(f"preset {p.name}: key outliers need mse keys")
    if k.correction not in CORRECTIONS or v.correction not in CORRECTIONS:
        raise ValueError(f"preset {p.name}: correction must be one of {CORRECTIONS}")
    if v.codec == "uniform" and (v.bits not in (1, 2, 3, 4, 8) or v.correction != "none"):
        raise ValueError(f"preset {p.name}: uniform values take integer bits in 1,2,3,4,8")
    if v.codec == "tq" and not 1 <= v.bits <= 4:
        raise ValueError(f"preset {p.name}: tq value bits {v.bits} not in 1..4")
    if p.codebook not in ("exact", "gaussian"):
        raise ValueError(f"preset {p.name}: codebook {p.codebook!r} not in ('exact', 'gaussian')")


def _vllm(name, key, value, desc):
    return TQPreset(name, key, value, rotation_signs=False, codebook="gaussian", vllm=True,
                    description=desc)


def _ours(name, kbits, vbits, desc, *, kcorr="nc", vcodec="tq", vcorr="nc", qjl=False,
          outliers=0, experimental=False):
    return TQPreset(name, KeySpec("mse", kbits, kcorr, qjl, outliers),
                    ValueSpec(vcodec, vbits, vcorr if vcodec == "tq" else "none"),
                    rotation_signs=True, codebook="exact", experimental=experimental,
                    description=desc)


_PRESETS = [
    _vllm("turboquant_k8v4", KeySpec("fp8"), ValueSpec("uniform", 4),
          "vLLM: fp8 e4m3 keys, 4-bit uniform values"),
    _vllm("turboquant_4bit_nc", KeySpec("mse", 4, "nc"), ValueSpec("uniform", 4),
          "vLLM: 4-bit Lloyd–Max keys with norm correction, 4-bit uniform values"),
    _vllm("turboquant_k3v4_nc", KeySpec("mse", 3, "nc"), ValueSpec("uniform", 4),
          "vLLM: 3-bit Lloyd–Max keys with norm correction, 4-bit uniform values"),
    _vllm("turboquant_3bit_nc", KeySpec("mse", 3, "nc"), ValueSpec("uniform", 3),
          "vLLM: 3-bit Lloyd–Max keys with norm correction, 3-bit uniform values"),
    _ours("tq_k4v4", 4, 4, "4-bit keys and rotated 4-bit values"),
    _ours("tq_k4v3", 4, 3, "4-bit keys, rotated 3-bit values"),
    _ours("tq_k3.5v3.5", 3.5, 3.5, "paper's 3.5-bit split for keys and values"),
    _ours("tq_k3.5v3", 3.5, 3, "3.5-bit keys, rotated 3-bit values"),
    _ours("tq_k3o4v3.5", 3, 3.5, "3-bit keys + 4 outlier channels per key, 3.5-bit values",
          outliers=4),
    _ours("tq_k3v4", 3, 4, "3-bit keys, rotated 4-bit values"),
    _ours("tq_k3v3", 3, 3, "3-bit keys and rotated 3-bit values"),
    _ours("tq_k4v2", 4, 2, "4-bit keys, rotated 2-bit values"),
    _ours("tq_k3v2", 3, 2, "3-bit keys, rotated 2-bit values"),
    _ours("tq_k2.5v2.5", 2.5, 2.5, "paper's 2.5-bit split for keys and values"),
    # A/B variants of the key correction and of the value codec, for measurement.
    _ours("tq_k3v4_raw", 3, 4, "3-bit keys without any correction", kcorr="none",
          experimental=True),
    _ours("tq_k3v4_debias", 3, 4, "3-bit keys scaled by 1/(1−D_3)", kcorr="debias",
          experimental=True),
    _ours("tq_k4v4_qjl", 4, 4, "TurboQuant_prod keys: 3-bit mse + 1-bit QJL residual",
          kcorr="none", qjl=True, experimental=True),
    _ours("tq_k3v4_qjl", 3, 4, "TurboQuant_prod keys: 2-bit mse + 1-bit QJL residual",
          kcorr="none", qjl=True, experimental=True),
    _ours("tq_k3v4u", 3, 4, "3-bit keys, vLLM-style uniform 4-bit values", vcodec="uniform",
          experimental=True),
]
PRESETS: dict[str, TQPreset] = {p.name: p for p in _PRESETS}


def preset_names() -> list[str]:
    return list(PRESETS)


def get_preset(name: str | TQPreset) -> TQPreset:
    if isinstance(name, TQPreset):
        return name
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown KV-cache preset {name!r}; valid names: "
                         f"{', '.join(PRESETS)}") from None


def is_quantized_kv_dtype(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype in PRESETS
