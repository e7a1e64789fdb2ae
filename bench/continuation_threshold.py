"""Which TurboQuant continuation path is faster for a given chunk length.

For one continuation chunk of q_len tokens over a compressed prefix, the TURBOQUANT backend can
(a) run the decode kernel with q_len query rows over the prefix + FlashAttention on the raw
chunk, merged by LSE ("decode rows"), or (b) dequantize the prefix and run FlashAttention over
[prefix ‖ chunk] ("dequant + FA"). This times ``TurboQuantImpl.forward`` both ways (the
builder's threshold forced to infinity or to 0) on the same data: CUDA-graph replay (which
also proves the forward free of host syncs), L2 flushed, median; eager time alongside.
The crossover sets ``CONTINUATION_DEQUANT_THRESHOLD`` in tqattn/attention/turboquant.py.

    PYTHONPATH=. python3 bench/continuation_threshold.py [--out bench/results/x.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import Timer, environment  # noqa: E402
from tqattn.attention.backend import AttentionLayerSpec, CommonAttentionMetadata  # noqa: E402
from tqattn.attention.turboquant import (TurboQuantBackend, TurboQuantImpl,  # noqa: E402
                                         TurboQuantMetadataBuilder)

BS = 16


def step(batch: int, prefix: int, q_len: int, device="cuda") -> CommonAttentionMetadata:
    seq = prefix + q_len
    nblk = math.ceil(seq / BS)
    table = torch.randperm(batch * nblk, device=device).view(batch, nblk).to(torch.int32)
    pos = torch.arange(prefix, seq, device=device)
    slots = (table[:, pos // BS].long() * BS + pos % BS).flatten()
    qsl = torch.arange(batch + 1, dtype=torch.int32) * q_len
    seq_lens = torch.full((batch,), seq, dtype=torch.int32)
    nc = torch.full((batch,), prefix, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device), seq_lens=seq_lens.to(device),
        num_computed_tokens=nc.to(device), block_table=table, slot_mapping=slots,
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens, num_computed_tokens_cpu=nc,
        num_reqs=batch, num_actual_tokens=batch * q_len, max_query_len=q_len, max_seq_len=seq,
        block_size=BS)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="turboquant_4bit_nc")
    ap.add_argument("--prefix", type=int, default=8192)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--q-lens", type=int, nargs="+",
                    default=[8, 16, 32, 64, 128, 256, 512, 1024, 2048])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    hq, hk, d = 32, 8, 128
    spec = AttentionLayerSpec(0, hq, hk, d, d ** -0.5, torch.bfloat16, args.preset)
    impl = TurboQuantImpl(spec)
    timer = Timer()
    rows = []
    for batch in args.batch:
        for q_len in args.q_lens:
            common = step(batch, args.prefix, q_len)
            nblk = int(common.block_table.max()) + 1
            cache = torch.empty(TurboQuantBackend.kv_cache_shape(nblk, BS, spec),
                                dtype=torch.uint8, device="cuda")
            # Fill the whole cache (prefix and chunk) with encoded random K/V.
            all_slots = torch.arange(nblk * BS, device="cuda")
            kv = torch.randn(2, nblk * BS, hk, d, device="cuda", dtype=torch.bfloat16)
            impl.store(kv[0], kv[1], cache, type("M", (), {"num_actual_tokens": nblk * BS,
                                                           "slot_mapping": all_slots}))
            n = batch * q_len
            q = torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16)
            k, v = torch.randn(2, n, hk, d, device="cuda", dtype=torch.bfloat16)
            row = {"batch": batch, "prefix": args.prefix, "q_len": q_len}
            for name, threshold in (("decode_rows", 1 << 30), ("dequant_fa", 0)):
                builder = TurboQuantMetadataBuilder({spec.name: impl}, "cuda")
                builder.dequant_threshold = threshold
                md = builder.build(common)
                fn = lambda: impl.forward(q, k, v, cache, md)  # noqa: E731
                row[f"{name}_us"] = timer.graph_us(fn)["us"]
                row[f"{name}_eager_us"] = timer.eager_us(fn)
            row["faster"] = ("decode_rows" if row["decode_rows_us"] < row["dequant_fa_us"]
                             else "dequant_fa")
            print(json.dumps({k: round(x, 1) if isinstance(x, float) else x
                              for k, x in row.items()}), flush=True)
            rows.append(row)
            del cache, kv
            torch.cuda.empty_cache()
    result = {"env": environment(), "preset": args.preset, "heads": [hq, hk, d],
              "fa_version": impl.fa_version, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
