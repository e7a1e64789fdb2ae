import pytest
import torch

from tqattn.quant.codebook import get_codebook
from tqattn.quant.rotation import haar_rotation, hadamard, power_of_two_blocks, rotation_matrix

HEAD_SIZES = [64, 80, 96, 128, 192, 256, 512]


@pytest.mark.parametrize("dim", HEAD_SIZES)
@pytest.mark.parametrize("signs", [True, False])
def test_rotation_is_orthogonal(dim, signs):
    r = rotation_matrix(dim, signs=signs, seed=3)
    assert r.shape == (dim, dim)
    assert torch.allclose(r @ r.T, torch.eye(dim), atol=1e-5)


def test_plain_hadamard_is_vllms():
    h = rotation_matrix(128, signs=False)
    assert torch.allclose(h, hadamard(128).float())
    assert torch.allclose(h, h.T) and torch.allclose(h @ h, torch.eye(128), atol=1e-5)


def test_seeded_and_deterministic():
    assert torch.equal(rotation_matrix(128, seed=1), rotation_matrix(128, seed=1))
    assert not torch.equal(rotation_matrix(128, seed=1), rotation_matrix(128, seed=2))
    assert not torch.equal(rotation_matrix(80, seed=1), rotation_matrix(80, seed=2))


def test_blocks():
    assert power_of_two_blocks(80) == [64, 16]
    assert power_of_two_blocks(96) == [64, 32]
    assert power_of_two_blocks(192) == [128, 64]


def _rotated_mse(r, x, bits=3):
    cb = get_codebook(r.shape[0], bits)
    c, b = torch.tensor(cb.centroids), torch.tensor(cb.boundaries)
    u = x / x.norm(dim=-1, keepdim=True)
    return ((c[torch.bucketize(u @ r, b)] @ r.T - u).pow(2).sum(-1)).mean().item()


@pytest.mark.parametrize("dim", HEAD_SIZES)
def test_distortion_matches_haar_on_outlier_keys(dim):
    """The documented claim: our rotation (block construction for non-powers of two) quantizes
    keys with large outlier channels as well as a Haar-random rotation does."""
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(4096, dim, generator=g)
    x[:, [1, 5, dim // 2 + 3, dim - 2]] *= 8
    ours = _rotated_mse(rotation_matrix(dim, seed=0), x)
    haar = _rotated_mse(haar_rotation(dim, seed=0), x)
    theory = get_codebook(dim, 3).mse
    assert ours <= 1.1 * haar and ours <= 1.1 * theory, (ours, haar, theory)


def test_rotation_bad_size():
    with pytest.raises(ValueError, match="rotation size"):
        rotation_matrix(1)
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(80)


def test_is_signed_hadamard():
    from tqattn.quant.rotation import haar_rotation, is_signed_hadamard, rotation_matrix
    for d in (16, 64, 128):
        for signs in (True, False):
            assert is_signed_hadamard(rotation_matrix(d, signs=signs, seed=3))
    assert not is_signed_hadamard(rotation_matrix(80))
    assert not is_signed_hadamard(haar_rotation(64))
    r = rotation_matrix(64).clone()
    r[5, 9] = -r[5, 9]
    assert not is_signed_hadamard(r)
