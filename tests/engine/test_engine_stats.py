"""The engine's step timeline and scheduler counters on a tiny model (CPU)."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("transformers")

from tqattn import LLM, SamplingParams  # noqa: E402

from .test_llm_reference import _one_thread, random_prompts  # noqa: E402,F401


def test_step_records_add_up():
    llm = LLM("llama-tiny", load_format="dummy", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=32, enable_prefix_caching=False)
    engine = llm.llm_engine
    assert engine.step_records is None  # off unless asked
    engine.record_steps()
    prompts = [{"prompt_token_ids": p} for p in random_prompts([40, 7, 19, 3, 25], seed=1)]
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    elapsed_ms = (time.perf_counter() - t) * 1e3
    records, stats = engine.step_records, engine.stats()
    kv_tokens = sum(len(o.prompt_token_ids) + 6 - 1 for o in outs)
    assert sum(r.num_tokens for r in records) == stats["num_computed_tokens"] == kv_tokens
    assert stats["num_recomputed_tokens"] == stats["num_preemptions"] == 0
    assert 1 <= stats["max_num_running"] <= 4
    kinds = {r.kind for r in records}
    assert kinds <= {"decode", "prefill", "mixed"} and {"decode", "prefill"} <= kinds
    for r in records:
        assert r.num_tokens <= 32 and 1 <= r.num_seqs <= 4 and 0 <= r.num_decodes <= r.num_seqs
        assert (r.kind == "decode") == (r.num_decodes == r.num_seqs)
        assert (r.kind == "prefill") == (r.num_decodes == 0)
        assert r.graph_bucket is None  # CPU: no graphs
        assert r.host_ms > 0 and r.wall_ms > 0
    # each step's wall time is its own interval of the run: they never add up to more
    assert sum(r.wall_ms for r in records) <= elapsed_ms
    engine.reset_stats()
    assert engine.stats()["num_computed_tokens"] == 0
    engine.record_steps(False)
    assert engine.step_records is None
