"""On a CUDA GPU: decode through CUDA graphs equals eager decode; memory-utilization sizing."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tqattn import LLM, SamplingParams  # noqa: E402

from .test_llm_reference import random_prompts  # noqa: E402

pytestmark = pytest.mark.gpu

COMMON = dict(load_format="dummy", max_model_len=256, max_num_seqs=8, dtype="float32", device="cuda",
              kv_cache_memory_bytes=64 << 20)


def spy_replays(runner) -> list[int]:
    """The number of sequences of each step the runner replays a CUDA graph for, appended as
    the steps run."""
    replays = []
    run_step = runner.run_step

    def spy(host, *args, **kwargs):
        if host.bucket is not None:
            replays.append(host.num_reqs)
        return run_step(host, *args, **kwargs)

    runner.run_step = spy
    return replays


def _run(llm):
    prompts = [{"prompt_token_ids": p} for p in random_prompts([3, 17, 40, 64, 9, 100])]
    # different lengths, so the decode batch shrinks through several graph buckets
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (30, 5, 12, 20, 8, 16)]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("name,kwargs", [
    ("qwen3-tiny", dict(kv_cache_dtype="turboquant_k3v4_nc")),
    ("gemma3-tiny", dict(kv_cache_dtype="tq_k3v4")),
    ("llama-tiny", {}),                                                    # FLASH_ATTN only
    ("qwen3-tiny", dict(kv_cache_dtype="tq_k3v4", kv_cache_boundary_layers=1)),  # both backends
])
def test_cudagraph_decode_equals_eager(name, kwargs):
    kwargs = {**COMMON, **kwargs}
    eager = LLM(name, enforce_eager=True, **kwargs)
    graphs = LLM(name, **kwargs)
    runner = graphs.llm_engine.runner
    assert sorted(runner.graphs) == [1, 2, 4, 8] and not eager.llm_engine.runner.graphs
    replays = spy_replays(runner)
    assert _run(graphs) == _run(eager)
    assert set(replays) >= {1, 2, 6}


def test_memory_profile():
    llm = LLM("llama-tiny", load_format="dummy", max_model_len=256, max_num_seqs=8, device="cuda",
              gpu_memory_utilization=0.5)
    assert sorted(llm.llm_engine.runner.graphs) == [1, 2, 4, 8]  # FLASH_ATTN decode is graph-safe
    free, total = torch.cuda.mem_get_info()
    assert 0 < llm.kv_cache_plan["cache_bytes"] < 0.5 * total
    assert len(_run(llm)) == 6
