"""Merging two partial attention results by their log-sum-exp.

Attention of one query over keys A ∪ B (disjoint) equals the two partial softmax results
weighted by their normalisers: out = (e^{lse_a}·out_a + e^{lse_b}·out_b) / (e^{lse_a} + e^{lse_b}),
lse = log(e^{lse_a} + e^{lse_b}). A part with no visible key has lse = −inf and weight 0; a row
where both parts are empty gets output 0 and lse −inf (what the kernels return for it).
"""

from __future__ import annotations

import torch


def merge_attn_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                      lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention outputs.

    Args:
        out_a, out_b: (..., D) partial outputs (each normalised over its own keys).
        lse_a, lse_b: (...) natural-log LSE of the scaled (soft-capped) scores of each part.

    Returns:
        (out (..., D) in out_a's dtype, lse (...) float32).
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or lse_a.shape != out_a.shape[:-1]:
        raise ValueError(
            f"shapes do not fit: out_a {tuple(out_a.shape)}, lse_a {tuple(lse_a.shape)}, "
            f"out_b {tuple(out_b.shape)}, lse_b {tuple(lse_b.shape)} (lse must be out.shape[:-1])")
    lse_a, lse_b = lse_a.float(), lse_b.float()
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)  # both empty: exp(-inf - 0) = 0
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = w_a + w_b
    inv = torch.where(total > 0, 1.0 / total, torch.zeros_like(total))
    # where(), not a product: an empty part's output may be garbage (even NaN) and must not leak.
    part_a = torch.where((w_a > 0).unsqueeze(-1), out_a.float() * (w_a * inv).unsqueeze(-1), 0.0)
    part_b = torch.where((w_b > 0).unsqueeze(-1), out_b.float() * (w_b * inv).unsqueeze(-1), 0.0)
    out = part_a + part_b
    return out.to(out_a.dtype), m + torch.log(total)
