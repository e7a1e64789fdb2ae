"""The decode step's GEMMs alone (issue 24): how close the engine's projections come to the
copy rate at decode batch sizes, with the default (cuBLAS) kernels and with Inductor's
max-autotune choice at a static token count — whether a tuned GEMM path for the decode buckets
would pay. Shapes: a model config's fused projections (q/k/v, o, gate/up, down; the LM head
with ``--lm-head``), bf16, timed as bench/decode.py times kernels (CUDA-graph replay, L2
flushed, median).

    PYTHONPATH=. python3 bench/lab/gemm_decode.py --model Qwen3-4B --tokens 1,64,256 \\
        --autotune-tokens 256 --out $OUT/gemm_decode.json

``--smoke`` runs every shape once at 4 tokens on the CPU, without timing or autotuning.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.common import Timer, copy_bandwidth_gbs, environment  # noqa: E402
from tqattn.models.loader import load_config  # noqa: E402


def projection_shapes(model: str, lm_head: bool) -> dict[str, tuple[int, int]]:
    """name → (in_features, out_features) of one decoder layer's fused projections."""
    cfg = load_config(model, load_format="dummy")
    h, inter = cfg.hidden_size, cfg.intermediate_size
    d = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes = {"qkv_proj": (h, q + 2 * kv), "o_proj": (q, h), "gate_up_proj": (h, 2 * inter),
              "down_proj": (inter, h)}
    if lm_head:
        shapes["lm_head"] = (h, cfg.vocab_size)
    return shapes


def pct_copy(nbytes: int, us: float, copy: dict) -> float:
    """The weight read rate as a share of the copy rate (read + write bytes), as bench/decode.py
    reports a cache's read rate."""
    return 100 * nbytes / (us * 1e3) / copy["gbs_rw"]


def time_linear(timer, fn, x, w) -> float:
    return timer.graph_us(lambda: fn(x, w))["us"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen3-4B")
    ap.add_argument("--tokens", default="1,64,256")
    ap.add_argument("--autotune-tokens", default="256",
                    help="token counts also timed with torch.compile(mode='max-autotune-no-"
                         "cudagraphs') at that static size ('' for none)")
    ap.add_argument("--lm-head", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default="gemm_decode.json")
    args = ap.parse_args()
    shapes = projection_shapes(args.model, args.lm_head)
    if args.smoke:
        for name, (k, n) in shapes.items():
            x = torch.randn(4, k, dtype=torch.bfloat16)
            w = torch.randn(n, k, dtype=torch.bfloat16)
            assert F.linear(x, w).shape == (4, n), name
            print(f"{name}: {k} -> {n} ok")
        return
    env = {**environment(), "command": "python3 " + " ".join(sys.argv)}
    copy = copy_bandwidth_gbs()
    print(json.dumps(env), json.dumps(copy), flush=True)
    timer = Timer()
    tokens = [int(t) for t in args.tokens.split(",")]
    tuned = {int(t) for t in args.autotune_tokens.split(",") if t}
    rows = []
    for name, (k, n) in shapes.items():
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * k ** -0.5
        wbytes = w.numel() * w.element_size()
        for m in sorted(set(tokens) | tuned):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            row = {"proj": name, "in": k, "out": n, "tokens": m, "weight_mb": wbytes / 1e6}
            if m in tokens:
                us = time_linear(timer, F.linear, x, w)
                row.update(cublas_us=us, cublas_pct_copy=pct_copy(wbytes, us, copy))
            if m in tuned:
                torch._dynamo.reset()
                t0 = time.perf_counter()
                fn = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
                fn(x, w)
                torch.cuda.synchronize()
                row["autotune_s"] = time.perf_counter() - t0
                us = time_linear(timer, fn, x, w)
                row.update(tuned_us=us, tuned_pct_copy=pct_copy(wbytes, us, copy))
            rows.append(row)
            print(json.dumps(row), flush=True)
            del x
        del w
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"env": env, "copy": copy, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
