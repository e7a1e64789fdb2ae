"""What key centering costs on the GPU: the TurboQuant layer's store and its fused decode step,
with and without a key offset, timed in turns in one process (bench.common.Timer.paired_us:
CUDA-graph replays, L2 flushed, a and b alternating).

* prefill store: ``TurboQuantImpl.store`` of N new tokens (default 16K) x 8 KV heads, head size
  128, bf16 — centered, the layer subtracts μ from the keys first (one elementwise kernel);
* decode step: ``store_and_forward`` of a decode-only batch (B = 32 sequences of 16K tokens,
  32 query / 8 KV heads, head size 128): the decode kernel stores the new token itself (the
  fused store) and reads the whole cache.

    PYTHONPATH=. python3 bench/centering_overhead.py --out bench/results/centering_overhead_h200.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import Timer, environment  # noqa: E402
from tqattn.attention.backend import AttentionLayerSpec, CommonAttentionMetadata  # noqa: E402
from tqattn.attention.turboquant import (TurboQuantBackend, TurboQuantImpl,  # noqa: E402
                                         TurboQuantMetadataBuilder)

HQ, HK, D, BS = 32, 8, 128, 16


def layer(preset: str, centered: bool) -> TurboQuantImpl:
    spec = AttentionLayerSpec(layer_idx=0, num_heads=HQ, num_kv_heads=HK, head_size=D,
                              scale=1 / math.sqrt(D), dtype=torch.bfloat16, kv_cache_dtype=preset)
    impl = TurboQuantImpl(spec)
    if centered:
        impl.set_key_offset(torch.randn(HK, D), "cuda")
    return impl, spec


def prefill_store(timer, preset, n):
    (a, spec), (b, _) = layer(preset, False), layer(preset, True)
    nb = n // BS + 1
    cache = torch.zeros(TurboQuantBackend.kv_cache_shape(nb, BS, spec), dtype=torch.uint8,
                        device="cuda")
    k, v = torch.randn(2, n, HK, D, device="cuda", dtype=torch.bfloat16)
    md = SimpleNamespace(num_actual_tokens=n,
                         slot_mapping=torch.randperm(nb * BS, device="cuda")[:n])
    return timer.paired_us(lambda: a.store(k, v, cache, md), lambda: b.store(k, v, cache, md))


def decode_step(timer, preset, batch, ctx):
    (a, spec), (b, _) = layer(preset, False), layer(preset, True)
    nblk = ctx // BS + 1
    cache = torch.randint(0, 256, TurboQuantBackend.kv_cache_shape(batch * nblk, BS, spec),
                          dtype=torch.uint8, device="cuda")
    cache.view(-1)[:] = 60  # finite fp16 norms everywhere
    table = torch.randperm(batch * nblk, device="cuda").view(batch, nblk).to(torch.int32)
    seq = torch.full((batch,), ctx, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    slots = table[:, (ctx - 1) // BS].long() * BS + (ctx - 1) % BS
    common = CommonAttentionMetadata(
        query_start_loc=qsl.cuda(), seq_lens=seq.cuda(), num_computed_tokens=(seq - 1).cuda(),
        block_table=table, slot_mapping=slots, query_start_loc_cpu=qsl, seq_lens_cpu=seq,
        num_computed_tokens_cpu=seq - 1, num_reqs=batch, num_actual_tokens=batch,
        max_query_len=1, max_seq_len=ctx, num_decodes=batch, num_decode_tokens=batch,
        block_size=BS)
    md = TurboQuantMetadataBuilder({spec.name: a}, torch.device("cuda")).build(common)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn(2, batch, HK, D, device="cuda", dtype=torch.bfloat16)
    return timer.paired_us(lambda: a.store_and_forward(q, k, v, cache, md),
                           lambda: b.store_and_forward(q, k, v, cache, md))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="tq_k4v3,turboquant_k3v4_nc")
    ap.add_argument("--tokens", type=int, default=16384, help="prefill store: new tokens")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    timer = Timer()
    rows = []
    for preset in args.presets.split(","):
        for what, r in (("prefill store", lambda: prefill_store(timer, preset, args.tokens)),
                        ("decode step (fused store)",
                         lambda: decode_step(timer, preset, args.batch, args.ctx))):
            row = {"preset": preset, "what": what, **r()}
            row["overhead_pct"] = 100 * row["diff_us"] / row["a_us"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": environment(), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
