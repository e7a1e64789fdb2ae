"""The start-up warm-up: which step kinds it runs, within the limits, through the normal path."""

from __future__ import annotations

import pytest

from tqattn.attention.turboquant import CONTINUATION_DEQUANT_THRESHOLD as THR
from tqattn.engine.warmup import run_warmup, warmup_steps

from .test_llm_reference import _one_thread  # noqa: F401


@pytest.mark.parametrize("seqs,budget,max_len,bs", [(256, 8192, 40960, 16), (4, 64, 64, 16),
                                                    (8, 2048, 256, 32), (1, 16, 16, 16)])
def test_steps_fit_the_limits_and_cover_the_kinds(seqs, budget, max_len, bs):
    steps = warmup_steps(seqs, budget, max_len, bs)
    assert len(steps) == len(set(steps))
    for step in steps:
        assert 0 < len(step) <= seqs and sum(n for _, n in step) <= budget
        assert all(n >= 1 and c + n <= max_len for c, n in step)
        kinds = [c > 0 and n == 1 for c, n in step]
        assert kinds == sorted(kinds, reverse=True)  # decodes first
    decode_batches = {len(s) for s in steps if all(c > 0 and n == 1 for c, n in s)}
    prefill_sizes = {s[0][1] for s in steps if len(s) == 1 and s[0][0] == 0}
    assert {1, seqs} <= decode_batches and min(budget, max_len) in prefill_sizes
    if seqs > 1 and max_len > 40:
        assert any(s[0][1] == 1 and s[-1][0] == 0 and s[-1][1] > 1 for s in steps)  # mixed
        short = {n for s in steps for c, n in s if c > 0 and 1 < n <= THR}
        assert {2, 4, 8, 16, THR} <= short
        assert any(c > 0 and n > THR for s in steps for c, n in s)  # a long continuation
        assert any(len(s) > 1 and s[0][1] == 1 and any(c > 0 and n > THR for c, n in s)
                   for s in steps)  # and mixed with decodes


def test_warmup_runs_every_turboquant_path(monkeypatch):
    """Through a real (tiny) model: the builder sees decode-only, mixed, short and long
    continuation batches; the block manager is untouched."""
    pytest.importorskip("transformers")
    from tqattn import LLM
    from tqattn.attention.turboquant import TurboQuantMetadataBuilder

    llm = LLM("qwen3-tiny", load_format="dummy", kv_cache_dtype="turboquant_k3v4_nc",
              max_model_len=512, max_num_seqs=4, max_num_batched_tokens=128)
    seen = []
    build = TurboQuantMetadataBuilder.build

    def spy(self, common):
        md = build(self, common)
        seen.append((md.num_decodes, md.num_prefills, md.short is not None, bool(md.long)))
        return md

    monkeypatch.setattr(TurboQuantMetadataBuilder, "build", spy)
    engine = llm.llm_engine
    steps = warmup_steps(4, 128, 512, 16)
    run_warmup(engine.runner, steps)
    assert len(seen) == len(steps)
    assert (1, 0, False, False) in seen and (4, 0, False, False) in seen  # decodes
    assert any(d and p and not s and not lg for d, p, s, lg in seen)     # mixed, first chunks
    assert any(s and not d for d, p, s, lg in seen)                       # short continuation
    assert any(lg and not d for d, p, s, lg in seen)                      # long continuation
    assert any(d and s and lg for d, p, s, lg in seen)                    # all in one step
    bm = engine.block_manager
    assert all(bm.num_free_blocks(g) == n for g, n in enumerate(bm.num_blocks))


def test_steps_add_the_backends_token_counts_and_a_full_mixed_step():
    steps = warmup_steps(16, 512, 4096, 16, token_counts=[7, 300, 9000])
    prefill_sizes = {s[0][1] for s in steps if len(s) == 1 and s[0][0] == 0}
    assert {7, 300, 512} <= prefill_sizes  # 9000 clipped to the budget
    # the most decodes a mixed step can carry (the decode kernel's split count may be 1 there)
    assert any(len(s) == 16 and s[-1][0] == 0 and all(n == 1 for _, n in s[:-1]) for s in steps)


@pytest.mark.parametrize("preset,hk", [("turboquant_k3v4_nc", 8), ("turboquant_k3v4_nc", 1),
                                       ("tq_k4v3", 2), ("turboquant_k8v4", 4)])
def test_store_token_counts_reach_every_store_build(preset, hk):
    store = pytest.importorskip("tqattn.kernels.store")
    from tqattn.kernels._spec import kernel_spec
    from tqattn.attention.turboquant import get_codec

    codec = get_codec(preset, 128)
    spec = kernel_spec(codec, 16)
    counts = store.warmup_token_counts(codec, hk, 16, "cpu", 2048)  # "cpu": 4 SMs stand in
    builds = {store._launch_variant(spec, n * hk, "cpu") for n in range(1, 2049)}
    assert len(builds) > 1 and len(counts) == len(builds)
    assert {store._launch_variant(spec, n * hk, "cpu") for n in counts} == builds


def test_backend_token_counts_asks_once_per_backend_and_settings():
    import torch

    from tqattn.attention.backend import AttentionLayerSpec
    from tqattn.engine.warmup import backend_token_counts

    asked = []

    class Backend:
        @staticmethod
        def warmup_token_counts(spec, block_size, device, max_tokens):
            asked.append(spec.layer_idx)
            return [spec.num_kv_heads, max_tokens]

    class Layer:
        def __init__(self, i, hk):
            self.backend = Backend
            self.spec = AttentionLayerSpec(i, 8, hk, 128, 0.1, torch.bfloat16, "tq_k4v3")

    layers = [Layer(0, 2), Layer(1, 2), Layer(2, 4), Layer(3, 2)]
    assert backend_token_counts(layers, 16, "cpu", 64) == [2, 4, 64]
    assert len(asked) == 2   # layers 0, 1 and 3 share their settings
