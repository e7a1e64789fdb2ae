import math

import pytest
import torch

from tqattn.attention.merge import merge_attn_states


def partial(q, k, v, mask):
    """Softmax attention of q (T, D) over k/v (L, D) restricted to mask (T, L): (out, lse)."""
    s = (q @ k.T).masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[:, None]).nan_to_num(0.0)
    return p @ v, lse


def test_merge_equals_attention_over_the_union():
    t, l, d = 6, 10, 8
    q, k, v = torch.randn(t, d), torch.randn(l, d), torch.randn(l, d)
    in_a = torch.rand(t, l) < 0.5
    in_a[0] = True     # row 0: everything in part a, part b empty
    in_a[1] = False    # row 1: everything in part b
    full, full_lse = partial(q, k, v, torch.ones(t, l, dtype=torch.bool))
    oa, la = partial(q, k, v, in_a)
    ob, lb = partial(q, k, v, ~in_a)
    out, lse = merge_attn_states(oa, la, ob, lb)
    torch.testing.assert_close(out, full, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, full_lse, atol=1e-6, rtol=1e-5)


def test_empty_rows_and_garbage_in_empty_parts():
    out_a = torch.tensor([[1.0, 2.0], [float("nan"), 0.0], [5.0, 5.0]])
    lse_a = torch.tensor([0.0, -math.inf, -math.inf])
    out_b = torch.tensor([[float("nan"), 1.0], [3.0, 4.0], [float("inf"), 7.0]])
    lse_b = torch.tensor([-math.inf, 1.5, -math.inf])
    out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b)
    assert torch.equal(out, torch.tensor([[1.0, 2.0], [3.0, 4.0], [0.0, 0.0]]))
    assert lse.tolist() == [0.0, 1.5, -math.inf]


def test_dtype_and_shape_rules():
    oa = torch.randn(3, 4, 8, dtype=torch.bfloat16)
    la = torch.randn(3, 4)
    out, lse = merge_attn_states(oa, la, oa.float(), la)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out.float(), oa.float())
    torch.testing.assert_close(lse, la + math.log(2))
    with pytest.raises(ValueError, match="shapes"):
        merge_attn_states(oa, la.t(), oa, la)
