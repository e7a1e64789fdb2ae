"""Tile and warp sweep of the portable Triton decode kernel (kernels/decode.py) at a few shapes,
timed as bench/decode.py times it (CUDA-graph replay, L2 flushed, median). The product picks
(BLOCK_N, num_warps) per layout in ``decode.launch_config``; each config here replaces that
choice for its own timing, the inline-asm choice of the layout unchanged. The tensor-core
kernel's layouts are swept with it off (``step.tensor_cores``).

    PYTHONPATH=. python3 bench/lab/decode_tune.py --presets tq_k4v3,turboquant_k8v4 \\
        --shapes 8x16384,32x16384 --configs 32x4,64x4,128x4,64x8
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.common import Timer, environment  # noqa: E402
from bench.decode import contiguous_kv, cosines, fill_cache, make_data  # noqa: E402
from tqattn.kernels import decode, step  # noqa: E402
from tqattn.quant.codec import TQCodec  # noqa: E402


@contextlib.contextmanager
def portable_config(block_n: int, num_warps: int):
    """decode.launch_config returns (block_n, num_warps) with the layout's asm choice, and the
    portable kernel serves every layout, within the block."""
    product, tc = decode.launch_config, step.tensor_cores
    decode.launch_config = lambda spec, interp: (block_n, num_warps, product(spec, interp)[2])
    step.tensor_cores = lambda device: False
    try:
        yield
    finally:
        decode.launch_config, step.tensor_cores = product, tc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="turboquant_k3v4_nc,tq_k4v3")
    ap.add_argument("--shapes", default="8x16384,32x16384,128x4096")
    ap.add_argument("--configs", default="32x1,32x2,64x2,32x4,64x4,128x4,64x8,128x8",
                    help="BLOCK_NxWARPS, comma-separated")
    ap.add_argument("--out", default="bench/results/decode_tune_h200.json")
    args = ap.parse_args()
    env = environment()
    print(json.dumps(env), flush=True)
    timer = Timer()
    rows = []
    for shape in args.shapes.split(","):
        b, l = map(int, shape.split("x"))
        q, k, v, bt = make_data(b, l, 32, 8, 128)
        lens = torch.full((b,), l, dtype=torch.int32, device="cuda")
        kc, vc = contiguous_kv(k, bt, b, l, 8, 128), contiguous_kv(v, bt, b, l, 8, 128)
        ref = F.scaled_dot_product_attention(q.view(b, 32, 1, 128), kc, vc,
                                             enable_gqa=True).view(b, 32, 128)
        del kc, vc
        for preset in args.presets.split(","):
            codec = TQCodec(preset, 128, device="cuda")
            cache = fill_cache(codec, k, v, 8)
            out = torch.empty_like(q)
            for cfg in args.configs.split(","):
                bn, warps = map(int, cfg.split("x"))
                out.fill_(float("nan"))
                try:
                    with portable_config(bn, warps):
                        r = timer.graph_us(lambda: decode.decode_attention_triton(
                            codec, q, cache, bt, lens, out=out))
                except Exception as e:  # noqa: BLE001 - keep sweeping
                    print(f"B={b} L={l} {preset} {cfg}: FAILED {type(e).__name__}: "
                          f"{str(e)[:200]}", flush=True)
                    continue
                cs = cosines(out, ref)
                rows.append({"batch": b, "ctx": l, "preset": preset, "block_n": bn,
                             "num_warps": warps, **r, "cos": cs[0]})
                print(f"B={b} L={l} {preset} BLOCK_N={bn} warps={warps}: {r['us']:.1f} µs "
                      f"cos={cs[0]:.4f}", flush=True)
            del cache
            torch.cuda.empty_cache()
        del q, k, v, bt
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
