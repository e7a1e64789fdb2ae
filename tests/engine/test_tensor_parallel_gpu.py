"""On two GPUs of one host (kind nvidia-h100-x2): Llama-3.1-8B with dummy weights split over two
ranks (NCCL, compiled model, decode CUDA graphs) against one GPU, teacher-forced.

    python -m pytest -m gpu tests/engine/test_tensor_parallel_gpu.py -s -k auto
    python -m pytest -m gpu tests/engine/test_tensor_parallel_gpu.py -s -k turboquant

(one dtype per command: each starts two 8B engines, compiled, within a 10-minute command.)

Each dtype scores the same 512 random token ids twice per engine: one token per step (the decode
path: every query reads the cache, compressed on TurboQuant layers) and 256-token chunks
(prefill, then a continuation). Agreement: top-1 of each position's log-probs, and the cosine of
the centred log-prob rows (the logits less their mean: what softmax sees, free of log-softmax's
shift). Throughput is measured by `tqattn bench throughput --tensor-parallel-size 2` (README,
Tensor parallelism).
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

pytest.importorskip("transformers")

from tqattn import LLM  # noqa: E402

from .test_llm_reference import random_prompts  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                                 reason="needs two GPUs (machine kind nvidia-h100-x2)")]

ENGINE = dict(load_format="dummy", dtype="bfloat16", max_model_len=1024, max_num_seqs=16,
              max_num_batched_tokens=512, kv_cache_memory_bytes=2 << 30, enable_prefix_caching=False)
VOCAB = 128256  # Llama-3.1-8B


def _agreement(lp: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    top1 = (lp.argmax(-1) == ref.argmax(-1)).float().mean().item()
    a, b = lp - lp.mean(-1, keepdim=True), ref - ref.mean(-1, keepdim=True)
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1).mean().item()
    return top1, cosine


def _scores(llm: LLM, ids: list[int]) -> dict[int, torch.Tensor]:
    return {chunk: llm.score(ids, chunk_size=chunk) for chunk in (1, 256)}


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "turboquant_k3v4_nc"])
def test_two_gpus_agree_with_one_teacher_forced(kv_cache_dtype):
    ids = random_prompts([512], vocab=VOCAB, seed=31)[0]
    one = LLM("Llama-3.1-8B", kv_cache_dtype=kv_cache_dtype, **ENGINE)
    assert one.llm_engine.runner.graphs and one.llm_engine.runner.compile_model
    ref = _scores(one, ids)
    del one
    gc.collect()
    torch.cuda.empty_cache()

    tp = LLM("Llama-3.1-8B", kv_cache_dtype=kv_cache_dtype, tensor_parallel_size=2, **ENGINE)
    plan = tp.kv_cache_plan
    assert (plan["q_heads_per_rank"], plan["kv_heads_per_rank"]) == (16, 4)
    assert tp.llm_engine.runner.graphs and tp.llm_engine.runner.compile_model
    print(tp.describe_kv_cache())
    try:
        for chunk, lp in _scores(tp, ids).items():
            top1, cosine = _agreement(lp, ref[chunk])
            print(f"{kv_cache_dtype} chunk_size={chunk}: top-1 agreement {top1:.4f}, cosine {cosine:.6f}")
            assert top1 >= 0.99 and cosine >= 0.999, (kv_cache_dtype, chunk, top1, cosine)
        assert tp.llm_engine.compilation_counts()["total"] == 0  # nothing compiled after start-up
    finally:
        pids = [p.pid for p in tp.llm_engine.workers.procs]
        tp.shutdown()
        for pid in pids:  # the worker left with its engine
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
