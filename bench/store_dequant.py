"""Store and dequant kernel configurations at prefill sizes (H200), to pick their defaults.

store: one step of N new tokens (8 KV heads, head size 128) for several rows-per-program, and
at decode sizes (--decode: N = 8..128) for several rotation chunks / warps;
dequant: an 8K compressed prefix of B sequences → bf16 K/V for several (tokens per program,
warps). Same timing as the other benchmarks (CUDA-graph replay, L2 flushed, median). The sizes
are the kernels' module constants, set for each timing (``sizes``).

    PYTHONPATH=. python3 bench/store_dequant.py --out bench/results/store_dequant_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import Timer, environment  # noqa: E402
from tqattn.kernels import dequant, store  # noqa: E402
from tqattn.kernels.dequant import dequant_kv_triton  # noqa: E402
from tqattn.kernels.store import store_kv_triton  # noqa: E402
from tqattn.quant import paged  # noqa: E402
from tqattn.quant.codec import TQCodec  # noqa: E402

HK, D, BS = 8, 128, 16


def time_store(timer, codec, n, rows_per_program, block_k=None, num_warps=None):
    nb = n // BS + 1
    cache = torch.zeros(paged.kv_cache_shape(nb, BS, HK, codec), dtype=torch.uint8, device="cuda")
    k, v = torch.randn(2, n, HK, D, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(nb * BS, device="cuda")[:n]
    consts = {"ROWS_PER_PROGRAM": rows_per_program}
    if block_k:   # decode-size steps (the sweep's n ≤ 128 tokens)
        consts.update(DECODE_BLOCK_K=block_k, DECODE_WARPS=num_warps)
    with mock.patch.multiple(store, **consts):  # the module's launch-size constants
        return timer.graph_us(lambda: store_kv_triton(codec, k, v, cache, slots))


def profiled_store_us(codec, n, reps=50):
    from torch.profiler import ProfilerActivity, profile
    nb = n // BS + 1
    cache = torch.zeros(paged.kv_cache_shape(nb, BS, HK, codec), dtype=torch.uint8, device="cuda")
    k, v = torch.randn(2, n, HK, D, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(nb * BS, device="cuda")[:n]
    store_kv_triton(codec, k, v, cache, slots)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            store_kv_triton(codec, k, v, cache, slots)
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages()) / reps


def time_dequant(timer, codec, batch, ctx, block_n, warps):
    nblk = ctx // BS
    cache = torch.randint(0, 256, paged.kv_cache_shape(batch * nblk, BS, HK, codec),
                          dtype=torch.uint8, device="cuda")
    cache.view(-1)[:] = 60  # finite fp16 norms / scales everywhere (0x3C3C ≈ 1.06)
    table = torch.randperm(batch * nblk, device="cuda").view(batch, nblk).to(torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * ctx
    out = tuple(torch.empty(batch * ctx, HK, D, dtype=torch.bfloat16, device="cuda")
                for _ in range(2))
    with mock.patch.multiple(dequant, BLOCK_N=block_n, NUM_WARPS=warps):
        return timer.graph_us(lambda: dequant_kv_triton(codec, cache, table, lens, cu, ctx,
                                                        torch.bfloat16, out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="turboquant_k3v4_nc")
    ap.add_argument("--out", default=None)
    ap.add_argument("--decode", action="store_true", help="only the decode-size store sweep")
    args = ap.parse_args()
    codec = TQCodec(args.preset, D)
    timer = Timer()
    rows = []
    if args.decode:
        # the method's floor: one trivial kernel, timed the same way
        tiny = torch.zeros(1, device="cuda")
        r = {"kernel": "floor (one 1-element kernel)", **timer.graph_us(lambda: tiny.add_(1))}
        rows.append(r)
        print(json.dumps(r), flush=True)
        for n in (32,):
            r = {"kernel": "store (profiler: kernel time, no flush)", "tokens": n,
                 "us": profiled_store_us(codec, n)}
            rows.append(r)
            print(json.dumps(r), flush=True)
        for n in (8, 32, 128):
            for bk, w in ((32, 4), (64, 4), (128, 8)):
                r = {"kernel": "store", "tokens": n, "rows_per_program": 16, "block_k": bk,
                     "num_warps": w, **time_store(timer, codec, n, 16, block_k=bk, num_warps=w)}
                rows.append(r)
                print(json.dumps(r), flush=True)
        _save(args, rows)
        return
    for n in (32, 2048, 16384):
        for hb in (16, 32, 64, 128):
            r = {"kernel": "store", "tokens": n, "rows_per_program": hb,
                 **time_store(timer, codec, n, hb)}
            rows.append(r)
            print(json.dumps(r), flush=True)
    for batch in (1, 8):
        for bn, w in ((32, 4), (64, 4), (64, 8), (128, 4), (128, 8)):
            r = {"kernel": "dequant", "batch": batch, "ctx": 8192, "block_n": bn, "num_warps": w,
                 **time_dequant(timer, codec, batch, 8192, bn, w)}
            r["gbs_out"] = 2 * batch * 8192 * HK * D * 2 / r["us"] / 1e3
            rows.append(r)
            print(json.dumps(r), flush=True)
    _save(args, rows)


def _save(args, rows):
    if args.out:
        env = environment()
        with open(args.out, "w") as f:
            json.dump({"env": env, "preset": args.preset, "hk": HK, "d": D, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
