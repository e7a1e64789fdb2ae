"""What key centering costs on the GPU: the TurboQuant layer's store and its fused decode step,
with and without a key offset, timed in turns in one process (bench.common.Timer.paired_us:
CUDA-graph replays, L2 flushed, a and b alternating).

* prefill store: ``TurboQuantImpl.store`` of N new tokens (default 16K) x 8 KV heads, head size
  128, bf16 — centered, the store kernel subtracts μ from the keys as it loads them;
* decode step: ``store_and_forward`` of a decode-only batch (B = 32 sequences of 16K tokens,
  32 query / 8 KV heads, head size 128): the decode kernel stores the new token itself (the
  fused store) and reads the whole cache.

    PYTHONPATH=. python3 bench/centering_overhead.py --out bench/results/centering_overhead_h200.json

Issue 29 asks both to cost <= 3 % more with centering (overhead_pct in each row), then
``pytest -m gpu``. ``--smoke`` runs each pair once at tiny shapes on any device (CPU: the
PyTorch references) and checks the outputs, without timing — that the script works, before GPU
time is spent on it:

    PYTHONPATH=. python3 bench/centering_overhead.py --smoke
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


def layer(preset: str, centered: bool, dev: str) -> tuple[TurboQuantImpl, AttentionLayerSpec]:
    spec = AttentionLayerSpec(layer_idx=0, num_heads=HQ, num_kv_heads=HK, head_size=D,
                              scale=1 / math.sqrt(D), dtype=torch.bfloat16, kv_cache_dtype=preset)
    impl = TurboQuantImpl(spec)
    if centered:
        impl.set_key_offset(torch.randn(HK, D), dev)
    return impl, spec


def prefill_store(preset, n, dev):
    """(store without centering, store with it) over the same cache and tokens."""
    (a, spec), (b, _) = layer(preset, False, dev), layer(preset, True, dev)
    nb = n // BS + 1
    cache = torch.zeros(TurboQuantBackend.kv_cache_shape(nb, BS, spec), dtype=torch.uint8,
                        device=dev)
    k, v = torch.randn(2, n, HK, D, device=dev, dtype=torch.bfloat16)
    md = SimpleNamespace(num_actual_tokens=n,
                         slot_mapping=torch.randperm(nb * BS, device=dev)[:n])
    return lambda: a.store(k, v, cache, md), lambda: b.store(k, v, cache, md)


def decode_step(preset, batch, ctx, dev):
    """(decode step without centering, with it): store_and_forward of a decode-only batch."""
    (a, spec), (b, _) = layer(preset, False, dev), layer(preset, True, dev)
    nblk = ctx // BS + 1
    cache = torch.empty(TurboQuantBackend.kv_cache_shape(batch * nblk, BS, spec),
                        dtype=torch.uint8, device=dev)
    cache.view(-1)[:] = 60  # finite fp16 norms everywhere
    table = torch.randperm(batch * nblk, device=dev).view(batch, nblk).to(torch.int32)
    seq = torch.full((batch,), ctx, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    slots = table[:, (ctx - 1) // BS].long() * BS + (ctx - 1) % BS
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(dev), seq_lens=seq.to(dev), num_computed_tokens=(seq - 1).to(dev),
        block_table=table, slot_mapping=slots, query_start_loc_cpu=qsl, seq_lens_cpu=seq,
        num_computed_tokens_cpu=seq - 1, num_reqs=batch, num_actual_tokens=batch,
        max_query_len=1, max_seq_len=ctx, num_decodes=batch, num_decode_tokens=batch,
        block_size=BS)
    md = TurboQuantMetadataBuilder({spec.name: a}, torch.device(dev)).build(common)
    q = torch.randn(batch, HQ, D, device=dev, dtype=torch.bfloat16)
    k, v = torch.randn(2, batch, HK, D, device=dev, dtype=torch.bfloat16)
    return (lambda: a.store_and_forward(q, k, v, cache, md),
            lambda: b.store_and_forward(q, k, v, cache, md))


def smoke(presets):
    """Each pair once at tiny shapes on this machine's device: no timing, outputs checked."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for preset in presets:
        for what, (fa, fb) in (("prefill store", prefill_store(preset, 40, dev)),
                               ("decode step", decode_step(preset, 3, 50, dev))):
            outs = [fa(), fb()]
            if outs[0] is not None:  # the decode step's attention output, (B, Hq, D)
                assert all(o.shape == (3, HQ, D) and bool(torch.isfinite(o).all()) for o in outs)
            print(f"{preset}: {what} ok", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="tq_k4v3,turboquant_k3v4_nc")
    ap.add_argument("--tokens", type=int, default=16384, help="prefill store: new tokens")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="run each pair once, tiny, no timing")
    args = ap.parse_args()
    presets = args.presets.split(",")
    if args.smoke:
        return smoke(presets)
    timer = Timer()
    rows = []
    for preset in presets:
        for what, pair in (("prefill store", lambda: prefill_store(preset, args.tokens, "cuda")),
                           ("decode step (fused store)",
                            lambda: decode_step(preset, args.batch, args.ctx, "cuda"))):
            row = {"preset": preset, "what": what, **timer.paired_us(*pair())}
            row["overhead_pct"] = 100 * row["diff_us"] / row["a_us"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": environment(), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
