"""Where a step's host time goes on CUDA, and every device synchronization it makes.

Runs the engine on a small workload that mixes decodes with new prompts (the cache-bound and
chat workloads' shape: decodes running when a long prompt is admitted) and reports

* per step kind, the mean host time of each part of ``LLMEngine.step`` (schedule, the input
  buffers' wait for the previous copies, input building, each metadata builder, the forward
  launch, sampling, the wait for the previous step's tokens) — wrappers around the engine's own
  methods, so a part that blocks on the device shows the device's remaining work;
* every synchronization torch's sync debug mode reports after start-up, grouped by the stack of
  tqattn frames that made it, with the step kind it happened in.

    python bench/step_syncs.py --model qwen3-tiny --kv-cache-dtypes auto,turboquant_k3v4_nc \\
        --out $OUT/step_syncs.json

CUDA only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
import warnings
from collections import Counter, defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import environment  # noqa: E402
from bench.host_step import INPUT_BATCH_METHODS  # noqa: E402
from bench.host_step import _timed as _wrap  # noqa: E402
from tqattn import LLM, SamplingParams  # noqa: E402
from tqattn.engine import model_runner  # noqa: E402

_current = {"kind": "startup"}


def _kind(scheduled) -> str:
    nd = sum(1 for s in scheduled if s.num_scheduled_tokens == 1 and s.num_computed_tokens > 0)
    return "decode" if nd == len(scheduled) else "prefill" if nd == 0 else "mixed"


def run(model: str, kv_cache_dtype: str, prompt_len: int, max_num_seqs: int) -> dict:
    llm = LLM(model, load_format="dummy", dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
              device="cuda", max_model_len=prompt_len + 256, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=prompt_len, kv_cache_memory_bytes=2 << 30,
              enable_prefix_caching=False)
    engine = llm.llm_engine
    runner = engine.runner
    acc: dict[str, float] = defaultdict(float)
    _wrap(engine.scheduler, "schedule", acc, "schedule")
    _wrap(runner.input_batch, "_wait_for_copies", acc, "wait_for_copies")
    for name in INPUT_BATCH_METHODS:
        _wrap(runner.input_batch, name, acc, "input_batch")
    for b in runner.builders:
        _wrap(b, "build", acc, f"build[{type(b).__name__}]")
    _wrap(runner, "_call_model", acc, "forward")
    _wrap(runner.sampler, "sample", acc, "sample")
    _wrap(engine, "_complete", acc, "complete (waits for tokens)")
    launch = runner.launch

    def timed_launch(scheduled, *a, **k):
        _current["kind"] = _kind(scheduled)
        t = time.perf_counter()
        try:
            return launch(scheduled, *a, **k)
        finally:
            acc["launch (total)"] += time.perf_counter() - t
    runner.launch = timed_launch
    feed = model_runner.apply_feed
    _wrap(model_runner, "apply_feed", acc, "feed")  # the name the runner calls

    syncs: Counter = Counter()

    def on_warning(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "tqattn" in f.filename]
        stack = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-6:]))
        syncs[(_current["kind"], str(message).split("\n")[0][:80], stack)] += 1

    vocab = engine.model_info.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(0, vocab, (prompt_len,), generator=g).tolist()}
               for _ in range(2 * max_num_seqs)]
    params = [SamplingParams(temperature=0, max_tokens=24 + 16 * i, ignore_eos=True)
              for i in range(len(prompts))]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm the allocator
    steps: dict[str, list[dict]] = defaultdict(list)
    step = engine.step

    def timed_step():
        acc.clear()
        t = time.perf_counter()
        out = step()
        steps[_current["kind"]].append({"total": time.perf_counter() - t, **acc})
        return out
    engine.step = timed_step
    old = warnings.showwarning
    warnings.showwarning = on_warning
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = old
        model_runner.apply_feed = feed  # the next dtype's run wraps it afresh
    parts = {}
    for kind, rows in steps.items():
        keys = sorted({k for r in rows for k in r})
        parts[kind] = {"steps": len(rows), **{k: 1e3 * sum(r.get(k, 0.0) for r in rows) / len(rows)
                                               for k in keys}}
    return {"kv_cache_dtype": kv_cache_dtype, "mean_host_ms_per_step": parts,
            "syncs": [{"kind": k, "message": m, "stack": s, "count": c}
                      for (k, m, s), c in syncs.most_common()]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-tiny")
    p.add_argument("--kv-cache-dtypes", default="auto,turboquant_k3v4_nc")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    results = [run(a.model, kv, a.prompt_len, a.max_num_seqs) for kv in a.kv_cache_dtypes.split(",")]
    out = {"command": " ".join(sys.argv), "env": environment(), "model": a.model, "results": results}
    Path(a.out).write_text(json.dumps(out, indent=1))
    for r in results:
        print(r["kv_cache_dtype"])
        for kind, d in r["mean_host_ms_per_step"].items():
            print(f"  {kind}: " + ", ".join(f"{k} {v:.2f}" if k != "steps" else f"{v} steps" for k, v in d.items()))
        for s in r["syncs"][:12]:
            print(f"  sync x{s['count']} in {s['kind']}: {s['message']} | {s['stack']}")


if __name__ == "__main__":
    main()
