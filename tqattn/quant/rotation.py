"""Orthogonal rotations applied before scalar quantization.

Convention: row vectors, ``y = x @ R``; R is orthogonal, so ``x = y @ R.T`` and
``<q, k> = <q @ R, k @ R>`` — kernels rotate the query once and never un-rotate keys.

The rotation is always materialised as a dense D×D fp32 matrix: on a GPU one D×D GEMM per
token (store) or per query (decode) is negligible next to reading the cache, and a dense matrix
lets every head size use the same code path. Constructions:

* power-of-two D: normalised Sylvester–Walsh–Hadamard H, optionally preceded by seeded random
  ±1 signs (randomized Hadamard, ``R = diag(s) · H``). Without signs this is exactly vLLM's
  rotation (symmetric, self-inverse).
* any other D (80, 96, 192, ...): vLLM builds a Hadamard of the next power of two and crashes;
  we use two rounds of "random signs → block-diagonal Hadamard over power-of-two blocks", with a
  seeded permutation between the rounds and the block order reversed in the second round
  (e.g. 80 = [64 | 16] then [16 | 64]), so that every input channel reaches every output
  coordinate. Measured distortion against a Haar-random rotation is in
  ``tests/quant/test_rotation.py`` and the README; with signs off, only the permutation and the
  block Hadamards remain (still orthogonal and deterministic).
"""

from __future__ import annotations

from functools import lru_cache

import torch


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@lru_cache(maxsize=None)
def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / h.shape[0] ** 0.5


def hadamard(n: int) -> torch.Tensor:
    """Normalised Sylvester Hadamard matrix (float64), n a power of two."""
    if not is_power_of_two(n):
        raise ValueError(f"Sylvester Hadamard needs a power-of-two size, got {n}")
    return _sylvester(n).clone()


def power_of_two_blocks(n: int) -> list[int]:
    """Greedy split of n into descending powers of two (80 → [64, 16], 96 → [64, 32])."""
    blocks, rest = [], n
    while rest:
        b = 1 << (rest.bit_length() - 1)
        blocks.append(b)
        rest -= b
    return blocks


def _block_hadamard(blocks: list[int]) -> torch.Tensor:
    return torch.block_diag(*[_sylvester(b) for b in blocks])


def _signs(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 2, (n,), generator=gen, dtype=torch.int64).to(torch.float64) * 2 - 1


@lru_cache(maxsize=None)
def _rotation64(dim: int, signs: bool, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if is_power_of_two(dim):
        s = _signs(dim, gen) if signs else torch.ones(dim, dtype=torch.float64)
        return s[:, None] * _sylvester(dim)
    blocks = power_of_two_blocks(dim)
    eye = torch.ones(dim, dtype=torch.float64)
    s1 = _signs(dim, gen) if signs else eye
    perm = torch.randperm(dim, generator=gen)
    s2 = _signs(dim, gen) if signs else eye
    r1 = s1[:, None] * _block_hadamard(blocks)
    r2 = s2[:, None] * _block_hadamard(blocks[::-1])
    return r1[:, perm] @ r2


def rotation_matrix(dim: int, *, signs: bool = True, seed: int = 0,
                    device: torch.device | str | None = None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The D×D orthogonal rotation used by the codec (see module docstring)."""
    if not isinstance(dim, int) or dim < 2:
        raise ValueError(f"rotation size must be an integer >= 2, got {dim!r}")
    return _rotation64(dim, bool(signs), int(seed)).to(device=device, dtype=dtype)


def is_signed_hadamard(r: torch.Tensor) -> bool:
    """Whether r is diag(s)·H/√D (s = ±1) bit for bit in fp32 — what :func:`rotation_matrix`
    builds for every power-of-two D. Kernels then make R (or apply it) from s alone."""
    d = r.shape[0]
    if r.dim() != 2 or r.shape != (d, d) or not is_power_of_two(d):
        return False
    r = r.detach().float().cpu()
    s = torch.where(r[:, 0] < 0, -1.0, 1.0).double()
    return bool(torch.equal(r, (s[:, None] * _sylvester(d)).float()))


def haar_rotation(dim: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Haar-random orthogonal matrix (QR of a Gaussian) — the paper's rotation; used as a yardstick."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(dim, dim, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    return (q * torch.sign(torch.diagonal(r))).to(dtype)
