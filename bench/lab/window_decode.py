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


def fa3_us(timer, fa3, q, k, v, lens, bt, window, softcap) -> tuple:
    """FA3 bf16 paged decode's µs with this window and soft-cap, or None and why not."""
    if fa3 is None:
        return None, "tokenspeed-fa3 not importable"
    try:
        return timer.graph_us(lambda: fa3_mod.decode_bf16(fa3, q, k, v, lens, bt, window,
                                                          softcap))["us"], None
    except RuntimeError as e:  # tokenspeed-fa3 is built without soft-cap (tqattn env)
        return None, str(e).splitlines()[0][:200]


def tq_case(timer, codec, q, cache, bt, lens, window, softcap) -> dict:
    """The compressed cache's decode with this window and soft-cap: µs and the error against
    the reference on the first REF_ROWS sequences."""
    kw = {"window": window or None, "softcap": softcap}
    out = decode_attention_triton(codec, q, cache, bt, lens, **kw)
    ref = decode_attention_ref(codec, q[:REF_ROWS], cache, bt[:REF_ROWS], lens[:REF_ROWS], **kw)
    err = ((out[:REF_ROWS].float() - ref).norm() / ref.norm()).item()
    us = timer.graph_us(lambda: decode_attention_triton(codec, q, cache, bt, lens, **kw))["us"]
    return {"us": us, "rel_err_vs_ref": err}


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
    windows = [int(w) for w in args.windows.split(",")]
    runs = [(0, 0.0)] + [(w, 0.0) for w in windows] + [(w, args.softcap) for w in windows]
    b, length = args.batch, args.context
    rows = []
    for shape in args.shapes.split(","):
        hq, hk, d = (int(x) for x in shape.split("/"))
        q, k, v, bt = make_data(b, length, hq, hk, d)
        lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
        base = {run: fa3_us(timer, fa3, q, k, v, lens, bt, *run) for run in runs}
        codecs = [TQCodec(p, d, device="cuda") for p in args.presets.split(",")]
        caches = [fill_cache(codec, k, v, hk) for codec in codecs]
        del k, v
        for codec, cache in zip(codecs, caches):
            preset = codec.preset.name
            for window, softcap in runs:
                fa3_time, fa3_note = base[(window, softcap)]
                r = {"preset": preset, "shape": shape, "B": b, "L": length, "window": window,
                     "softcap": softcap,
                     **tq_case(timer, codec, q, cache, bt, lens, window, softcap),
                     "fa3_bf16_us": fa3_time, "fa3_note": fa3_note}
                r["x_fa3"] = r["us"] / fa3_time if fa3_time else None
                rows.append(r)
                print(json.dumps(r), flush=True)
        del caches
        torch.cuda.empty_cache()
    env = {**environment(), "command": "python3 " + " ".join(sys.argv)}
    with open(args.out, "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
