import math

import numpy as np
import pytest
import torch

from tqattn.evals import stats


def _lp(logits):
    return torch.log_softmax(torch.tensor(logits, dtype=torch.float32), -1)


def test_token_kl_matches_hand_computation():
    p = torch.tensor([[0.5, 0.25, 0.25], [0.9, 0.05, 0.05]])
    q = torch.tensor([[0.25, 0.5, 0.25], [0.9, 0.05, 0.05]])
    kl = stats.token_kl(p.log(), q.log())
    expected = 0.5 * math.log(2) + 0.25 * math.log(0.5)
    assert kl[0].item() == pytest.approx(expected, rel=1e-6)
    assert kl[1].item() == pytest.approx(0.0, abs=1e-7)
    assert kl.dtype == torch.float64


def test_token_kl_properties_on_random_rows():
    g = torch.Generator().manual_seed(0)
    a = torch.log_softmax(torch.randn(700, 50, generator=g), -1)  # > one 256-row block
    b = torch.log_softmax(torch.randn(700, 50, generator=g), -1)
    assert torch.all(stats.token_kl(a, a) == 0)
    kab = stats.token_kl(a, b)
    assert torch.all(kab > 0)
    ref = (a.double().exp() * (a.double() - b.double())).sum(1)
    assert torch.allclose(kab, ref)
    assert not torch.allclose(kab, stats.token_kl(b, a))  # not symmetric


def test_token_kl_zero_probability_entries():
    a = torch.tensor([[0.0, float("-inf")]])            # p = (1, 0)
    b = torch.log(torch.tensor([[0.5, 0.5]]))
    assert stats.token_kl(a, b).item() == pytest.approx(math.log(2))
    assert stats.token_kl(a, a).item() == 0.0           # no nan from -inf - -inf
    with pytest.raises(ValueError, match="shapes differ"):
        stats.token_kl(a, b[:, :1])


def test_nll_and_agreement():
    ref = _lp([[3.0, 1.0, 0.0], [0.0, 2.0, 5.0], [1.0, 0.0, 0.0]])
    other = _lp([[2.0, 1.0, 0.0], [0.0, 6.0, 5.0], [1.0, 0.5, 0.0]])
    assert stats.token_agree(ref, other).tolist() == [1.0, 0.0, 1.0]
    nll = stats.token_nll(ref, torch.tensor([0, 2, 1]))
    assert torch.allclose(nll, -ref[[0, 1, 2], [0, 2, 1]].double())


def _units(n_units, tokens=100, nll=2.0, spread=0.2, seed=0):
    rng = np.random.default_rng(seed)
    n = np.full(n_units, tokens, float)
    return {"n": n, "nll_ref": n * (nll + spread * rng.standard_normal(n_units))}


def test_figures_are_ratios_of_sums():
    u = {"n": np.array([10.0, 30.0]), "nll_ref": np.array([10.0, 60.0]), "nll": np.array([11.0, 63.0]),
         "kl": np.array([0.1, 0.5]), "agree": np.array([9.0, 27.0])}
    assert stats.figure(u, "ppl_ref") == pytest.approx(math.exp(70 / 40))
    assert stats.figure(u, "ppl") == pytest.approx(math.exp(74 / 40))
    assert stats.figure(u, "ppl_delta_pct") == pytest.approx(100 * (math.exp(4 / 40) - 1))
    assert stats.figure(u, "kl") == pytest.approx(0.6 / 40)
    assert stats.figure(u, "top1") == pytest.approx(36 / 40)


def test_bootstrap_interval_covers_and_shrinks():
    small = _units(10)
    big = _units(400)
    v, lo, hi = stats.bootstrap_ci(small, "ppl_ref", seed=1)
    assert lo <= v <= hi
    vb, lob, hib = stats.bootstrap_ci(big, "ppl_ref", seed=1)
    assert lob < math.exp(2.0) < hib
    assert hib - lob < (hi - lo) / 3
    assert stats.bootstrap_ci(small, "ppl_ref", seed=1) == (v, lo, hi)  # seeded
    same = {"n": np.full(5, 10.0), "nll_ref": np.full(5, 20.0)}
    assert stats.bootstrap_ci(same, "ppl_ref")[1:] == pytest.approx((math.exp(2), math.exp(2)))


def test_paired_difference():
    rng = np.random.default_rng(3)
    base = _units(30, seed=3)
    kl_common = rng.gamma(2.0, 0.01, 30) * 100      # large shared variation between units
    a = {**base, "nll": base["nll_ref"] + 1.0, "kl": kl_common, "agree": base["n"] * 0.9}
    b = {**base, "nll": base["nll_ref"] + 2.0, "kl": kl_common * 1.1, "agree": base["n"] * 0.8}
    d = stats.paired_diff_ci(a, b, "kl", seed=0)
    assert d["diff"] < 0 and d["high"] < 0 and d["excludes_zero"]
    # Unpaired intervals overlap although the paired one excludes zero.
    _, alo, ahi = stats.bootstrap_ci(a, "kl", seed=0)
    _, blo, bhi = stats.bootstrap_ci(b, "kl", seed=0)
    assert ahi > blo
    p = stats.paired_diff_ci(a, b, "ppl_delta_pct")
    assert p["high"] < 0
    same = stats.paired_diff_ci(a, a, "kl")
    assert same["diff"] == 0 and not same["excludes_zero"]
    t = stats.paired_diff_ci(a, b, "top1")
    assert t["diff"] == pytest.approx(0.1) and t["excludes_zero"]


def test_unit_checks():
    with pytest.raises(ValueError, match="same units"):
        stats.paired_diff_ci(_units(5), _units(6), "ppl_ref")
    with pytest.raises(ValueError, match="one length"):
        stats.bootstrap_ci({"n": np.ones(3), "nll_ref": np.ones(4)}, "ppl_ref")


def test_one_unit_has_no_interval_and_excludes_nothing():
    # one window is one bootstrap unit: no spread to resample, so no "95 %" interval (it would be
    # zero-wide) and no significance
    one = {**_units(1), "kl": np.array([1.5])}
    v, lo, hi = stats.bootstrap_ci(one, "kl")
    assert v == stats.figure(one, "kl") and math.isnan(lo) and math.isnan(hi)
    other = {**one, "kl": one["kl"] * 2}
    d = stats.paired_diff_ci(one, other, "kl")
    assert d["diff"] < 0 and math.isnan(d["low"]) and not d["excludes_zero"]
