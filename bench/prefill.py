"""Prefill throughput of one attention layer: bf16 FlashAttention backend vs TurboQuant.

One layer step = store the chunk's K/V into the paged cache + attention for the chunk, as the
engine runs it (``impl.store`` then ``impl.forward`` with the builder's metadata). Qwen3-4B /
Llama-3.1-8B attention (32 query heads, 8 KV heads, head size 128), bf16, block size 16.

* first-chunk prefill: B prompts of L tokens (no cached prefix), for every FlashAttention
  version available (2 = torch built-in, 3 = tokenspeed-fa3, 4 = flash-attn-4);
* continuation chunks: B requests with an 8K cached prefix and a chunk of 512 or 2048 tokens.

Timing: CUDA-graph replay of one step, L2 flushed before each rep, median of >= 20 reps, all in
one process (bench/common.py). Reported: µs, tokens/s, TurboQuant/bf16 speed ratio at the same
FA version, FA3/FA2 speed ratio.

    PYTHONPATH=. python3 bench/prefill.py --out bench/results/prefill_h200.json
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
from tqattn.attention import fa_utils  # noqa: E402
from tqattn.attention.backend import AttentionLayerSpec, CommonAttentionMetadata  # noqa: E402
from tqattn.attention.flash_attn import FlashAttentionBackend  # noqa: E402
from tqattn.attention.turboquant import TurboQuantBackend  # noqa: E402

BS = 16
HQ, HK, D = 32, 8, 128


def step(batch: int, prefix: int, q_len: int) -> CommonAttentionMetadata:
    seq = prefix + q_len
    nblk = math.ceil(seq / BS)
    table = torch.randperm(batch * nblk, device="cuda").view(batch, nblk).to(torch.int32)
    pos = torch.arange(prefix, seq, device="cuda")
    slots = (table[:, pos // BS].long() * BS + pos % BS).flatten()
    qsl = torch.arange(batch + 1, dtype=torch.int32) * q_len
    seq_lens = torch.full((batch,), seq, dtype=torch.int32)
    nc = torch.full((batch,), prefix, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl.cuda(), seq_lens=seq_lens.cuda(), num_computed_tokens=nc.cuda(),
        block_table=table, slot_mapping=slots, query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
        num_computed_tokens_cpu=nc, num_reqs=batch, num_actual_tokens=batch * q_len,
        max_query_len=q_len, max_seq_len=seq, block_size=BS)


def time_layer(timer, backend, kv_dtype, fa_version, common, prefix_kv=None):
    """µs of one layer step, or the error text if this combination cannot run here."""
    try:
        return _time_layer(timer, backend, kv_dtype, fa_version, common, prefix_kv)
    except Exception as e:  # one unsupported combination must not lose the rest of the run
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return f"{type(e).__name__}: {e}"[:300]


def _time_layer(timer, backend, kv_dtype, fa_version, common, prefix_kv=None) -> float:
    spec = AttentionLayerSpec(0, HQ, HK, D, D ** -0.5, torch.bfloat16, kv_dtype)
    impl = backend.impl_cls(spec, fa_version=fa_version)
    builder = backend.builder_cls({spec.name: impl}, torch.device("cuda"))
    nblk = int(common.block_table.max()) + 1
    cache = torch.zeros(backend.kv_cache_shape(nblk, BS, spec),
                        dtype=backend.kv_cache_torch_dtype(spec), device="cuda")
    if prefix_kv is not None:  # the cached prefix, stored by an earlier step
        pk, pv, pslots = prefix_kv
        impl.store(pk, pv, cache, type("M", (), {"num_actual_tokens": pk.shape[0],
                                                "slot_mapping": pslots}))
    meta = builder.build(common)
    n = common.num_actual_tokens
    q = torch.randn(n, HQ, D, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn(2, n, HK, D, device="cuda", dtype=torch.bfloat16)

    def run():
        impl.store(k, v, cache, meta)
        impl.forward(q, k, v, cache, meta)

    us = timer.graph_us(run)["us"]
    del cache, q, k, v
    torch.cuda.empty_cache()
    return us


def prefix_kv(common: CommonAttentionMetadata, prefix: int):
    b = common.num_reqs
    pos = torch.arange(prefix, device="cuda")
    slots = (common.block_table[:, pos // BS].long() * BS + pos % BS).flatten()
    k, v = torch.randn(2, b * prefix, HK, D, device="cuda", dtype=torch.bfloat16)
    return k, v, slots


def pair_row(kind, batch, q_len, fa_version, bf16, tq, **extra) -> dict:
    row = {"kind": kind, "batch": batch, "q_len": q_len, "fa_version": fa_version, **extra,
           "bf16_us": bf16, "tq_us": tq}
    tokens = batch * q_len
    if isinstance(bf16, float):
        row["bf16_tok_s"] = tokens / bf16 * 1e6
    if isinstance(tq, float):
        row["tq_tok_s"] = tokens / tq * 1e6
    if isinstance(bf16, float) and isinstance(tq, float):
        row["tq_vs_bf16"] = bf16 / tq
    return row


def render_md(result: dict, command: str) -> str:
    env = result["env"]
    head = [f"# prefill ({result['preset']}, Hq/Hk/D {'/'.join(map(str, result['heads']))}, "
            f"block size {result['block_size']})", "",
            f"- device: {env.get('device')}, torch {env.get('torch')}, triton {env.get('triton')}, "
            f"FA versions found: {env.get('fa_versions')}, {env.get('date')}",
            f"- command: `{command}`",
            "- one layer step = store + attention, CUDA-graph replay, L2 flushed, median", "",
            "| kind | B | prefix | chunk | FA | bf16 µs | TQ µs | bf16 tok/s | TQ tok/s | TQ/bf16 speed |",
            "|---|---|---|---|---|---|---|---|---|---|"]

    def fmt(x, spec):
        return format(x, spec) if isinstance(x, float) else (str(x) if x is not None else "")

    for r in result["rows"]:
        head.append(f"| {r['kind']} | {r['batch']} | {r.get('prefix', 0)} | {r['q_len']} | "
                    f"{r['fa_version']} | {fmt(r['bf16_us'], '.1f')} | {fmt(r['tq_us'], '.1f')} | "
                    f"{fmt(r.get('bf16_tok_s'), '.3g')} | {fmt(r.get('tq_tok_s'), '.3g')} | "
                    f"{fmt(r.get('tq_vs_bf16'), '.3f')} |")
    if result["fa3_vs_fa2"]:
        head += ["", "| B | L | FA3/FA2 speed (bf16) | FA3/FA2 speed (TQ) |", "|---|---|---|---|"]
        for r in result["fa3_vs_fa2"]:
            head.append(f"| {r['batch']} | {r['q_len']} | {r['fa3_vs_fa2_bf16']:.3f} | "
                        f"{r['fa3_vs_fa2_tq']:.3f} |")
    return "\n".join(head) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="turboquant_k3v4_nc")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--chunks", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--prefix", type=int, default=8192)
    ap.add_argument("--store-rows", type=int, default=None,
                    help="store kernel rows per program (default: the kernel's)")
    ap.add_argument("--dequant", type=int, nargs=2, default=None, metavar=("BLOCK_N", "WARPS"),
                    help="dequant kernel tokens per program and warps (default: the kernel's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from tqattn.kernels import dequant, store
    if args.store_rows:
        store.ROWS_PER_PROGRAM = args.store_rows
    if args.dequant:
        dequant.BLOCK_N, dequant.NUM_WARPS = args.dequant

    versions = sorted(fa_utils.detect_fa_versions())
    timer = Timer()
    env = environment()
    env["fa_versions"] = versions
    rows = []
    for batch in args.batches:
        for length in args.lengths:
            common = step(batch, 0, length)
            for v in versions:
                bf16 = time_layer(timer, FlashAttentionBackend, "auto", v, common)
                tq = time_layer(timer, TurboQuantBackend, args.preset, v, common)
                row = pair_row("prefill", batch, length, v, bf16, tq)
                rows.append(row)
                print(json.dumps(row), flush=True)
    for batch in args.batches:
        for chunk in args.chunks:
            common = step(batch, args.prefix, chunk)
            pkv = prefix_kv(common, args.prefix)
            for v in versions:
                bf16 = time_layer(timer, FlashAttentionBackend, "auto", v, common, pkv)
                tq = time_layer(timer, TurboQuantBackend, args.preset, v, common, pkv)
                row = pair_row("continuation", batch, chunk, v, bf16, tq, prefix=args.prefix)
                rows.append(row)
                print(json.dumps(row), flush=True)
    speedups = []
    for r in rows:
        if r["kind"] == "prefill" and r["fa_version"] == 3:
            fa2 = [x for x in rows if x["kind"] == "prefill" and x["fa_version"] == 2
                   and x["batch"] == r["batch"] and x["q_len"] == r["q_len"]]
            if fa2 and all(isinstance(x, float) for x in
                           (fa2[0]["bf16_us"], r["bf16_us"], fa2[0]["tq_us"], r["tq_us"])):
                speedups.append({"batch": r["batch"], "q_len": r["q_len"],
                                 "fa3_vs_fa2_bf16": fa2[0]["bf16_us"] / r["bf16_us"],
                                 "fa3_vs_fa2_tq": fa2[0]["tq_us"] / r["tq_us"]})
    result = {"env": env, "preset": args.preset, "heads": [HQ, HK, D], "block_size": BS,
              "store_rows_per_program": store.ROWS_PER_PROGRAM,
              "dequant_defaults": {"block_n": dequant.BLOCK_N, "num_warps": dequant.NUM_WARPS},
              "rows": rows, "fa3_vs_fa2": speedups}
    if args.out:
        result["command"] = "python3 " + " ".join(sys.argv)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
            f.write(render_md(result, result["command"]))


if __name__ == "__main__":
    main()
