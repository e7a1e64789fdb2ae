"""Single-sequence decode speed on the CPU per KV-cache dtype: the embedded SmolLM2 in fp32, one
long prompt, greedy, a fixed number of new tokens (ignore_eos).

Decode tokens/s = (new tokens − 1) / (time from the first token to the last), as `tqattn
generate --json` reports it. Each dtype gets a fresh LLM (prefix caching off) and a 4-token
warm-up generate of the same prompt before the timed one. The 1-minute load average is recorded before and after every timed
run: the machine may be shared, and the figure is only meaningful when it stays below the core
count used by torch; ``cpu_s_per_wall_s`` (process CPU time over wall time of the timed generate)
shows whether the run had its threads' cores.

    PYTHONPATH=. python3 bench/cpu_decode.py --kv-cache-dtypes auto,tq_k4v3,turboquant_k3v4_nc \\
        --prompt-len 2900 --max-tokens 128 --threads 1 --json bench/results/cpu_decode_smollm2_1thread.json
    PYTHONPATH=. python3 bench/cpu_decode.py --kv-cache-dtypes tq_k4v3 --profile 25
        (cProfile of the timed decode, the 25 costliest functions by own time)
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import os
import platform
import pstats
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqattn import LLM, SamplingParams  # noqa: E402
from tqattn.attention.env_report import collect_env  # noqa: E402


def prompt_ids(llm: LLM, n: int, seed: int) -> list[int]:
    """n token ids of gsm_symbolic worked solutions (real text, so attention is not uniform)."""
    from tqattn.evals.data import gsm_cot_text

    tok = llm.tokenizer
    items = 64
    while True:
        ids = tok(gsm_cot_text(items, seed), add_special_tokens=False)["input_ids"]
        if len(ids) >= n:
            return ids[:n]
        items *= 2


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def run_one(kv: str, args) -> dict:
    llm = LLM(model=args.model, kv_cache_dtype=kv, max_model_len=args.prompt_len + args.max_tokens + 16,
              enable_prefix_caching=False)
    ids = prompt_ids(llm, args.prompt_len, args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": ids}], warm, use_tqdm=False)
    load_before = os.getloadavg()[0]
    prof = cProfile.Profile() if args.profile else None
    start, cpu_start = time.perf_counter(), time.process_time()
    if prof:
        prof.enable()
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    end, cpu_end = time.perf_counter(), time.process_time()
    if prof:
        prof.disable()
    first = out.metrics.first_token_time
    n_new = len(out.outputs[0].token_ids)
    res = {"kv_cache_dtype": kv, "prompt_tokens": len(ids), "new_tokens": n_new,
           "prefill_s": round(first - start, 3), "decode_s": round(end - first, 3),
           "decode_tok_s": round((n_new - 1) / (end - first), 3),
           "cpu_s_per_wall_s": round((cpu_end - cpu_start) / (end - start), 2),
           "load_avg_1min_before": load_before, "load_avg_1min_after": os.getloadavg()[0]}
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.profile)
        res["profile"] = s.getvalue()
    del llm
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--kv-cache-dtypes", default="auto,tq_k4v3,turboquant_k3v4_nc")
    ap.add_argument("--prompt-len", type=int, default=2900)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--profile", type=int, default=0, help="print a cProfile of the timed run, N rows")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    for kv in args.kv_cache_dtypes.split(","):
        r = run_one(kv.strip(), args)
        print(f"{r['kv_cache_dtype']:22s} decode {r['decode_tok_s']:7.2f} tok/s  prefill "
              f"{r['prefill_s']:.1f} s  load {r['load_avg_1min_before']:.2f} -> "
              f"{r['load_avg_1min_after']:.2f}", flush=True)
        if "profile" in r:
            print(r.pop("profile"))
        results.append(r)
    base = next((r["decode_tok_s"] for r in results if r["kv_cache_dtype"] == "auto"), None)
    for r in results:
        r["vs_auto"] = round(r["decode_tok_s"] / base, 3) if base else None
    doc = {"command": "PYTHONPATH=. python3 " + shlex.join(["bench/cpu_decode.py"] + sys.argv[1:]),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
           "cpu": _cpu_model(),
           "env": collect_env(), "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
