"""Offline throughput: one workload, several kv-cache dtypes, identical engine arguments.

For each dtype an engine starts (its start-up timed), optionally generates a short warm-up
batch, then generates the workload's prompts — random token ids (seeded), ``ignore_eos`` so every
output has exactly ``output_len`` tokens, prefix caching off — with the engine's step timeline
on. The engine is released before the next dtype starts.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from dataclasses import dataclass

import torch

from . import report

logger = logging.getLogger(__name__)

GiB = 1 << 30


@dataclass(frozen=True)
class Workload:
    name: str
    num_prompts: int
    input_len: int
    output_len: int
    kv_cache_memory_bytes: int | None = None  # the workload's KV budget (None: the engine's sizing)
    description: str = ""


WORKLOADS = {w.name: w for w in [
    Workload("latency", 1, 1024, 256, description="one request: the decode step at batch 1"),
    Workload("decode-heavy", 256, 1024, 1024, description="a full decode batch for a long time"),
    Workload("chat", 512, 1024, 256, description="more requests than max_num_seqs: prefill and decode mix"),
    Workload("cache-bound", 64, 8192, 1024, kv_cache_memory_bytes=8 * GiB,
             description="an 8 GiB KV cache holds only a few sequences (a large model's situation)"),
]}


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_prompts, input_len), generator=g).tolist()


def _diff(after: dict, before: dict) -> dict:
    """What compiled between two compilation_counts(): counts subtract, name lists keep the tail."""
    return {k: (v[len(before.get(k, [])):] if isinstance(v, list) else v - before.get(k, 0))
            for k, v in after.items()}


def _attention_versions(engine) -> list[dict]:
    """Per layer: backend, kv-cache dtype and the FlashAttention version its prefill calls (None = SDPA)."""
    return [{"layer": layer.spec.layer_idx, "backend": layer.backend.name,
             "kv_cache_dtype": layer.spec.kv_cache_dtype, "fa_version": layer.impl.fa_version,
             **({"paged_fa3_decode": layer.impl.uses_paged_kv} if hasattr(layer.impl, "uses_paged_kv") else {})}
            for layer in sorted(engine.layers, key=lambda layer: layer.spec.layer_idx)]


def run_dtype(model: str, kv_cache_dtype: str, workload: Workload, engine_kwargs: dict, *,
              seed: int = 0, temperature: float = 0.0, warmup_prompts: int = 0) -> dict:
    """Start an engine with kv_cache_dtype, run the workload once, return its measurements."""
    from tqattn import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, kv_cache_dtype=kv_cache_dtype, **engine_kwargs)
    startup_s = time.perf_counter() - t0
    engine = llm.llm_engine
    tp = engine.args.tensor_parallel_size
    try:
        vocab = engine.model_info.vocab_size
        prompts = [{"prompt_token_ids": p}
                   for p in random_prompts(workload.num_prompts, workload.input_len, vocab, seed)]
        params = SamplingParams(temperature=temperature, max_tokens=workload.output_len, ignore_eos=True)
        if warmup_prompts:
            warm = [{"prompt_token_ids": p}
                    for p in random_prompts(warmup_prompts, workload.input_len, vocab, seed + 1)]
            llm.generate(warm, dataclasses.replace(params, max_tokens=min(workload.output_len, 16)),
                         use_tqdm=False)
        engine.reset_stats()
        engine.record_steps()
        counts_before = engine.compilation_counts()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        counts_after = engine.compilation_counts()
        records = engine.step_records
        engine.record_steps(False)
        stats = engine.stats()
        result = {
            "kv_cache_dtype": kv_cache_dtype,
            "engine_args": dataclasses.asdict(engine.args),
            "elapsed_s": elapsed,
            **report.request_metrics(outputs, elapsed),
            "steps": report.step_summary(records),
            "step_check": report.step_check(records),
            "compilations_after_startup": counts_after,  # the engine counts from the end of start-up
            "compilations_in_run": _diff(counts_after, counts_before),
            "kv_capacity_tokens": engine.plan["cache_tokens"],
            "kv_cache_bytes": engine.plan["cache_bytes"] * tp,  # all ranks
            "kv_bytes_per_token": engine.plan["bytes_per_token"] * tp,
            # tensor parallelism: every rank holds every token's cache for its KV heads
            "tensor_parallel_size": tp,
            "kv_cache_bytes_per_rank": engine.plan["cache_bytes"],
            "q_heads_per_rank": engine.plan["q_heads_per_rank"],
            "kv_heads_per_rank": engine.plan["kv_heads_per_rank"],
            "peak_concurrent_seqs": stats["max_num_running"],
            "num_preemptions": stats["num_preemptions"],
            "num_recomputed_tokens": stats["num_recomputed_tokens"],
            "num_computed_tokens": stats["num_computed_tokens"],
            "startup_s": startup_s,
            "startup_times": dict(engine.startup_times),
            # what the warm-up loaded or compiled, and the parallel precompile's summary
            "startup_builds": dict(engine.startup_builds),
            "attention": _attention_versions(engine),
            "plan_groups": engine.plan["groups"],
            "timeline": report.timeline_columns(records),
        }
        result["output_tok_s_per_rank"] = result["output_tok_s"] / tp
        result["recomputed_fraction_of_prompt_tokens"] = (
            result["num_recomputed_tokens"] / max(result["input_tokens"], 1))
        return result
    finally:
        llm.shutdown()  # the next dtype's engine starts its own ranks
        del llm, engine
        _release_memory()


def _release_memory() -> None:
    """Free the engine's device memory before the next dtype's engine sizes its cache."""
    gc.collect()
    if not torch.cuda.is_available():
        return
    torch.cuda.empty_cache()
    left = torch.cuda.memory_allocated()
    if left > GiB:  # the next engine's gpu_memory_utilization sizing would see it as in use
        logger.warning("%.2f GiB of CUDA memory still allocated after releasing the engine; the next "
                       "engine's KV cache is sized around it (run one dtype per process to avoid it)",
                       left / GiB)


def run_throughput(model: str, kv_cache_dtypes: list[str], workload: Workload, engine_kwargs: dict, *,
                   seed: int = 0, temperature: float = 0.0, warmup_prompts: int = 0,
                   command: str = "") -> dict:
    """The benchmark's result: the workload, the shared engine arguments, one entry per dtype."""
    from tqattn.attention.env_report import collect_env

    results = []
    for dtype in kv_cache_dtypes:
        logger.info("throughput %s: kv_cache_dtype=%s", workload.name, dtype)
        results.append(run_dtype(model, dtype, workload, engine_kwargs, seed=seed, temperature=temperature,
                                 warmup_prompts=warmup_prompts))
    return {"benchmark": "throughput", "command": command, "model": model,
            "workload": dataclasses.asdict(workload), "kv_cache_dtypes": list(kv_cache_dtypes),
            "engine_kwargs": engine_kwargs, "seed": seed, "temperature": temperature,
            "warmup_prompts": warmup_prompts, "env": collect_env(), "results": results}
