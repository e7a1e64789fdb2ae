"""The scheduler alone on the cache-bound workload at full size (no model): admissions,
preemptions and recomputed tokens per policy, in seconds on a CPU.

A fake step advances every scheduled sequence (sampling token 0, ignore_eos), so the counts are
exactly what the engine's scheduler would do on the GPU for the same cache size and budget.

    python bench/preemption_sim.py [--json bench/results/preemption_sim.json]

Policies: ``reserve`` (the scheduler as it is), ``greedy`` (admission without the growth
reserve, least-computed victim), and ``before`` (the scheduler source of --before-commit:
greedy admission, latest-arrival victim), loaded with ``git show``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tqattn.engine.block_manager import BlockManager  # noqa: E402
from tqattn.engine.config import SchedulerConfig  # noqa: E402
from tqattn.engine.scheduler import Scheduler  # noqa: E402
from tqattn.engine.sequence import Sequence  # noqa: E402

# Qwen3-4B: 36 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes; turboquant_k3v4_nc holds 4.34x the tokens.
BF16_BYTES_PER_TOKEN = 36 * 8 * 128 * 2 * 2
CACHES = {"auto": 8 * 2**30 // BF16_BYTES_PER_TOKEN, "turboquant_k3v4_nc": int(8 * 2**30 / BF16_BYTES_PER_TOKEN * 4.34)}


class _SP:
    def __init__(self, max_tokens):
        self.max_tokens, self.ignore_eos = max_tokens, True


def _scheduler_class(policy: str, before_commit: str):
    if policy == "before":
        src = subprocess.run(["git", "-C", str(ROOT), "show", f"{before_commit}:tqattn/engine/scheduler.py"],
                             check=True, capture_output=True, text=True).stdout
        mod = types.ModuleType("tqattn.engine._scheduler_before")
        mod.__package__ = "tqattn.engine"
        sys.modules[mod.__name__] = mod  # dataclasses look their module up
        exec(compile(src, f"{before_commit}:scheduler.py", "exec"), mod.__dict__)
        return mod.Scheduler
    if policy == "greedy":
        return type("GreedyScheduler", (Scheduler,), {"_fits_with_reserve": lambda *a: True})
    return Scheduler


def simulate(policy, cache_tokens, *, num_prompts, input_len, output_len, block_size, budget, max_num_seqs,
             before_commit):
    cls = _scheduler_class(policy, before_commit)
    cfg = SchedulerConfig(max_model_len=input_len + output_len, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=budget, block_size=block_size, enable_prefix_caching=False)
    bm = BlockManager(cache_tokens // block_size, block_size, False)
    sched = cls(cfg, bm)
    seqs = [Sequence([i % 1000] * input_len, _SP(output_len)) for i in range(num_prompts)]
    for s in seqs:
        sched.add(s)
    steps = {"prefill": 0, "mixed": 0, "decode": 0}
    tokens = {"prefill": 0, "mixed": 0, "decode": 0}
    preemptions = peak = recomputed = 0
    high = {id(s): 0 for s in seqs}
    t0 = time.perf_counter()
    while sched.has_unfinished():
        out = sched.schedule()
        nd, n = out.num_decodes, len(out.scheduled)
        kind = "decode" if nd == n else "prefill" if nd == 0 else "mixed"
        steps[kind] += 1
        tokens[kind] += out.num_batched_tokens
        preemptions += len(out.preempted)
        peak = max(peak, len(sched.running))
        for s in out.scheduled:  # counted here too: the `before` scheduler has no stats
            end = s.num_computed_tokens + s.num_scheduled_tokens
            recomputed += max(0, min(end, high[id(s.seq)]) - s.num_computed_tokens)
            high[id(s.seq)] = max(high[id(s.seq)], end)
        sched.update_from_output(out, {s.seq.seq_id: 0 for s in out.scheduled if s.samples})
    assert all(bm.num_free_blocks(g) == nb for g, nb in enumerate(bm.num_blocks))
    prompt_tokens = num_prompts * input_len
    return {"policy": policy, "cache_tokens": cache_tokens, "seqs_in_cache": cache_tokens / (input_len + output_len),
            "steps": steps, "tokens": tokens, "preemptions": preemptions, "peak_running": peak,
            "recomputed_tokens": recomputed, "recomputed_pct_of_prompt": 100 * recomputed / prompt_tokens,
            "prefill_and_mixed_tokens": tokens["prefill"] + tokens["mixed"], "sim_s": time.perf_counter() - t0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=8192)
    ap.add_argument("--output-len", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--before-commit", default="678b68e")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = []
    for dtype, cache in CACHES.items():
        for policy in ("before", "greedy", "reserve"):
            r = simulate(policy, cache, num_prompts=args.num_prompts, input_len=args.input_len,
                         output_len=args.output_len, block_size=args.block_size, budget=args.max_num_batched_tokens,
                         max_num_seqs=args.max_num_seqs, before_commit=args.before_commit)
            r["kv_cache_dtype"] = dtype
            rows.append(r)
            print(f"{dtype:>20} {policy:>8}: cache {r['seqs_in_cache']:.1f} seqs, peak {r['peak_running']:>3} running, "
                  f"{r['preemptions']:>3} preemptions, recomputed {r['recomputed_tokens']:>7} tokens "
                  f"({r['recomputed_pct_of_prompt']:.1f} % of prompt), steps {r['steps']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": "python " + " ".join(sys.argv), "args": vars(args),
                                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
