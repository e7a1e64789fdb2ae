"""Engine start-up with empty and with warm compile caches, each in a fresh process.

For each kv-cache dtype: a new cache directory (TQATTN_CACHE_DIR, which holds Inductor's and
Triton's caches), then two processes one after the other that each build the engine and
report ``startup_times`` — the first finds the caches empty, the second warm. Nothing else is
run, so the parts (load, compile, warm-up, graph capture) are the whole start-up.

    python3 bench/startup.py --model Qwen3-4B --kv-cache-dtypes auto,turboquant_k3v4_nc \\
        --out $OUT/startup.json

Issue 24's bound for Qwen3-4B: <= 120 s with empty caches, <= 45 s with warm ones. Each run also
says how the warm-up got its Triton builds (from the disk cache / compiled) and what the kernel
precompile did (tqattn/engine/precompile.py, on by default: ``--precompile on`` sets
TQATTN_PRECOMPILE=1 in the child's environment, ``off`` sets 0).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import environment  # noqa: E402
from tqattn.benchmarks.report import describe_builds  # noqa: E402

CHILD = """
import json, sys, time
t = time.perf_counter()
from tqattn import LLM
llm = LLM(**json.loads(sys.argv[1]))
e = llm.llm_engine
print("STARTUP " + json.dumps({"startup_times": e.startup_times, "wall_s": time.perf_counter() - t,
                               "compile_model": e.runner.compile_model,
                               "graphs": sorted(e.runner.graphs),
                               "builds": e.startup_builds}))
"""


def start_once(kwargs: dict, cache_dir: str, precompile: str = "on") -> dict:
    env = dict(os.environ, TQATTN_CACHE_DIR=cache_dir)
    env["TQATTN_PRECOMPILE"] = "1" if precompile == "on" else "0"
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):  # follow TQATTN_CACHE_DIR
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(kwargs)], env=env,
                          capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("STARTUP ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"start-up process failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("STARTUP "):])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="Qwen3-4B")
    p.add_argument("--kv-cache-dtypes", default="auto,turboquant_k3v4_nc")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--device", default=None)
    p.add_argument("--precompile", default="on",
                   help="on, off or on,off: with the kernel precompile, without, or both in turn")
    p.add_argument("--out", default="startup.json")
    args = p.parse_args()
    import torch

    env = environment() if torch.cuda.is_available() else {"device": "cpu", "torch": torch.__version__}
    result = {"env": env, "args": vars(args), "runs": {}}
    settings = args.precompile.split(",")
    for dtype, pre in [(d, s) for d in args.kv_cache_dtypes.split(",") for s in settings]:
        kwargs = dict(model=args.model, load_format="dummy", kv_cache_dtype=dtype,
                      max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens,
                      enable_prefix_caching=False, device=args.device)
        with tempfile.TemporaryDirectory(prefix="tqattn-startup-") as cache_dir:
            runs = {"empty": start_once(kwargs, cache_dir, pre),
                    "warm": start_once(kwargs, cache_dir, pre)}
        name = dtype if settings == ["on"] else f"{dtype} precompile {pre}"
        result["runs"][name] = runs
        for state, r in runs.items():
            parts = ", ".join(f"{k} {v:.1f}" for k, v in r["startup_times"].items())
            print(f"{name:20s} {state:5s} caches: {parts} s (process wall {r['wall_s']:.1f} s)",
                  flush=True)
            print(f"{'':26s} {describe_builds(r.get('builds', {}))}", flush=True)
        # after every dtype, so that a run cut short by a time limit keeps what it measured
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
