"""Decode attention with a sliding window and a logits soft-cap (Gemma 2 / 3 layers), timed.

For each preset and Hq/Hk/D shape: B sequences of L tokens (bench/decode.py's synthetic data),
``decode_attention_triton`` with no window, with each window of ``--windows``, and with each
window plus ``--softcap`` — whatever kernel the tree dispatches them to (main: the portable
Triton kernel for windows and soft-caps; the tensor-core kernel for them with the pending
window patch) — its output's relative error against the PyTorch reference on the first
sequences, and FlashAttention-3's bf16 paged decode with the same window and soft-cap (where
tokenspeed-fa3 imports and its build has the soft-cap) with the time ratio. CUDA-graph replay,
L2 flushed (bench.common.Timer), median µs.

    PYTHONPATH=. python3 bench/lab/window_decode.py --shapes 4/1/256,8/4/256 --windows 512,1024 \
        --softcap 50 --out window_decode.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench import fa3 as fa3_mod  # noqa: E402
from bench.common import Timer, environment  # noqa: E402
from bench.decode import fill_cache, make_data  # noqa: E402
from tqattn.kernels.decode import decode_attention_triton  # noqa: E402
from tqattn.quant.codec import TQCodec  # noqa: E402
from tqattn.quant.paged import decode_attention_ref  # noqa: E402

REF_ROWS = 2  # sequences the fp32 reference decodes (it reads whole caches)


def case(timer, fa3, preset, hq, hk, d, b, length, window, softcap) -> dict:
    q, k, v, bt = make_data(b, length, hq, hk, d)
    codec = TQCodec(preset, d, device="cuda")
    cache = fill_cache(codec, k, v, hk)
    lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
    fa3_us = fa3_note = None
    if fa3 is not None:
        try:
            fa3_us = timer.graph_us(lambda: fa3_mod.decode_bf16(fa3, q, k, v, lens, bt, window,
                                                                softcap))["us"]
        except RuntimeError as e:  # tokenspeed-fa3 is built without soft-cap (tqattn env)
            fa3_note = str(e).splitlines()[0][:200]
    del k, v
    kw = {"window": window or None, "softcap": softcap}
    out = decode_attention_triton(codec, q, cache, bt, lens, **kw)
    ref = decode_attention_ref(codec, q[:REF_ROWS], cache, bt[:REF_ROWS], lens[:REF_ROWS], **kw)
    err = ((out[:REF_ROWS].float() - ref).norm() / ref.norm()).item()
    us = timer.graph_us(lambda: decode_attention_triton(codec, q, cache, bt, lens, **kw))["us"]
    return {"preset": preset, "shape": f"{hq}/{hk}/{d}", "B": b, "L": length, "window": window,
            "softcap": softcap, "us": us, "fa3_bf16_us": fa3_us,
            "x_fa3": us / fa3_us if fa3_us else None, "fa3_note": fa3_note,
            "rel_err_vs_ref": err}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="4/1/256,8/4/256")
    ap.add_argument("--presets", default="turboquant_k3v4_nc,tq_k4v3")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--windows", default="512,1024")
    ap.add_argument("--softcap", type=float, default=50.0)
    ap.add_argument("--out", default="window_decode.json")
    args = ap.parse_args()
    timer = Timer()
    fa3 = fa3_mod.load()
    rows = []
    for shape in args.shapes.split(","):
        hq, hk, d = (int(x) for x in shape.split("/"))
        for preset in args.presets.split(","):
            runs = [(0, 0.0)] + [(int(w), 0.0) for w in args.windows.split(",")] + \
                [(int(w), args.softcap) for w in args.windows.split(",")]
            for window, softcap in runs:
                r = case(timer, fa3, preset, hq, hk, d, args.batch, args.context, window,
                         softcap)
                rows.append(r)
                print(json.dumps(r), flush=True)
                torch.cuda.empty_cache()
    env = {**environment(), "command": "python3 " + " ".join(sys.argv)}
    with open(args.out, "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
