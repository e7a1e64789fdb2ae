"""Bit packing of small integer codes into bytes.

One rule for every width: codes form a little-endian bit stream, code ``i`` occupying bits
``[i·b, (i+1)·b)``. That gives vLLM's layouts: 4-bit = two codes per byte with the even
coordinate in the low nibble; 3-bit = eight codes in three bytes as one little-endian 24-bit
word; 2/1-bit = least significant bits first; 8-bit = identity.
"""

from __future__ import annotations

import torch

PACK_BITS = (1, 2, 3, 4, 8)


def packed_nbytes(n: int, bits: int) -> int:
    return (n * bits + 7) // 8


def _check_bits(bits: int) -> None:
    if bits not in PACK_BITS:
        raise ValueError(f"bit width {bits!r} not supported; valid: {PACK_BITS}")


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes (..., n) with values in [0, 2**bits) into uint8 (..., ceil(n·bits/8))."""
    _check_bits(bits)
    if codes.dtype not in (torch.uint8, torch.int16, torch.int32, torch.int64):
        raise TypeError(f"codes must be an integer tensor, got {codes.dtype}")
    if bits == 8:
        return codes.to(torch.uint8)
    n = codes.shape[-1]
    shifts = torch.arange(bits, device=codes.device, dtype=torch.int32)
    stream = ((codes.to(torch.int32).unsqueeze(-1) >> shifts) & 1).flatten(-2)  # (..., n·bits)
    nbytes = packed_nbytes(n, bits)
    pad = nbytes * 8 - n * bits
    if pad:
        stream = torch.nn.functional.pad(stream, (0, pad))
    weights = (1 << torch.arange(8, device=codes.device, dtype=torch.int32))
    return (stream.unflatten(-1, (nbytes, 8)) * weights).sum(-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: uint8 (..., nbytes) → int64 codes (..., n)."""
    _check_bits(bits)
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed codes must be uint8, got {packed.dtype}")
    if packed.shape[-1] != packed_nbytes(n, bits):
        raise ValueError(f"{n} codes of {bits} bits need {packed_nbytes(n, bits)} bytes, "
                         f"got {packed.shape[-1]}")
    if bits == 8:
        return packed.to(torch.int64)
    # `bits` bytes hold exactly 8 codes: read them as one little-endian word, shift each code out
    nbytes = packed.shape[-1]
    pad = -nbytes % bits
    if pad:
        packed = torch.nn.functional.pad(packed, (0, pad))
    by = packed.unflatten(-1, (-1, bits)).to(torch.int32)
    word = by[..., 0]
    for i in range(1, bits):
        word = word | (by[..., i] << (8 * i))
    shifts = torch.arange(0, 8 * bits, bits, device=packed.device, dtype=torch.int32)
    codes = (word.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.flatten(-2)[..., :n].to(torch.int64)
