"""Split-count sweep of the tensor-core decode kernel at engine-like decode batches (many
sequences, short and unequal contexts, the step's new token stored in the launch): the time per
split count against the product's default choice (decode._decode_mma: one wave of resident
programs), timed as bench/decode.py times it (CUDA-graph replay, L2 flushed, median).

    PYTHONPATH=. python3 bench/lab/split_sweep.py --presets turboquant_k3v4_nc,tq_k4v3 \\
        --shapes 256x1024-1280,128x1024-1280 --splits 1,2,3,4 --out $OUT/split_sweep.json

``--heads 4/1/256 --shapes 32x16384-16384``: a long-context shape of another head layout.
``--maxnreg 255,168,128``: each sweep again with the kernel's register cap at each value (more
resident programs per SM, at the price of spills; the default split count follows the cap).
``--l2-ahead N``: the tiles ahead whose blocks the loop prefetches into L2 (``L2_AHEAD_64``,
``L2_AHEAD_128``: head sizes 64 and 128; head 256 picks its own, ``_loop256``), set before the
first launch compiles the kernel (one value per process).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.common import Timer, environment  # noqa: E402
from bench.decode import BS, fill_cache, make_data  # noqa: E402
from tqattn.kernels import decode_mma  # noqa: E402
from tqattn.kernels.decode import decode_attention_triton  # noqa: E402
from tqattn.kernels._spec import num_sms  # noqa: E402
from tqattn.quant.codec import TQCodec  # noqa: E402


def case(timer, preset, b, lo, hi, splits, hq=32, hk=8, d=128):
    q, k, v, bt = make_data(b, hi, hq, hk, d)
    codec = TQCodec(preset, d, device="cuda")
    cache = fill_cache(codec, k, v, hk)
    gen = torch.Generator().manual_seed(1)
    seq_lens = torch.randint(lo, hi + 1, (b,), generator=gen).to(torch.int32).cuda()
    kn = torch.randn(b, hk, d, dtype=torch.bfloat16, device="cuda")
    vn = torch.randn(b, hk, d, dtype=torch.bfloat16, device="cuda")
    pos = seq_lens.long() - 1
    slots = bt.gather(1, (pos // BS)[:, None]).squeeze(1).long() * BS + pos % BS
    out = torch.empty_like(q)
    tokens = int(seq_lens.sum())
    row = {"preset": preset, "B": b, "ctx": f"{lo}-{hi}", "tokens": tokens,
           "cache_bytes_read": tokens * cache[0, 0].numel() * hk // BS}
    for s in [None] + splits:
        t = timer.graph_us(lambda: decode_attention_triton(codec, q, cache, bt, seq_lens, out=out,
                                                           num_splits=s, new_kv=(kn, vn, slots)))
        row["default" if s is None else f"s{s}"] = t["us"]
    del cache, k, v
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="turboquant_k3v4_nc,tq_k4v3")
    ap.add_argument("--shapes", default="256x1024-1280,128x1024-1280,64x1024-1280")
    ap.add_argument("--splits", default="1,2,3,4")
    ap.add_argument("--heads", default="32/8/128", help="query heads / KV heads / head size")
    ap.add_argument("--maxnreg", default=str(decode_mma.MAXNREG),
                    help="comma list of register caps of the tensor-core kernel")
    ap.add_argument("--l2-ahead", type=int, default=None,
                    help="decode_mma.L2_AHEAD_64/_128 for this process (default: the product's)")
    ap.add_argument("--out", default="split_sweep.json")
    args = ap.parse_args()
    if args.l2_ahead is not None:
        from triton.experimental.gluon import language as gl
        for d in (64, 128):
            setattr(decode_mma, f"L2_AHEAD_{d}", gl.constexpr(args.l2_ahead))
    env = {**environment(), "command": "python3 " + " ".join(sys.argv), "sms": num_sms("cuda")}
    print(json.dumps(env), flush=True)
    timer = Timer()
    splits = [int(x) for x in args.splits.split(",")]
    rows = []
    for cap in (int(x) for x in args.maxnreg.split(",")):
        decode_mma.MAXNREG = cap        # read at each launch; the resident count follows it
        decode_mma._RESIDENT.clear()
        for preset in args.presets.split(","):
            for shape in args.shapes.split(","):
                b, ctx = shape.split("x")
                lo, hi = (int(x) for x in ctx.split("-"))
                hq, hk, d = (int(x) for x in args.heads.split("/"))
                row = case(timer, preset, int(b), lo, hi, splits, hq, hk, d)
                row["heads"] = args.heads
                row["maxnreg"] = cap
                row["resident_per_sm"] = max(decode_mma._RESIDENT.values(), default=None)
                rows.append(row)
                print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
