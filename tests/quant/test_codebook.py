import math

import pytest

from tqattn.quant.codebook import get_codebook

# Positive 3-bit levels (units of 1/sqrt(d)) of the exact coordinate law.
EXACT_3BIT = {64: [0.2438, 0.7507, 1.3293, 2.1113], 128: [0.2444, 0.7533, 1.3366, 2.1315]}
GAUSS_LEVELS = {1: [0.7979], 2: [0.4528, 1.5104], 3: [0.2451, 0.7560, 1.3439, 2.1520],
                4: [0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326]}
THEORY_MSE = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.00950}  # Gaussian Lloyd–Max, unit variance


@pytest.mark.parametrize("dim", [64, 128])
def test_exact_law_levels(dim):
    got = get_codebook(dim, 3, "exact").levels()
    assert got == pytest.approx(EXACT_3BIT[dim], abs=0.003)


def test_exact_law_differs_from_gaussian_at_64():
    # the outermost Gaussian level (2.1520) is not the exact-law one (2.1113) at d = 64
    assert abs(get_codebook(64, 3, "exact").levels()[-1] - 2.1520) > 0.03


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_exact_law_tends_to_gaussian(bits):
    # d = 512: the exact law is within 1 % of the converged Gaussian Lloyd–Max levels
    got = get_codebook(512, bits, "exact").levels()
    assert got == pytest.approx(GAUSS_LEVELS[bits], rel=0.01)
    assert get_codebook(512, bits, "exact").mse == pytest.approx(THEORY_MSE[bits], rel=0.01)
    # and the exact-law MSE is below the Gaussian-law MSE at small d (lighter tails)
    assert get_codebook(64, bits, "exact").mse < THEORY_MSE[bits]


def test_vllm_gaussian_recipe_values():
    # vLLM's recipe stops after 200 iterations: these are its numbers, not the converged ones
    assert get_codebook(128, 3, "gaussian").levels() == pytest.approx(
        [0.2450, 0.7556, 1.3432, 2.1503], abs=2e-4)
    assert get_codebook(128, 4, "gaussian").levels() == pytest.approx(
        [0.1284, 0.3881, 0.6569, 0.9424, 1.2563, 1.6179, 2.0684, 2.7309], abs=2e-4)


@pytest.mark.parametrize("kind", ["exact", "gaussian"])
def test_codebook_shape_symmetry_and_cache(kind):
    cb = get_codebook(128, 4, kind)
    c, b = cb.centroids, cb.boundaries
    assert len(c) == 16 and len(b) == 15
    assert list(c) == sorted(c)
    assert all(math.isclose(x, -y, abs_tol=1e-9) for x, y in zip(c, reversed(c)))
    assert all(math.isclose(bi, (c[i] + c[i + 1]) / 2) for i, bi in enumerate(b))
    assert get_codebook(128, 4, kind) is cb


def test_codebook_bad_input():
    with pytest.raises(ValueError, match="bits"):
        get_codebook(128, 9)
    with pytest.raises(ValueError, match="kind"):
        get_codebook(128, 3, "uniform")
