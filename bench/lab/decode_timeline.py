"""Where a tensor-core decode call spends its time, per program: under
``bench/lab/decode_mma_timeline.recording_timeline`` each program of the tensor-core kernel
(the product kernel plus timestamps) writes %globaltimer at its start, after its tiles, after
the split counter's atomic and at its end, with its SM id and warp slot. Reports when programs
finish their tiles (spread over the programs, and by warp slot: on sm_90 the first four
programs an SM receives, one per scheduler, run ahead of the next four), and times each split
count of ``--splits`` against the default in turns (CUDA-graph replays of the product build,
L2 flushed).

    PYTHONPATH=. python3 bench/lab/decode_timeline.py --shapes 128x4096,32x16384,8x65536 \\
        --splits 8,16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.common import Timer, environment  # noqa: E402
from bench.decode import main_shape_case  # noqa: E402
from bench.lab.decode_mma_timeline import recording_timeline  # noqa: E402
from tqattn.kernels.decode import decode_attention_triton  # noqa: E402


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * (len(xs) - 1) + 0.5))]


def timeline(call, flush, reps: int = 3) -> list[dict]:
    """Per rep: the spread of the in-kernel timestamps (µs from the earliest program start);
    the raw per-program values of the second rep."""
    out = []
    for rep in range(reps):
        buf = torch.zeros(1 << 16, 8, dtype=torch.int64, device="cuda")
        flush()
        torch.cuda.synchronize()
        with recording_timeline(buf):
            call()
        torch.cuda.synchronize()
        sel = buf[:, 0] > 0
        rows = buf[sel].cpu()
        us = ((rows[:, :4].double() - rows[:, 0].min()) / 1e3).tolist()
        start, loop_end, _, end = zip(*us)
        slot = rows[:, 7].tolist()
        by_slot = {w: round(statistics.median(e for e, s in zip(loop_end, slot) if s == w), 2)
                   for w in sorted(set(slot))}
        row = {"programs": len(rows), "start_max": max(start),
               "tiles_end_p10": pct(loop_end, .1), "tiles_end_p50": pct(loop_end, .5),
               "tiles_end_max": max(loop_end), "end_max": max(end),
               "tiles_end_p50_by_warp_slot": by_slot}
        if rep == 1:
            row["raw"] = {"program": torch.nonzero(sel).flatten().tolist(),
                          "tiles_end": [round(x, 2) for x in loop_end],
                          "end": [round(x, 2) for x in end], "smid": rows[:, 4].tolist(),
                          "warp_slot": slot}
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="128x4096,32x16384,8x65536")
    ap.add_argument("--preset", default="turboquant_k3v4_nc")
    ap.add_argument("--splits", default="",
                    help="comma-separated split counts, each timed in turns with the default")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tag", default="decode_timeline_h200")
    args = ap.parse_args()
    env = environment()
    print(json.dumps(env), flush=True)
    timer = Timer(flush="memset")
    rows = []
    for shape in args.shapes.split(","):
        b, l = map(int, shape.split("x"))
        codec, q, cache, bt, lens = main_shape_case(args.preset, b, l)
        out = torch.empty_like(q)

        def call(num_splits=None):
            decode_attention_triton(codec, q, cache, bt, lens, out=out, num_splits=num_splits)

        call()   # the product build's split count, before the timeline build runs
        row = {"batch": b, "ctx": l, "timeline": timeline(call, timer.flush), "paired": []}
        for n in (int(x) for x in args.splits.split(",") if x):
            p = timer.paired_us(call, lambda n=n: call(n))
            row["paired"].append({"num_splits": n, **p})
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "timeline"}), flush=True)
        print(json.dumps({k: v for k, v in row["timeline"][1].items() if k != "raw"}),
              flush=True)
        del cache, q, bt
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.tag}.json"), "w") as f:
        json.dump({"env": env, "rows": rows}, f, separators=(",", ":"))


if __name__ == "__main__":
    main()
