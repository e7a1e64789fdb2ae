"""Byte layout of one cache slot: everything stored for one (token, KV head).

A slot is ``[key fields | value fields | pad to an even size]``; within each part the packed
codes come first and the fp16 metadata after them (vLLM's order). fp16 fields are read and
written as two little-endian bytes, so no field needs alignment.

    mse key   k_idx_hi? k_idx  (k_out_idx[n] k_out_val[n])  k_norm[2]  (k_qjl k_rnorm[2] with QJL)
    fp8 key   k_fp8[D]
    uniform v v_q  v_scale[2] v_zero[2]
    tq value  v_idx_hi? v_idx  v_norm[2]
"""

from __future__ import annotations

from dataclasses import dataclass

from .packing import packed_nbytes
from .presets import TQPreset, get_preset, split_bits


@dataclass(frozen=True)
class Field:
    name: str
    offset: int
    nbytes: int
    bits: int = 8        # code width for packed fields
    count: int = 0       # number of codes for packed fields


@dataclass(frozen=True)
class SlotLayout:
    preset: TQPreset
    head_dim: int
    fields: dict[str, Field]
    key_bytes: int
    value_bytes: int
    slot_bytes: int

    def field(self, name: str) -> Field:
        return self.fields[name]

    def has(self, name: str) -> bool:
        return name in self.fields

    @property
    def bits_per_element(self) -> float:
        """Stored bits (codes + norms/scales + slot padding) per K or V element."""
        return self.slot_bytes * 8 / (2 * self.head_dim)

    @property
    def compression_vs_bf16(self) -> float:
        return 4 * self.head_dim / self.slot_bytes


def _codes(prefix: str, bits: float, dim: int) -> list[tuple[str, int, int]]:
    low, n_hi, n_lo = split_bits(bits, dim)
    out = []
    if n_hi:
        out.append((f"{prefix}_hi", low + 1, n_hi))
    out.append((prefix, low, n_lo))
    return out


def build_layout(preset: str | TQPreset, head_dim: int) -> SlotLayout:
    p = get_preset(preset)
    p.check_head_dim(head_dim)
    entries: list[tuple[str, int, int]] = []   # (name, bits, count); bits 16 = one fp16 scalar
    k, v = p.key, p.value
    if k.codec == "fp8":
        entries.append(("k_fp8", 8, head_dim))
    else:
        entries += _codes("k_idx", k.mse_bits, head_dim)
        if k.outliers:
            entries += [("k_out_idx", 8, k.outliers), ("k_out_val", 8, k.outliers)]
        entries.append(("k_norm", 16, 1))
        if k.qjl:
            entries += [("k_qjl", 1, head_dim), ("k_rnorm", 16, 1)]
    n_key = len(entries)
    if v.codec == "uniform":
        entries += [("v_q", int(v.bits), head_dim), ("v_scale", 16, 1), ("v_zero", 16, 1)]
    else:
        entries += _codes("v_idx", v.bits, head_dim)
        entries.append(("v_norm", 16, 1))

    fields, off, key_bytes = {}, 0, 0
    for i, (name, bits, count) in enumerate(entries):
        if i == n_key:
            key_bytes = off
        if bits == 16:
            fields[name] = Field(name, off, 2)
            off += 2
        else:
            nb = packed_nbytes(count, bits)
            fields[name] = Field(name, off, nb, bits, count)
            off += nb
    value_bytes = off - key_bytes
    slot = off + (off % 2)
    return SlotLayout(p, head_dim, fields, key_bytes, value_bytes, slot)
