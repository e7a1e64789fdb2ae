"""TurboQuant presets through the engine: equal to the chunked reference for the same chunking,
under chunked prefill, prefix caching, preemption and batching; mixed per-layer routing."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tqattn import LLM, SamplingParams  # noqa: E402
from tqattn.attention.flash_attn import FlashAttentionMetadataBuilder  # noqa: E402
from tqattn.engine.scheduler import Scheduler  # noqa: E402

from .test_llm_reference import (ChunkedReference, _one_thread, engine_key_offsets,  # noqa: E402,F401
                                 random_prompts, record_chunks)

SMALL = dict(load_format="dummy", max_model_len=128, max_num_seqs=4)
N = 12
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)


def _run(name, prompts, **kwargs):
    llm = LLM(name, **{**SMALL, **kwargs})
    chunks = record_chunks(llm)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    bm = llm.llm_engine.block_manager
    bm.check_invariants([])
    assert all(bm.num_free_blocks(g) == n for g, n in enumerate(bm.num_blocks))
    return llm, [o.outputs[0].token_ids for o in outputs], [chunks[o.request_id] for o in outputs]


def _donor_chunks(prompts, chunks, r):
    """A prefix-cache hit reads blocks another request wrote: that request's chunks up to the
    hit, so the reference computes the prefix's K/V as the engine did (the codes of K/V that an
    earlier chunk saw compressed are not those of one whole-prefix chunk)."""
    start = chunks[r][0][0]
    if start == 0:
        return []
    for d, ch in enumerate(chunks):
        if d != r and ch[0][0] == 0 and prompts[d][:start] == prompts[r][:start]:
            out, done = [], 0
            for a, n in ch:
                if a == done and done < start:
                    out.append((a, min(n, start - a)))
                    done = a + out[-1][1]
            if done == start:
                return out
    return []


def _check_against_reference(name, kv_dtypes, prompts, tokens, chunks, llm):
    ref = ChunkedReference(name, kv_dtypes, engine_key_offsets(llm))
    for r, (prompt, toks, ch) in enumerate(zip(prompts, tokens, chunks)):
        assert toks == ref.generate(prompt, N, _donor_chunks(prompts, chunks, r) + ch), ch


@pytest.mark.parametrize("name,preset", [("llama-tiny", "turboquant_k3v4_nc"),
                                         ("qwen2-tiny", "turboquant_k8v4"),
                                         ("qwen3-tiny", "tq_k3.5v3"),
                                         ("gemma3-tiny", "tq_k3v4")])
def test_equals_chunked_reference(name, preset):
    prompts = random_prompts([1, 16, 17, 40])
    llm, tokens, chunks = _run(name, prompts, kv_cache_dtype=preset)
    assert llm.kv_cache_plan["backends"] == {"TURBOQUANT": llm.llm_engine.model_info.num_layers}
    _check_against_reference(name, preset, prompts, tokens, chunks, llm)


SHARED = random_prompts([40], seed=7)[0]
PROMPTS = [SHARED[:35] + p for p in random_prompts([6, 19], seed=3)] + random_prompts([50, 5], seed=4)


@pytest.mark.slow
@pytest.mark.parametrize("config", [
    dict(max_num_batched_tokens=16),  # prompts in several chunks: continuations read compressed
    dict(num_gpu_blocks_override=8),  # preemption: resumes from its own cached blocks
    dict(num_gpu_blocks_override=8, enable_prefix_caching=False),  # preemption: recomputed
])
def test_scheduling_follows_the_reference(config, monkeypatch):
    if "num_gpu_blocks_override" in config:  # admission without a reserve for growth: preemptions
        monkeypatch.setattr(Scheduler, "_fits_with_reserve", lambda *a: True)
    preset = "turboquant_4bit_nc"
    llm, tokens, chunks = _run("gemma3-tiny", PROMPTS, kv_cache_dtype=preset, **config)
    _check_against_reference("gemma3-tiny", preset, PROMPTS, tokens, chunks, llm)
    if config.get("enable_prefix_caching") is False:
        assert any(s == 0 for ch in chunks for s, _ in ch[1:])  # some request was recomputed


def test_prefix_cache_hits_and_batching():
    preset = "tq_k4v3"
    llm = LLM("qwen3-tiny", **SMALL, kv_cache_dtype=preset)
    ids = [{"prompt_token_ids": p} for p in PROMPTS]
    first = llm.generate(ids, GREEDY, use_tqdm=False)
    chunks = record_chunks(llm)
    again = llm.generate(ids, GREEDY, use_tqdm=False)
    # the second run continues from the compressed blocks of the first
    assert [o.num_cached_tokens for o in again] == [32, 48, 48, 0]
    tokens = [o.outputs[0].token_ids for o in again]
    _check_against_reference("qwen3-tiny", preset, PROMPTS, tokens, [chunks[o.request_id] for o in again], llm)
    # where the quantized history is the same, the outputs are: batching changes nothing
    _, alone, _ = _run("qwen3-tiny", PROMPTS, kv_cache_dtype=preset, max_num_seqs=1,
                       enable_prefix_caching=False)
    assert alone == [o.outputs[0].token_ids for o in first]


@pytest.mark.parametrize("routing,expected", [
    # (sliding windows of gemma3-tiny: layers 0-2 slide over 8 tokens, layer 3 is full)
    (dict(kv_cache_dtype_skip_layers=["sliding_window"]), ["auto", "auto", "auto", "tq"]),
    (dict(kv_cache_boundary_layers=1), ["auto", "tq", "tq", "auto"]),
    (dict(kv_cache_dtype_skip_layers=[0, "3"], kv_cache_boundary_layers=0), ["auto", "tq", "tq", "auto"]),
    (dict(kv_cache_dtype_skip_layers=[1]), ["tq", "auto", "tq", "tq"]),
])
def test_mixed_routing_on_gemma3(routing, expected):
    preset = "turboquant_k3v4_nc"
    kv_dtypes = [preset if e == "tq" else "auto" for e in expected]
    prompts = random_prompts([20, 33], seed=9)
    llm, tokens, chunks = _run("gemma3-tiny", prompts, kv_cache_dtype=preset, max_num_batched_tokens=24,
                               **routing)
    engine = llm.llm_engine
    assert [layer.spec.kv_cache_dtype for layer in engine.layers] == kv_dtypes
    assert [layer.backend.name for layer in engine.layers] == \
        ["TURBOQUANT" if e == "tq" else "FLASH_ATTN" for e in expected]
    groups = engine.kv_cache_config.groups
    assert len(groups) == 2 and engine.block_manager.num_blocks[0] == engine.block_manager.num_blocks[1]
    # the FlashAttention builder gathers the windows of its own layers only
    fa = [b for b in engine.runner.builders if isinstance(b, FlashAttentionMetadataBuilder)][0]
    windows = {(7, 0) if i < 3 else (-1, 0) for i, e in enumerate(expected) if e == "auto"}
    assert fa.sliding_window_configs() == windows
    _check_against_reference("gemma3-tiny", kv_dtypes, prompts, tokens, chunks, llm)


def test_cache_plan():
    llm = LLM("llama-tiny", **SMALL, kv_cache_dtype="turboquant_k3v4_nc", kv_cache_memory_bytes=1 << 20)
    plan = llm.kv_cache_plan
    # head size 16: 3-bit keys (6 B) + fp16 norm + 4-bit values (8 B) + fp16 scale and min = 20 B
    # per token and KV head, x 2 KV heads x 2 layers; bf16 K+V: 2 x 16 x 2 B = 64 B, x 4
    assert plan["bytes_per_token"] == 80 and plan["bf16_bytes_per_token"] == 256
    assert plan["capacity_vs_bf16"] == 3.2
    assert plan["num_blocks"] == (1 << 20) // (80 * 16)
    assert plan["cache_tokens"] == plan["num_blocks"] * 16
    assert plan["bf16_cache_tokens"] == plan["cache_bytes"] // 256
    text = llm.describe_kv_cache()
    assert "TURBOQUANT x2" in text and "80.0 bytes/token" in text


@pytest.mark.parametrize("head_dim,preset", [(12, "tq_k3o4v3.5"), (14, "tq_k4v3"), (14, "turboquant_k3v4_nc"),
                                             (12, "tq_k2.5v2.5")])
def test_head_sizes_whose_codes_are_not_whole_words(tmp_path, head_dim, preset):
    # 6 or 14 codes of 3 bits: these once passed validation and crashed in the paged store
    import json

    from tqattn.models.configs import model_config_path

    config = json.loads(model_config_path("llama-tiny").read_text())
    config.update(head_dim=head_dim)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    prompts = random_prompts([5, 21], seed=head_dim)
    llm, tokens, chunks = _run(str(path), prompts, kv_cache_dtype=preset)
    _check_against_reference(str(path), preset, prompts, tokens, chunks, llm)
