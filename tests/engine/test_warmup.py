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
