import pytest
import torch

from tqattn.attention import fa_utils
from tqattn.attention import flash_attn as fa_mod
from tqattn.attention.flash_attn import (FlashAttentionBackend, FlashAttentionImpl,
                                         FlashAttentionMetadataBuilder, scatter_rows)

from .batch_utils import attention, history_batch, make_batch, num_blocks, random_qkv, spec

DECODES = [(20, 1), (5, 1), (47, 1)]
PREFILLS = [(0, 37), (0, 5), (0, 1)]
CONTINUATIONS = [(20, 9), (33, 40), (16, 16)]
# Decodes first, a prefix-cache hit on its first chunk, a fresh prompt, a long continuation.
MIXED = [(20, 1), (7, 1), (32, 10), (0, 30), (40, 150)]


def run_step(s, reqs, *, pad=0, fa_version=None, seed=0, device="cpu"):
    """Store each request's history, then run one step; return (out, reference, cache, ...)."""
    gen = torch.Generator().manual_seed(seed)
    batch = make_batch(reqs, pad=pad, gen=gen, device=device)
    impl = FlashAttentionImpl(s, fa_version=fa_version)
    builder = FlashAttentionMetadataBuilder({s.name: impl}, device)
    shape = FlashAttentionBackend.kv_cache_shape(num_blocks(batch), batch.common.block_size, s)
    kv_cache = torch.zeros(shape, dtype=FlashAttentionBackend.kv_cache_torch_dtype(s),
                           device=device)

    hist = history_batch(batch)
    hist_kv = {}
    if hist is not None:
        _, hk, hv = random_qkv(hist.common.num_actual_tokens, s, gen, device=device)
        impl.store(hk, hv, kv_cache, builder.build(hist.common))
        rows = [b for b, (c, _) in enumerate(reqs) if c > 0]
        for i, b in enumerate(rows):
            a, e = hist.common.query_start_loc_cpu[i:i + 2].tolist()
            hist_kv[b] = (hk[a:e], hv[a:e])

    q, k, v = random_qkv(batch.common.num_actual_tokens + pad, s, gen, device=device)
    md = builder.build(batch.common)
    impl.store(k, v, kv_cache, md)
    out = impl.forward(q, k, v, kv_cache, md).cpu()
    q, k, v = q.cpu(), k.cpu(), v.cpu()
    hist_kv = {b: (x.cpu(), y.cpu()) for b, (x, y) in hist_kv.items()}

    ref = torch.zeros(q.shape, dtype=torch.float32)
    qsl = batch.common.query_start_loc_cpu.tolist()
    for b, (c, n) in enumerate(reqs):
        a, e = qsl[b], qsl[b + 1]
        kb, vb = k[a:e], v[a:e]
        if c:
            kb, vb = torch.cat([hist_kv[b][0], kb]), torch.cat([hist_kv[b][1], vb])
        ref[a:e] = attention(q[a:e], kb, vb, batch.q_pos[b], torch.arange(c + n), s.scale,
                             s.sliding_window, s.logits_soft_cap)
    return out, ref, kv_cache, batch, impl


@pytest.mark.parametrize("reqs", [PREFILLS, CONTINUATIONS, DECODES, MIXED],
                         ids=["prefill", "continuation", "decode", "mixed"])
@pytest.mark.parametrize("window,softcap", [(None, 0.0), (8, 0.0), (None, 5.0), (20, 3.0)])
def test_matches_plain_attention(reqs, window, softcap):
    s = spec(window=window, softcap=softcap)
    out, ref, *_ = run_step(s, reqs)
    torch.testing.assert_close(out.float(), ref, atol=2e-5, rtol=1e-4)


def test_padding_tokens_are_neither_stored_nor_attended():
    s = spec()
    out, ref, kv_cache, batch, _ = run_step(s, MIXED, pad=5)
    n = batch.common.num_actual_tokens
    torch.testing.assert_close(out[:n], ref[:n], atol=2e-5, rtol=1e-4)
    assert out[n:].abs().max() == 0
    # Only the slots of real tokens were written.
    written = (kv_cache[0].flatten(0, 1).abs().sum((-1, -2)) > 0).nonzero().flatten()
    valid = batch.common.slot_mapping[batch.common.slot_mapping >= 0]
    assert set(valid.tolist()) <= set(written.tolist())


def test_scatter_rows_skips_negative_slots():
    rows = torch.arange(12.0).view(6, 2)
    before = rows.clone()
    scatter_rows(rows, torch.tensor([-1, -1]), torch.full((2, 2), 99.0))
    assert torch.equal(rows, before)  # nothing valid: untouched
    scatter_rows(rows, torch.tensor([-1, 4, -1, 1]), torch.tensor([[7., 7], [1, 2], [8, 8], [3, 4]]))
    expect = before.clone()
    expect[4], expect[1] = torch.tensor([1., 2]), torch.tensor([3., 4])
    assert torch.equal(rows, expect)


def test_cache_layout_is_vllms():
    s = spec(hk=2, d=16)
    assert FlashAttentionBackend.kv_cache_shape(10, 16, s) == (2, 10, 16, 2, 16)
    assert FlashAttentionBackend.page_bytes(16, spec(dtype=torch.bfloat16)) == 2 * 16 * 2 * 16 * 2
    assert FlashAttentionBackend.kv_cache_torch_dtype(spec(kv="float16")) == torch.float16


def test_unsupported_features_are_refused():
    assert "ALiBi" in FlashAttentionBackend.unsupported_reason(spec(alibi=True))
    assert "sinks" in FlashAttentionBackend.unsupported_reason(spec(sinks=True))
    assert "turboquant_k8v4" in FlashAttentionBackend.unsupported_reason(spec(kv="turboquant_k8v4"))
    with pytest.raises(ValueError, match="ALiBi"):
        FlashAttentionImpl(spec(alibi=True))


# --------------------------------------------------------------------------------------------
# The layer's FlashAttention version
# --------------------------------------------------------------------------------------------


@pytest.fixture
def varlen_spy(monkeypatch):
    """Records the fa_version of every flash_attn_varlen call, then runs the SDPA path."""
    calls = []
    real = fa_utils.flash_attn_varlen

    def spy(*args, fa_version=None, **kw):
        calls.append(fa_version)
        return real(*args, fa_version=None, **kw)

    monkeypatch.setattr(fa_utils, "flash_attn_varlen", spy)
    return calls


@pytest.mark.parametrize("chosen", [2, 3, 4])
def test_layer_passes_its_chosen_version(monkeypatch, varlen_spy, chosen):
    asked = []

    def fake_choice(head_size, requires_alibi=False, **kw):
        asked.append((head_size, requires_alibi))
        return chosen

    monkeypatch.setattr(fa_utils, "get_flash_attn_version", fake_choice)
    monkeypatch.setattr(fa_mod, "_fa3_kvcache_fns", lambda: None)
    s = spec(dtype=torch.bfloat16, d=32)
    impl = FlashAttentionImpl(s)
    assert impl.fa_version == chosen and asked == [(32, False)]
    # Both the fresh-prefill and the gathered (prefix) path pass it.
    for reqs in (PREFILLS, MIXED):
        out, ref, *_ = run_step(s, reqs, fa_version=impl.fa_version)
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    assert varlen_spy and set(varlen_spy) == {chosen}


def test_fp32_layers_run_sdpa(monkeypatch):
    monkeypatch.setattr(fa_utils, "get_flash_attn_version", lambda *a, **k: 3)
    assert FlashAttentionImpl(spec(dtype=torch.float32)).fa_version is None
    assert FlashAttentionImpl(spec(dtype=torch.float16)).fa_version == 3


# --------------------------------------------------------------------------------------------
# FA3 paged entry point (a fake flash_attn_interface that records its arguments)
# --------------------------------------------------------------------------------------------


class FakeFA3:
    def __init__(self):
        self.calls, self.sched_calls = [], []

    def with_kvcache(self, q, k_cache, v_cache, *, cache_seqlens, page_table, cu_seqlens_q,
                     max_seqlen_q, softmax_scale, causal, window_size, softcap,
                     scheduler_metadata):
        self.calls.append(dict(window_size=window_size, scheduler_metadata=scheduler_metadata))
        assert causal
        bs = k_cache.shape[1]
        out = torch.zeros_like(q)
        for b in range(len(cache_seqlens)):
            a, e = cu_seqlens_q[b:b + 2].tolist()
            n = int(cache_seqlens[b])
            pos = torch.arange(n)
            blocks = page_table[b, pos // bs].long()
            kb, vb = k_cache[blocks, pos % bs], v_cache[blocks, pos % bs]
            qpos = torch.arange(n - (e - a), n)
            window = None if window_size[0] < 0 else window_size[0] + 1
            out[a:e] = attention(q[a:e], kb, vb, qpos, pos, softmax_scale, window, softcap)
        return out

    def scheduler_metadata(self, *args, **kw):
        self.sched_calls.append((args, kw))
        return torch.tensor([123])


def test_fa3_paged_path_and_aot_scheduling(monkeypatch):
    fake = FakeFA3()
    monkeypatch.setattr(fa_mod, "_fa3_kvcache_fns", lambda: (fake.with_kvcache,
                                                             fake.scheduler_metadata))
    s = spec(window=8, softcap=4.0)
    out, ref, _, batch, impl = run_step(s, MIXED, fa_version=3)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert impl.uses_paged_kv and fake.calls[-1]["window_size"] == (7, 0)
    # One FA layer config: ahead-of-time scheduling on, its metadata reaches the kernel.
    assert torch.equal(fake.calls[-1]["scheduler_metadata"], torch.tensor([123]))
    assert fake.sched_calls[-1][1]["window_size"] == (7, 0)
    assert fake.sched_calls[-1][1]["page_size"] == batch.common.block_size

    # Two distinct window configs among the FA layers: AOT scheduling off (vLLM's rule).
    other = FlashAttentionImpl(spec(layer_idx=1), fa_version=3)
    builder = FlashAttentionMetadataBuilder({"a": impl, "b": other}, "cpu")
    assert not builder.aot_schedule
    assert builder.build(batch.common).scheduler_metadata is None
