"""A Gemma-3-like model mixing TurboQuant, full-precision full-attention and full-precision
sliding-window layers: it builds, its FlashAttention builder looks only at FlashAttention layers,
and one step runs through every layer (the model vLLM crashed on, #40092)."""

import pytest
import torch

from tqattn.attention import fa_utils
from tqattn.attention import flash_attn as fa_mod
from tqattn.attention.flash_attn import FlashAttentionBackend, FlashAttentionMetadataBuilder
from tqattn.attention.selector import (build_attention_layers, build_metadata_builders,
                                       describe_plan, resolve_kv_cache_dtypes)
from tqattn.attention.turboquant import TurboQuantBackend, TurboQuantMetadataBuilder
from tqattn.quant.paged import gather_slots_ref

from .batch_utils import attention, history_batch, make_batch, num_blocks, random_qkv, spec
from .test_flash_attn import FakeFA3

P = "turboquant_k3v4_nc"
WINDOWS = [8, 8, 8, None, 8, 8, 8, None, 8, 8, 8, None]   # 3 local : 1 global
STEP = [(20, 1), (7, 1), (32, 10), (0, 40), (40, 150)]


def gemma_like_layers(dtype=torch.float32):
    dtypes = resolve_kv_cache_dtypes(len(WINDOWS), WINDOWS, P, ["sliding_window"],
                                     boundary_layers=1)
    specs = [spec(i, hq=4, hk=2, d=16, dtype=dtype, kv=kv, window=w, softcap=30.0)
             for i, (kv, w) in enumerate(zip(dtypes, WINDOWS))]
    return build_attention_layers(specs, block_size=16)


def test_routing_groups_and_plan():
    layers = gemma_like_layers()
    tq_layers = [l.spec.layer_idx for l in layers if l.backend is TurboQuantBackend]
    assert tq_layers == [3, 7]                      # global layers minus the last (boundary)
    fa = [l for l in layers if l.backend is FlashAttentionBackend]
    assert {l.spec.sliding_window for l in fa} == {8, None}   # sliding + full-attention FA
    assert {l.group for l in fa} == {0} and {layers[3].group} == {1}
    plan = describe_plan(gemma_like_layers(torch.bfloat16), 16)
    assert plan["backends"] == {"FLASH_ATTN": 10, "TURBOQUANT": 2}
    bf16 = 2 * 2 * 16 * 2
    tq = TurboQuantBackend.page_bytes(16, layers[3].spec) / 16
    assert plan["bytes_per_token"] == 10 * bf16 + 2 * tq
    assert plan["capacity_vs_bf16"] == pytest.approx(12 * bf16 / (10 * bf16 + 2 * tq))


def test_flash_attention_builder_gathers_only_its_own_layers(monkeypatch):
    fake = FakeFA3()
    monkeypatch.setattr(fa_mod, "_fa3_kvcache_fns", lambda: (fake.with_kvcache,
                                                             fake.scheduler_metadata))
    monkeypatch.setattr(fa_utils, "get_flash_attn_version", lambda *a, **k: 3)
    versions = []
    real = fa_utils.flash_attn_varlen

    def spy(*args, fa_version=None, **kw):          # FA3 varlen -> SDPA on CPU
        versions.append(fa_version)
        return real(*args, fa_version=None, **kw)

    monkeypatch.setattr(fa_utils, "flash_attn_varlen", spy)
    layers = gemma_like_layers(torch.float16)       # FA3 as on Hopper
    builders = build_metadata_builders(layers, "cpu")
    fa_builder, tq_builder = builders
    assert isinstance(fa_builder, FlashAttentionMetadataBuilder)
    assert isinstance(tq_builder, TurboQuantMetadataBuilder)
    # Every layer's impl is offered; the TurboQuant ones are left out, not asserted on.
    assert len(fa_builder.layers) == 12 and len(fa_builder.fa_layers) == 10
    assert fa_builder.sliding_window_configs() == {(7, 0), (-1, 0)}
    assert not fa_builder.aot_schedule              # two window configs: no AOT schedule
    assert tq_builder.gather_windows == {None}      # the TQ layers are global
    # ... and the step runs: FA layers through the paged FA3 entry point, TQ layers with FA3.
    for out, ref in run_model_step(layers, STEP):
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    assert len(fake.calls) == 10 and set(versions) == {3}


def run_model_step(layers, reqs, seed=0):
    """One step through every layer (each with its own cache and random q/k/v) after storing
    each request's history; returns [(out, reference)] per layer."""
    gen = torch.Generator().manual_seed(seed)
    batch = make_batch(reqs, gen=gen)
    hist = history_batch(batch)
    builders = build_metadata_builders(layers, "cpu")
    md = [b.build(batch.common) for b in builders]
    hist_md = [b.build(hist.common) for b in builders]
    qsl = batch.common.query_start_loc_cpu.tolist()
    hqsl = hist.common.query_start_loc_cpu.tolist()
    hist_rows = [b for b, (c, _) in enumerate(reqs) if c > 0]
    results = []
    for layer in layers:
        s, impl = layer.spec, layer.impl
        cache = torch.zeros(layer.backend.kv_cache_shape(num_blocks(batch), 16, s),
                            dtype=layer.backend.kv_cache_torch_dtype(s))
        _, hk, hv = random_qkv(hist.common.num_actual_tokens, s, gen)
        impl.store(hk, hv, cache, hist_md[layer.group])
        q, k, v = random_qkv(batch.common.num_actual_tokens, s, gen)
        impl.store(k, v, cache, md[layer.group])
        out = impl.forward(q, k, v, cache, md[layer.group])

        ref = torch.zeros(q.shape)
        slots = None
        if layer.backend is TurboQuantBackend:
            slots = gather_slots_ref(impl.codec(), cache, batch.block_table,
                                     batch.common.seq_lens)
        for b, (c, n) in enumerate(reqs):
            a, e = qsl[b], qsl[b + 1]
            if slots is not None:       # the TurboQuant rule
                kb, vb = impl.codec().folded().decode(slots[b])  # page form
                if n > 1:
                    kb, vb = torch.cat([kb[:c], k[a:e]]), torch.cat([vb[:c], v[a:e]])
            elif c:                     # full precision: the raw history
                i = hist_rows.index(b)
                ha, he = hqsl[i], hqsl[i + 1]
                kb, vb = torch.cat([hk[ha:he], k[a:e]]), torch.cat([hv[ha:he], v[a:e]])
            else:
                kb, vb = k[a:e], v[a:e]
            ref[a:e] = attention(q[a:e], kb, vb, batch.q_pos[b], torch.arange(c + n), s.scale,
                                 s.sliding_window, s.logits_soft_cap)
        results.append((out, ref))
    return results


def test_one_step_runs_through_every_layer():
    for out, ref in run_model_step(gemma_like_layers(), STEP):
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-3)
