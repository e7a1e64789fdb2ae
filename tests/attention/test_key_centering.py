"""Key centering in the TurboQuant backend: exact on every path, refused where it is not."""

import pytest
import torch

from tqattn.attention.key_centering import KeyOffset, centering_unsupported_reason
from tqattn.attention.turboquant import TurboQuantImpl

from .batch_utils import spec
from .test_turboquant import CASES, P, check, force_triton, run_step


def big_offset(s, seed=1):
    """An offset several times the size of the test keys (unit normal): a path that mixed
    centered and un-centered keys would be far off."""
    g = torch.Generator().manual_seed(seed)
    return 6.0 * torch.randn(s.num_kv_heads, s.head_size, generator=g)


@pytest.mark.parametrize("fused", [False, True], ids=["store_then_forward", "fused"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("window", [None, 8])
def test_centered_cache_is_uncentered_attention_over_the_same_codes(case, window, fused):
    """Decoded keys + μ for the history, the raw chunk as it came: the layer's output is that
    attention to fp32 rounding on every path (decode, fresh prefill, short continuations with
    their LSE merge, long continuations through the dequantized prefix, the prefix-cache hit in
    MIXED, unordered batches) — the shift q·μ cancels everywhere."""
    reqs, threshold = CASES[case]
    s = spec(kv=P, window=window)
    out, ref, *_ = run_step(s, reqs, threshold=threshold, fused=fused, key_offset=big_offset(s))
    check(out, ref)


@pytest.mark.parametrize("case", ["decode", "mixed", "long"])
def test_centering_on_a_padded_cache(case):
    """A cache padded past the head size (kv_cache_head_size) centers with μ padded by zeros:
    still the un-centered attention over the same codes, fused and not."""
    reqs, threshold = CASES[case]
    s = spec(kv=P, d=12, kv_cache_head_size=16)
    for fused in (False, True):
        out, ref, *_ = run_step(s, reqs, threshold=threshold, fused=fused,
                                key_offset=big_offset(s))
        check(out, ref)


def test_centering_changes_the_codes_not_the_rule():
    """Centering with μ on keys k stores what an un-centered layer stores for keys k − μ."""
    s = spec(kv=P)
    mu = big_offset(s)
    reqs, _ = CASES["mixed"]
    a, *_ = run_step(s, reqs, key_offset=mu)
    b, *_ = run_step(s, reqs, key_offset=torch.zeros_like(mu))
    c, *_ = run_step(s, reqs)
    torch.testing.assert_close(b, c, atol=0, rtol=0)   # a zero offset is no offset
    assert (a - c).abs().max() > 1e-3                  # a real offset changes the codes


@pytest.mark.parametrize("case", ["prefill", "decode", "mixed"])
def test_a_centered_layer_stores_the_codes_of_k_minus_mu(case):
    """The cache's bytes, not only the attention (a constant shift of every key cancels in
    softmax, so outputs alone cannot tell whether the store centered)."""
    from tqattn.attention.turboquant import TurboQuantBackend, TurboQuantMetadataBuilder
    from tqattn.quant.paged import store_ref

    from .batch_utils import make_batch, num_blocks, random_qkv

    s = spec(kv=P)
    mu = big_offset(s)
    gen = torch.Generator().manual_seed(0)
    batch = make_batch(CASES[case][0], gen=gen)
    impl = TurboQuantImpl(s)
    impl.set_key_offset(mu, "cpu")
    md = TurboQuantMetadataBuilder({s.name: impl}, "cpu").build(batch.common)
    shape = TurboQuantBackend.kv_cache_shape(num_blocks(batch), batch.common.block_size, s)
    got, want = torch.zeros(shape, dtype=torch.uint8), torch.zeros(shape, dtype=torch.uint8)
    n = batch.common.num_actual_tokens
    _, k, v = random_qkv(n, s, gen)
    impl.store(k, v, got, md)
    store_ref(impl.codec(), k[:n].float() - mu, v[:n], want, md.slot_mapping[:n])
    assert got.any() and torch.equal(got, want)


@pytest.mark.parametrize("preset,d,splits", [
    (P, 16, 1), ("tq_k4v3", 64, 2), ("turboquant_k8v4", 64, 1), ("tq_k3o4v3.5", 64, 1)])
def test_triton_kernels_with_centering(monkeypatch, preset, d, splits):
    """The Triton store (key splits, outliers, fp8 keys), decode and dequant on centered keys:
    a decode, a first chunk, a short and a long continuation in one step."""
    from tqattn.kernels import store
    force_triton(monkeypatch, ("store", "decode", "dequant"))
    monkeypatch.setattr(store, "auto_key_splits", lambda n_kv, device: splits)
    s = spec(kv=preset, hq=4, hk=2, d=d)
    out, ref, *_ = run_step(s, [(9, 1), (0, 5), (6, 3), (20, 6)], threshold=4, fused=True,
                            key_offset=big_offset(s))
    check(out, ref, atol=2e-3)


def test_soft_cap_is_refused():
    s = spec(kv=P, softcap=5.0)
    assert "soft-caps its attention logits" in centering_unsupported_reason(s)
    impl = TurboQuantImpl(s, fa_version=None)
    with pytest.raises(ValueError, match=r"layers\.0\.attn soft-caps .* tanh does not ignore"):
        impl.set_key_offset(torch.zeros(2, 16))
    assert impl.key_offset is None


def test_bad_offsets_are_refused():
    s = spec(kv=P)
    with pytest.raises(ValueError, match=r"shape \(3, 16\); expected \(num_kv_heads, head_size\) "
                                         r"= \(2, 16\)"):
        KeyOffset(torch.zeros(3, 16), s)
    with pytest.raises(ValueError, match="non-finite"):
        KeyOffset(torch.full((2, 16), float("nan")), s)
    off = KeyOffset(torch.ones(2, 16, dtype=torch.float64), spec(kv=P, dtype=torch.bfloat16))
    assert off.tensor.dtype == torch.bfloat16 and off.tensor.is_contiguous()
