"""bench/lab/skinny_gemm.py: the split-K candidate for the decode projections against F.linear
(Triton's interpreter on the CPU), and its config rules."""

import pytest
import torch
import torch.nn.functional as F

from bench.lab import skinny_gemm as sg


@pytest.mark.parametrize("m,n,k,cfg", sg.SMOKE_CASES)
def test_splitk_matches_linear(m, n, k, cfg):
    g = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    ref = F.linear(x.float(), w.float())
    y = sg.splitk_linear(x, w, cfg)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    # the fp32 sum rounded once to bf16: within one bf16 ulp of the exact product
    torch.testing.assert_close(y.float(), ref, rtol=2 ** -7, atol=1e-3 * ref.abs().max().item())


def test_config_rules():
    with pytest.raises(ValueError, match="K=100"):
        sg.check_config(4, 32, 100, {"block_m": 16, "block_n": 16, "block_k": 32, "splits": 2})
    with pytest.raises(ValueError, match="block_n=24"):
        sg.check_config(4, 32, 64, {"block_m": 16, "block_n": 24, "block_k": 32, "splits": 1})
    cands = sg.candidates(256, 2560, 9728, sms=132)
    assert cands and all(9728 % (c["block_k"] * c["splits"]) == 0 for c in cands)
    assert not any(c["swap"] for c in cands)  # 256 tokens fill the MMA's M side themselves
    assert any(c["swap"] for c in sg.candidates(16, 2560, 9728, sms=132))
