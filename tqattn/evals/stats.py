"""Per-token quality measures on log-prob rows and bootstrap confidence intervals over units.

Token measures (rows are next-token log-distributions over the vocabulary):
  nll    -log q(target)
  kl     KL(P_ref || Q) = sum_v p_ref(v) (log p_ref(v) - log q(v)), in nats
  agree  argmax q == argmax p_ref (top-1 agreement)

Units are contiguous blocks of scored tokens (see ppl.py); a figure over a set of units is a
ratio of sums (e.g. KL = sum kl / sum n), and its 95 % interval is the percentile bootstrap
over units resampled with replacement. Two presets scored on the same units are compared with a
paired bootstrap: both figures are computed on the same resampled units and the interval is the
one of their difference.
"""

from __future__ import annotations

import math

import numpy as np
import torch

_ROWS = 256  # rows per float64 block: bounds memory at 256 x vocab x 8 bytes


def token_nll(logprobs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return -logprobs.gather(1, targets.view(-1, 1).long()).squeeze(1).double()


def token_kl(ref: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(ref || other) per row, float64; both inputs are log-probs of the same shape."""
    if ref.shape != other.shape:
        raise ValueError(f"log-prob shapes differ: {tuple(ref.shape)} vs {tuple(other.shape)}")
    out = torch.empty(ref.shape[0], dtype=torch.float64)
    for s in range(0, ref.shape[0], _ROWS):
        r, o = ref[s:s + _ROWS].double(), other[s:s + _ROWS].double()
        p = r.exp()
        # 0 * log 0 = 0: -inf - -inf would give nan where both have zero probability.
        out[s:s + _ROWS] = torch.where(p > 0, p * (r - o), torch.zeros_like(p)).sum(1)
    return out.clamp_min(0.0)  # rounding can leave tiny negatives


def token_agree(ref: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    return (ref.argmax(1) == other.argmax(1)).double()


# ----------------------------------------------------------------------------- figures

def _ppl(s):
    return np.exp(s["nll"] / s["n"])


def _ppl_ref(s):
    return np.exp(s["nll_ref"] / s["n"])


def _ppl_delta_pct(s):
    return 100.0 * np.expm1((s["nll"] - s["nll_ref"]) / s["n"])


METRICS = {
    "ppl": _ppl,
    "ppl_ref": _ppl_ref,
    "ppl_delta_pct": _ppl_delta_pct,          # 100 (PPL / PPL_ref - 1)
    "kl": lambda s: s["kl"] / s["n"],         # mean KL per token, nats
    "top1": lambda s: s["agree"] / s["n"],    # top-1 agreement with the reference
}


def _check_units(units: dict[str, np.ndarray]) -> int:
    sizes = {k: np.asarray(v).shape for k, v in units.items()}
    if len(set(sizes.values())) != 1 or len(next(iter(sizes.values()))) != 1:
        raise ValueError(f"unit arrays must be 1-D of one length, got {sizes}")
    n = next(iter(sizes.values()))[0]
    if n < 1:
        raise ValueError("no units to summarize")
    return n


def resample_indices(n_units: int, n_boot: int = 2000, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n_units, size=(n_boot, n_units))


def figure(units: dict[str, np.ndarray], metric: str) -> float:
    return float(METRICS[metric]({k: np.asarray(v, float).sum() for k, v in units.items()}))


def bootstrap_ci(units: dict[str, np.ndarray], metric: str, *, n_boot: int = 2000, seed: int = 0,
                 level: float = 0.95) -> tuple[float, float, float]:
    """(figure, low, high): percentile bootstrap over units; one unit has no interval (NaN)."""
    n = _check_units(units)
    if n < 2:
        return figure(units, metric), math.nan, math.nan
    idx = resample_indices(n, n_boot, seed)
    boot = METRICS[metric]({k: np.asarray(v, float)[idx].sum(1) for k, v in units.items()})
    a = (1 - level) / 2
    lo, hi = np.quantile(boot, [a, 1 - a])
    return figure(units, metric), float(lo), float(hi)


def paired_diff_ci(units_a: dict[str, np.ndarray], units_b: dict[str, np.ndarray], metric: str,
                   *, n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    """Figure(a) - figure(b) with a paired percentile-bootstrap interval (same resampled units);
    one unit has no interval (NaN) and excludes nothing."""
    n = _check_units(units_a)
    if _check_units(units_b) != n or not np.array_equal(units_a["n"], units_b["n"]):
        raise ValueError("paired comparison needs the same units (same windows and token counts)")
    diff = figure(units_a, metric) - figure(units_b, metric)
    if n < 2:
        return {"metric": metric, "diff": diff, "low": math.nan, "high": math.nan, "excludes_zero": False}
    idx = resample_indices(n, n_boot, seed)
    fa = METRICS[metric]({k: np.asarray(v, float)[idx].sum(1) for k, v in units_a.items()})
    fb = METRICS[metric]({k: np.asarray(v, float)[idx].sum(1) for k, v in units_b.items()})
    a = (1 - level) / 2
    lo, hi = np.quantile(fa - fb, [a, 1 - a])
    return {"metric": metric, "diff": diff, "low": float(lo), "high": float(hi),
            "excludes_zero": bool(lo > 0 or hi < 0)}
