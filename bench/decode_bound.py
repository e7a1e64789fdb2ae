"""Is a decode call bound by HBM or by its own instruction stream? Times the same call on the
real cache (L2 flushed before each replay) and on a block table that folds every sequence onto a
pool of blocks small enough to stay in L2 (warm replays): if the L2-resident call is not much
faster, reading HBM is not what limits it. Each split count of ``--splits`` (``auto``: the
product's) is timed both ways.

    PYTHONPATH=. python3 bench/decode_bound.py --shapes 32x16384,128x4096 [--splits auto,8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import Timer, copy_bandwidth_gbs, environment  # noqa: E402
from bench.decode import BS, main_shape_case  # noqa: E402
from tqattn.kernels.decode import decode_attention_triton  # noqa: E402

POOL_BYTES = 24 << 20  # about half of an H200's L2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="32x16384,128x4096")
    ap.add_argument("--preset", default="turboquant_k3v4_nc")
    ap.add_argument("--splits", default="auto", help="comma-separated split counts or auto")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tag", default="decode_bound_h200")
    args = ap.parse_args()
    env = environment()
    print(json.dumps(env), flush=True)
    copy = copy_bandwidth_gbs()
    flushed, warm = Timer(flush="memset"), Timer(flush="none")
    rows = []
    for shape in args.shapes.split(","):
        b, l = map(int, shape.split("x"))
        codec, q, cache, bt, lens = main_shape_case(args.preset, b, l)
        pool = max(1, POOL_BYTES // (8 * BS * codec.slot_bytes))
        bt_pool = bt % pool
        out = torch.empty_like(q)
        kv_bytes = b * l * 8 * codec.slot_bytes
        for n in args.splits.split(","):
            cfg = {"num_splits": None if n == "auto" else int(n)}

            def call(table, cfg=cfg):
                return decode_attention_triton(codec, q, cache, table, lens, out=out, **cfg)
            hbm = flushed.graph_us(lambda: call(bt))["us"]
            l2 = warm.graph_us(lambda: call(bt_pool))["us"]
            row = {"batch": b, "ctx": l, "preset": args.preset, "cfg": cfg, "us_hbm": hbm,
                   "us_l2": l2, "pct_copy_hbm": 100 * kv_bytes / hbm / 1e3 / copy["gbs_rw"],
                   "pool_blocks": pool}
            rows.append(row)
            print(f"B={b} L={l} {cfg}: HBM {hbm:.1f} µs ({row['pct_copy_hbm']:.0f}% copy), "
                  f"L2-resident {l2:.1f} µs", flush=True)
        del cache, q, bt, bt_pool
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.tag}.json"), "w") as f:
        json.dump({"env": env, "copy": copy, "rows": rows}, f, indent=1)
    md = [f"# {args.tag}", "", f"- device: {env['device']}, torch {env['torch']}, triton "
          f"{env['triton']}, {env['date']}", f"- command: `{env['command']}`",
          f"- D2D copy: {copy['gbs_rw']:.0f} GB/s; HBM = L2 flushed (memset) before each graph "
          f"replay; L2 = block table folded onto {POOL_BYTES >> 20} MB of blocks, warm replays",
          "", "| B | L | config | µs HBM | % copy | µs L2-resident | L2 / HBM |",
          "|" + "---|" * 7]
    md += [f"| {r['batch']} | {r['ctx']} | `{json.dumps(r['cfg'])}` | {r['us_hbm']:.1f} | "
           f"{r['pct_copy_hbm']:.0f}% | {r['us_l2']:.1f} | {r['us_l2'] / r['us_hbm']:.2f} |"
           for r in rows]
    with open(os.path.join(args.out, f"{args.tag}.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
