import dataclasses

import pytest
import torch

from tqattn.attention import fa_utils
from tqattn.attention.backend import CommonAttentionMetadata
from tqattn.attention import flash_attn as fa_mod
from tqattn.attention.flash_attn import (FlashAttentionBackend, FlashAttentionImpl,
                                         FlashAttentionMetadataBuilder, scatter_rows)

from .batch_utils import (BLOCK_SIZE, attention, head_major, history_batch, make_batch,
                          num_blocks, random_qkv, spec)

DECODES = [(20, 1), (5, 1), (47, 1)]
PREFILLS = [(0, 37), (0, 5), (0, 1)]
CONTINUATIONS = [(20, 9), (33, 40), (16, 16)]
# Decodes first, a prefix-cache hit on its first chunk, a fresh prompt, a long continuation.
MIXED = [(20, 1), (7, 1), (32, 10), (0, 30), (40, 150)]


def run_step(s, reqs, *, pad=0, fa_version=None, seed=0, device="cpu", heads_first=False):
    """Store each request's history, then run one step; return (out, reference, cache, ...).
    ``heads_first``: the step's q/k/v laid out head by head (:func:`head_major`)."""
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
    if heads_first:
        q, k, v = head_major(q, k, v)
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


@pytest.mark.parametrize("reqs", [PREFILLS, CONTINUATIONS, DECODES, MIXED],
                         ids=["prefill", "continuation", "decode", "mixed"])
def test_head_major_inputs(reqs):
    """q/k/v laid out head by head (what the compiled model hands the op): the same bytes in
    the output (contiguous) and the cache as token rows."""
    s = spec(window=8)
    rows, _, cache_rows, *_ = run_step(s, reqs, pad=2)
    heads, _, cache_heads, *_ = run_step(s, reqs, pad=2, heads_first=True)
    assert heads.is_contiguous() and torch.equal(heads, rows)
    assert torch.equal(cache_heads, cache_rows)


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
    # along dim 1 (K and V of a (2, slots, ...) cache at once): the same rule in each plane
    planes = torch.arange(24.0).view(2, 6, 2)
    before = planes.clone()
    scatter_rows(planes, torch.tensor([-1, -1]), torch.full((2, 2, 2), 99.0), dim=1)
    assert torch.equal(planes, before)
    src = torch.arange(100.0, 116.0).view(2, 4, 2)
    scatter_rows(planes, torch.tensor([-1, 4, -1, 1]), src, dim=1)
    expect = before.clone()
    expect[:, 4], expect[:, 1] = src[:, 1], src[:, 3]
    assert torch.equal(planes, expect)


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


# --------------------------------------------------------------------------------------------
# Pure decode: graph-safe paged path (metadata = views, fixed shapes for a fixed batch size)
# --------------------------------------------------------------------------------------------


def _filled_cache(s, nblk, gen):
    """A cache whose every slot holds random K/V (what other requests or stale steps left)."""
    shape = FlashAttentionBackend.kv_cache_shape(nblk, BLOCK_SIZE, s)
    return torch.randn(shape, generator=gen).to(s.dtype)


def _decode_ref(s, q, kv_cache, table, seq_lens):
    """Plain attention of each decode row over the cache positions [0, seq_len)."""
    ref = torch.zeros(q.shape, dtype=torch.float32)
    for b, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        pos = torch.arange(n)
        slots = table[b, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
        k, v = (kv_cache[i].flatten(0, 1)[slots] for i in (0, 1))
        ref[b:b + 1] = attention(q[b:b + 1], k, v, pos[-1:], pos, s.scale, s.sliding_window,
                                 s.logits_soft_cap)
    return ref


def _bucket_common(seq_lens, table, slots):
    """The runner's graph-bucket metadata: one token per row, padding rows seq_len 0, slot −1."""
    bs = len(seq_lens)
    ones = torch.ones(bs, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=torch.arange(bs + 1, dtype=torch.int32, device=seq_lens.device),
        seq_lens=seq_lens,
        num_computed_tokens=(seq_lens - 1).clamp_min(0), block_table=table, slot_mapping=slots,
        query_start_loc_cpu=torch.arange(bs + 1, dtype=torch.int32), seq_lens_cpu=ones,
        num_computed_tokens_cpu=ones, num_reqs=bs, num_actual_tokens=bs, max_query_len=1,
        max_seq_len=table.shape[1] * BLOCK_SIZE, num_decodes=bs, num_decode_tokens=bs,
        block_size=BLOCK_SIZE)


@pytest.mark.parametrize("window,softcap", [(None, 0.0), (8, 0.0), (20, 3.0)])
def test_pure_decode_equals_the_planned_gather_path(window, softcap):
    s = spec(hq=8, hk=2, window=window, softcap=softcap)
    gen = torch.Generator().manual_seed(1)
    batch = make_batch([(20, 1), (5, 1), (47, 1), (0, 1), (63, 1)], gen=gen)  # shuffled blocks
    kv_cache = _filled_cache(s, num_blocks(batch), gen)
    q = torch.randn(5, 8, 16, generator=gen)
    impl = FlashAttentionImpl(s, fa_version=None)
    builder = FlashAttentionMetadataBuilder({s.name: impl}, "cpu")
    md = builder.build(batch.common)
    assert md.decode_only and not md.kv_gathers
    out = impl.forward(q, q[:, :2], q[:, :2], kv_cache, md)
    planned = builder.build(dataclasses.replace(batch.common, num_decodes=0))
    assert not planned.decode_only and planned.kv_gathers
    # The gather path packs [cached prefix ‖ raw chunk]; the chunk's K/V are what the cache holds.
    slots = batch.common.slot_mapping
    k, v = (kv_cache[i].flatten(0, 1)[slots] for i in (0, 1))
    torch.testing.assert_close(out, impl.forward(q, k, v, kv_cache, planned), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out, _decode_ref(s, q, kv_cache, batch.block_table,
                                                batch.common.seq_lens), atol=2e-5, rtol=1e-4)


def test_padded_bucket_rows_are_finite_and_leave_the_cache_alone():
    s = spec(window=12, softcap=4.0)
    gen = torch.Generator().manual_seed(2)
    batch = make_batch([(20, 1), (40, 1), (7, 1)], gen=gen)
    nblk, width = num_blocks(batch), 8  # the bucket's table is wider than any request needs
    kv_cache = _filled_cache(s, nblk, gen)
    table = torch.randint(0, nblk, (5, width), generator=gen, dtype=torch.int32)  # stale ids
    table[:3, :batch.block_table.shape[1]] = batch.block_table
    table[3:] = 0
    seq_lens = torch.tensor([21, 41, 8, 0, 0], dtype=torch.int32)
    slots = torch.cat([batch.common.slot_mapping, torch.tensor([-1, -1])])
    q, k, v = random_qkv(5, s, gen)
    impl = FlashAttentionImpl(s, fa_version=None)
    md = FlashAttentionMetadataBuilder({s.name: impl}, "cpu").build(
        _bucket_common(seq_lens, table, slots))
    before = kv_cache.clone()
    impl.store(k, v, kv_cache, md)
    changed = (kv_cache != before).any(0).flatten(0, 1).flatten(1).any(1).nonzero().flatten()
    assert set(changed.tolist()) <= set(batch.common.slot_mapping.tolist())
    out = impl.forward(q, k, v, kv_cache, md)
    assert torch.isfinite(out).all() and out[3:].abs().max() == 0
    torch.testing.assert_close(out[:3], _decode_ref(s, q, kv_cache, table, seq_lens)[:3],
                               atol=2e-5, rtol=1e-4)


def test_decode_metadata_is_reused_by_rewriting_its_buffers():
    """What a CUDA graph needs: build once over static buffers, then each step only rewrites
    their contents; forward with the same metadata equals a fresh build of that step."""
    s = spec(hq=8, hk=2, window=24)
    gen = torch.Generator().manual_seed(3)
    nblk, width, bucket = 40, 6, 4
    kv_cache = _filled_cache(s, nblk, gen)
    static = dict(seq_lens=torch.zeros(bucket, dtype=torch.int32),
                  table=torch.zeros(bucket, width, dtype=torch.int32),
                  slots=torch.full((bucket,), -1, dtype=torch.int64))
    impl = FlashAttentionImpl(s, fa_version=None)
    builder = FlashAttentionMetadataBuilder({s.name: impl}, "cpu")
    md = builder.build(_bucket_common(static["seq_lens"], static["table"], static["slots"]))
    assert md.seq_lens.data_ptr() == static["seq_lens"].data_ptr()
    assert md.block_table.data_ptr() == static["table"].data_ptr()
    for step, reqs in enumerate([[(20, 1), (5, 1), (47, 1)], [(21, 1), (80, 1)],
                                 [(0, 1), (30, 1), (95, 1), (6, 1)]]):
        batch = make_batch(reqs, gen=gen, extra_blocks=nblk - sum(-(-(c + 1) // 16)
                                                                  for c, _ in reqs))
        n, w = len(reqs), batch.block_table.shape[1]
        for t in static.values():
            t.fill_(0 if t.dtype == torch.int32 else -1)
        static["seq_lens"][:n] = batch.common.seq_lens
        static["table"][:n, :w] = batch.block_table
        static["slots"][:n] = batch.common.slot_mapping
        q, k, v = random_qkv(bucket, s, gen)
        fresh_cache = kv_cache.clone()
        impl.store(k, v, kv_cache, md)
        out = impl.forward(q, k, v, kv_cache, md)
        fresh = builder.build(batch.common)  # the eager step: n rows, its own table width
        impl.store(k[:n], v[:n], fresh_cache, fresh)
        assert torch.equal(kv_cache, fresh_cache), step
        torch.testing.assert_close(out[:n], impl.forward(q[:n], k[:n], v[:n], fresh_cache, fresh),
                                   atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(out[:n], _decode_ref(s, q[:n], kv_cache, batch.block_table,
                                                        batch.common.seq_lens),
                                   atol=2e-5, rtol=1e-4)
        assert out[n:].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_chunking(dtype):
    """Any chunk size gives the same result, including rows whose early chunks are all masked
    (window) and a row that sees nothing."""
    gen = torch.Generator().manual_seed(4)
    k_cache, v_cache = torch.randn(2, 30, 4, 2, 8, generator=gen).to(dtype)
    table = torch.randperm(30, generator=gen)[:24].view(3, 8).to(torch.int32)
    seq_lens = torch.tensor([29, 0, 7], dtype=torch.int32)
    q = torch.randn(3, 6, 8, generator=gen).to(dtype)
    kw = dict(window=9, softcap=2.0)
    whole = fa_mod.paged_decode_attention(q, k_cache, v_cache, table, seq_lens, 0.3, **kw)
    for chunk in (1, 3):
        torch.testing.assert_close(fa_mod.paged_decode_attention(
            q, k_cache, v_cache, table, seq_lens, 0.3, chunk_blocks=chunk, **kw), whole,
            atol=1e-5, rtol=1e-5)
    assert whole.dtype == dtype and whole[1].abs().max() == 0
    pos = torch.arange(29)
    slots = table[0, pos // 4].long() * 4 + pos % 4
    ref = attention(q[:1], k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots], pos[-1:],
                    pos, 0.3, 9, 2.0)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(whole[:1].float(), ref, atol=tol, rtol=tol)


def test_fa3_paged_path_serves_pure_decode_without_aot_metadata(monkeypatch):
    fake = FakeFA3()
    monkeypatch.setattr(fa_mod, "_fa3_kvcache_fns", lambda: (fake.with_kvcache,
                                                             fake.scheduler_metadata))
    s = spec(window=8, softcap=4.0)
    out, ref, _, batch, impl = run_step(s, DECODES, fa_version=3)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    # AOT metadata depends on the step's lengths: a graph replaying decode can't reuse it.
    assert len(fake.calls) == 1 and fake.calls[0]["scheduler_metadata"] is None
    assert not fake.sched_calls
