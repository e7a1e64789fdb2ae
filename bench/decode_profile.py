"""Per-kernel GPU time of one decode call (torch.profiler, CUDA activity), to see where the
time of a small decode step goes (store, split kernel, merge).

    PYTHONPATH=. python3 bench/decode_profile.py --shape 8x16384 [--heads 32/8/128] [--preset P] \\
        [--splits N] [--new-kv]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import environment  # noqa: E402
from bench.decode import fill_cache, make_data  # noqa: E402
from tqattn.kernels.decode import decode_attention_triton  # noqa: E402
from tqattn.quant.codec import TQCodec  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8x16384")
    ap.add_argument("--heads", default="32/8/128", help="query heads / KV heads / head size")
    ap.add_argument("--preset", default="turboquant_k3v4_nc")
    ap.add_argument("--splits", type=int, default=None, help="split count (default: auto)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--new-kv", action="store_true",
                    help="the step's new K/V stored inside the decode call (new_kv)")
    args = ap.parse_args()
    print(json.dumps({**environment(), "command": "python3 " + " ".join(sys.argv)}), flush=True)
    b, l = map(int, args.shape.split("x"))
    hq, hk, d = map(int, args.heads.split("/"))
    q, k, v, bt = make_data(b, l, hq, hk, d)
    codec = TQCodec(args.preset, d, device="cuda")
    cache = fill_cache(codec, k, v, hk)
    lens = torch.full((b,), l, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    tune = {"num_splits": args.splits}
    if args.new_kv:
        kn, vn = torch.randn(2, b, hk, d, dtype=q.dtype, device="cuda")
        tune["new_kv"] = (kn, vn, bt[:, -1].long() * 16 + 15)
    for _ in range(3):
        decode_attention_triton(codec, q, cache, bt, lens, out=out, **tune)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.reps):
            decode_attention_triton(codec, q, cache, bt, lens, out=out, **tune)
        torch.cuda.synchronize()
    print(f"B={b} L={l} {args.heads} {args.preset} splits={args.splits or 'auto'}: per call, µs")
    total = 0.0
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
        if e.device_time_total <= 0:
            continue
        us = e.device_time_total / args.reps
        total += us
        print(f"  {us:8.1f}  x{e.count // args.reps}  {e.key[:90]}")
    print(f"  {total:8.1f}  total kernel time")


if __name__ == "__main__":
    main()
