import importlib.util

import pytest
import torch

from tqattn.attention import fa_utils
from tqattn.attention import turboquant as tq
from tqattn.attention.turboquant import (TurboQuantBackend, TurboQuantImpl,
                                         TurboQuantMetadataBuilder)
from tqattn.quant import paged
from tqattn.quant.paged import gather_slots_ref
from tqattn.quant.presets import preset_names

from .batch_utils import (attention, head_major, history_batch, make_batch, num_blocks,
                          random_qkv, spec)

P = "turboquant_4bit_nc"
DECODES = [(20, 1), (5, 1), (47, 1), (0, 1)]
PREFILLS = [(0, 37), (0, 5), (0, 2)]
SHORT = [(20, 9), (33, 30), (16, 16)]           # continuations at the default threshold (32)
LONG = [(40, 150), (3, 130)]                      # chunks above it: dequant + FA
# Decodes first; a prefix-cache hit on its first scheduled chunk next to a longer fresh prompt
# (vLLM's batch-level "no prefix" test gets this wrong); a short and a long continuation.
MIXED = [(20, 1), (7, 1), (32, 10), (0, 40), (16, 20), (40, 150)]
# Not decodes-first: a one-token prompt chunk after longer chunks.
UNORDERED = [(0, 30), (20, 1), (5, 9), (3, 1), (0, 1)]


def run_step(s, reqs, *, pad=0, fa_version=None, seed=0, threshold=None, device="cpu",
             fused=False, key_offset=None, heads_first=False):
    """Store every request's history, run one step; return (out, reference, ...). fused: the
    step through ``store_and_forward`` (decode-only steps store inside the decode).

    Reference = the rule: tokens of earlier steps decoded from their stored slots, the chunk
    raw; a one-token chunk reads its own (stored) token compressed too. ``key_offset`` (Hk, D):
    the layer centers its keys; the reference adds it back to the decoded keys and reads the
    chunk's keys as they came, so it is the un-centered attention over the same codes.
    ``heads_first``: the step's q/k/v laid out head by head (:func:`head_major`).
    """
    gen = torch.Generator().manual_seed(seed)
    batch = make_batch(reqs, pad=pad, gen=gen, device=device)
    impl = TurboQuantImpl(s, fa_version=fa_version)
    if key_offset is not None:
        impl.set_key_offset(key_offset, device)
    builder = TurboQuantMetadataBuilder({s.name: impl}, device)
    if threshold is not None:
        builder.dequant_threshold = threshold
    bs = batch.common.block_size
    kv_cache = torch.zeros(TurboQuantBackend.kv_cache_shape(num_blocks(batch), bs, s),
                           dtype=torch.uint8, device=device)
    hist = history_batch(batch)
    if hist is not None:
        _, hk, hv = random_qkv(hist.common.num_actual_tokens, s, gen, device=device)
        impl.store(hk, hv, kv_cache, builder.build(hist.common))

    q, k, v = random_qkv(batch.common.num_actual_tokens + pad, s, gen, device=device)
    if heads_first:
        q, k, v = head_major(q, k, v)
    md = builder.build(batch.common)
    if fused:
        out = impl.store_and_forward(q, k, v, kv_cache, md).cpu()
    else:
        impl.store(k, v, kv_cache, md)
        out = impl.forward(q, k, v, kv_cache, md).cpu()
    q, k, v = q.cpu(), k.cpu(), v.cpu()

    codec = impl.codec()
    slots = gather_slots_ref(codec, kv_cache.cpu(), batch.block_table, batch.common.seq_lens_cpu)
    ref = torch.zeros(q.shape, dtype=torch.float32)
    qsl = batch.common.query_start_loc_cpu.tolist()
    for b, (c, n) in enumerate(reqs):
        a, e = qsl[b], qsl[b + 1]
        kc, vc = codec.folded().decode(slots[b])  # page slots: "nc" norms folded
        # a padded cache (spec.kv_cache_head_size): the head's coordinates are its first ones
        kc, vc = kc[..., :s.head_size], vc[..., :s.head_size]
        if key_offset is not None:
            kc = kc + key_offset.float()
        if n > 1:
            kc, vc = torch.cat([kc[:c], k[a:e].float()]), torch.cat([vc[:c], v[a:e].float()])
        ref[a:e] = attention(q[a:e], kc, vc, batch.q_pos[b], torch.arange(c + n), s.scale,
                             s.sliding_window, s.logits_soft_cap)
    return out, ref, md, batch


def check(out, ref, atol=1e-4):
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=1e-3)


CASES = {"prefill": (PREFILLS, None), "decode": (DECODES, None), "short": (SHORT, None),
         "long": (LONG, None), "short_as_long": (SHORT, 8), "mixed": (MIXED, None),
         "mixed_all_long": (MIXED, 1), "unordered": (UNORDERED, None)}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("window,softcap", [(None, 0.0), (8, 0.0), (None, 5.0), (24, 3.0)])
def test_matches_plain_attention_over_the_dequantized_cache(case, window, softcap):
    reqs, threshold = CASES[case]
    out, ref, md, _ = run_step(spec(kv=P, window=window, softcap=softcap), reqs,
                               threshold=threshold)
    check(out, ref)


def test_paths_taken():
    _, _, md, _ = run_step(spec(kv=P), MIXED)
    assert md.num_decodes == 2 and md.token_perm is None
    assert md.short is not None and md.short.max_query_len == 20    # (32, 10) and (16, 20)
    assert md.short.seq_lens.tolist() == [32, 16]
    assert list(md.long) == [None] and md.long[None].seq_lens.tolist() == [40]
    _, _, md, _ = run_step(spec(kv=P), MIXED, threshold=1)
    assert md.short is None and md.long[None].seq_lens.tolist() == [32, 16, 40]
    _, _, md, _ = run_step(spec(kv=P), UNORDERED)
    assert md.num_decodes == 3 and md.token_perm is not None
    # A sliding window dequantizes only whole blocks some query of the chunk can see.
    _, _, md, _ = run_step(spec(kv=P, window=8), LONG)
    assert md.long[8].seq_lens.tolist() == [40 - 32, 3]


@pytest.mark.parametrize("reqs", [DECODES, MIXED], ids=["decode_only", "mixed"])
def test_store_and_forward(monkeypatch, reqs):
    """One call instead of store + forward: decode-only steps hand the new K/V to the decode
    (which stores them first), other steps store then attend; same result, padding stays 0."""
    from tqattn import kernels
    seen = []
    real = kernels.decode_attention
    monkeypatch.setattr(kernels, "decode_attention",
                        lambda *a, **kw: seen.append(kw.get("new_kv")) or real(*a, **kw))
    out, ref, md, batch = run_step(spec(kv=P), reqs, pad=3, fused=True)
    n = batch.common.num_actual_tokens
    check(out[:n], ref[:n])
    assert out[n:].abs().max() == 0
    fused = seen[-1] is not None
    assert fused == (reqs is DECODES)
    if fused:
        assert seen[-1][0].shape[0] == n and seen[-1][2].tolist() == md.slot_mapping[:n].tolist()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("fused", [False, True], ids=["store_forward", "store_and_forward"])
@pytest.mark.parametrize("variant", ["plain", "centered", "padded"])
def test_head_major_inputs(case, fused, variant):
    """q/k/v laid out head by head (what the compiled model hands the op) give the same bytes as
    token rows on every path, into a contiguous output."""
    reqs, threshold = CASES[case]
    kw = dict(threshold=threshold, fused=fused, pad=2)
    if variant == "centered":
        kw["key_offset"] = torch.randn(2, 16, generator=torch.Generator().manual_seed(3))
    padded = variant == "padded"
    s = spec(kv=P, window=8, d=12 if padded else 16, kv_cache_head_size=16 if padded else None)
    rows, *_ = run_step(s, reqs, **kw)
    heads, *_ = run_step(s, reqs, heads_first=True, **kw)
    assert heads.is_contiguous() and torch.equal(heads, rows)


def test_padding_rows_are_zero():
    out, ref, md, batch = run_step(spec(kv=P), MIXED, pad=4)
    n = batch.common.num_actual_tokens
    check(out[:n], ref[:n])
    assert out[n:].abs().max() == 0


@pytest.mark.parametrize("preset", ["turboquant_k8v4", "turboquant_3bit_nc", "tq_k3.5v3",
                                    "tq_k4v4_qjl"])
def test_other_presets(preset):
    out, ref, *_ = run_step(spec(kv=preset, d=32), MIXED)
    check(out, ref)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("fused", [False, True], ids=["store_then_forward", "fused"])
def test_padded_cache_head_size(case, fused):
    """Head size 12 stored zero-padded to 16 (kv_cache_head_size): every path attends over the
    head's coordinates of the padded vectors' codes; the output keeps the head size."""
    reqs, threshold = CASES[case]
    s = spec(kv=P, d=12, kv_cache_head_size=16)
    out, ref, *_ = run_step(s, reqs, threshold=threshold, fused=fused, pad=2)
    assert out.shape[-1] == 12
    n = ref.shape[0] - 2
    check(out[:n], ref[:n])
    assert TurboQuantBackend.kv_cache_shape(7, 16, s) == TurboQuantBackend.kv_cache_shape(
        7, 16, spec(kv=P, d=16))


def test_padded_head_sizes_and_refusal():
    assert [tq.padded_head_size(d) for d in (32, 64, 80, 96, 128, 192, 256, 320)] == [
        64, None, 128, 128, None, 256, None, None]
    assert "below the head size" in TurboQuantBackend.unsupported_reason(
        spec(kv=P, d=16, kv_cache_head_size=8))


def test_accepts_every_preset_and_uses_the_paged_shape():
    for preset in preset_names():
        s = spec(kv=preset, d=64)
        assert TurboQuantBackend.unsupported_reason(s) is None
        codec = TurboQuantImpl(s, fa_version=None).codec()
        assert TurboQuantBackend.kv_cache_shape(7, 16, s) == paged.kv_cache_shape(7, 16, 2, codec)
        assert TurboQuantBackend.page_bytes(16, s) == 16 * 2 * codec.slot_bytes


def test_one_codec_shared_by_all_layers():
    a = TurboQuantImpl(spec(0, kv=P), fa_version=None)
    b = TurboQuantImpl(spec(5, kv=P), fa_version=None)
    assert a.codec() is b.codec() and a.codec().seed == tq.ROTATION_SEED


def test_alibi_and_sinks_are_refused():
    assert "ALiBi not supported by TURBOQUANT" in TurboQuantBackend.unsupported_reason(
        spec(kv=P, alibi=True))
    with pytest.raises(ValueError, match="attention sinks not supported by TURBOQUANT"):
        TurboQuantImpl(spec(kv=P, sinks=True))


@pytest.mark.parametrize("chosen", [2, 3])
def test_every_flash_attention_call_gets_the_layers_version(monkeypatch, chosen):
    calls = []
    real = fa_utils.flash_attn_varlen

    def spy(*args, fa_version=None, **kw):
        calls.append(fa_version)
        return real(*args, fa_version=None, **kw)

    monkeypatch.setattr(fa_utils, "flash_attn_varlen", spy)
    monkeypatch.setattr(fa_utils, "get_flash_attn_version", lambda h, alibi=False, **kw: chosen)
    s = spec(kv=P, dtype=torch.bfloat16, d=32)
    impl = TurboQuantImpl(s)
    assert impl.fa_version == chosen
    for reqs, threshold in ((PREFILLS, None), (MIXED, None), (MIXED, 1)):
        out, ref, *_ = run_step(s, reqs, fa_version=impl.fa_version, threshold=threshold)
        check(out, ref, atol=3e-2)
    assert len(calls) == 3 and set(calls) == {chosen}


# --------------------------------------------------------------------------------------------
# The same paths through the Triton kernels (interpreter on CPU)
# --------------------------------------------------------------------------------------------

def _missing(modules):
    return [m for m in modules if importlib.util.find_spec(f"tqattn.kernels.{m}") is None]


def force_triton(monkeypatch, modules):
    """Run the Triton kernels on CPU tensors; any fallback to a PyTorch reference fails."""
    missing = _missing(modules)
    if missing:
        pytest.skip(f"Triton kernel module(s) not written yet: "
                    f"{', '.join('tqattn.kernels.' + m for m in missing)}")
    monkeypatch.setenv("TQATTN_FORCE_TRITON", "1")
    from tqattn import kernels

    def refuse(*args, **kw):
        raise AssertionError("the backend fell back to a PyTorch reference")

    for name in ("store_ref", "decode_attention_ref", "dequant_ref"):
        monkeypatch.setattr(kernels.paged, name, refuse)


@pytest.mark.parametrize("reqs,threshold,window,softcap,modules", [
    # decodes, fresh prompts, short continuations: store + decode kernels
    ([(0, 1), (9, 1), (0, 5), (6, 3), (4, 5)], None, None, 0.0, ("store", "decode")),
    # decodes only: the decode call stores the step's K/V (store_and_forward)
    ([(0, 1), (9, 1), (17, 1)], None, None, 0.0, ("store", "decode")),
    # decode, short and long continuations, window and soft-cap: + the dequant kernel
    ([(9, 1), (6, 3), (18, 4)], 2, 4, 2.0, ("store", "decode", "dequant")),
], ids=["store_decode", "decode_only_fused", "with_dequant"])
@pytest.mark.parametrize("d", [16, 12], ids=["d16", "d12_padded_16"])
def test_triton_kernels(monkeypatch, reqs, threshold, window, softcap, modules, d):
    force_triton(monkeypatch, modules)
    s = spec(kv=P, hq=4, hk=2, d=d, window=window, softcap=softcap,
             kv_cache_head_size=16 if d != 16 else None)
    out, ref, *_ = run_step(s, reqs, threshold=threshold, fused=True)
    check(out, ref, atol=2e-3)
    # q/k/v head by head (the compiled model's layout): the kernels take the strides
    heads, *_ = run_step(s, reqs, threshold=threshold, fused=True, heads_first=True)
    assert torch.equal(heads, out)
