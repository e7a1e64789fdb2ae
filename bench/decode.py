"""Decode attention on the compressed paged cache vs FlashAttention-3 paged decode, bf16 and fp8.

Everything runs in one process on the same q and K/V (the anchor's synthetic data: q, K, V ~
N(0,1) bf16, 4 fixed key channels ×8 per KV head, random block table), timed by
``bench.common.Timer`` (CUDA-graph replay, L2 flushed, median). Reports µs, KV bytes read,
effective GB/s and % of the device-to-device copy rate measured in the same run, the time
ratio vs FA3 bf16, the store kernel per decode step, and the output cosine vs bf16 SDPA (and, on
the first REF_ROWS sequences, its difference from the PyTorch reference's cosine). FA3 fp8
(bench/fa3.py): the same K/V and q in e4m3 with per-tensor descales, as vLLM's FA3 fp8 path;
q's quantization is done before the timing. Without FA3 its rows are skipped (a printed note).

    PYTHONPATH=. python3 bench/decode.py                 # full grid → bench/results/
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import fa3 as fa3_mod  # noqa: E402
from bench.common import FLUSH_MODES, Timer, copy_bandwidth_gbs, environment  # noqa: E402
from tqattn.attention.turboquant import padded_head_size  # noqa: E402
from tqattn.kernels import step  # noqa: E402
from tqattn.kernels.decode import decode_attention_triton  # noqa: E402
from tqattn.kernels.store import store_kv_triton  # noqa: E402
from tqattn.quant.codec import TQCodec  # noqa: E402
from tqattn.quant.paged import decode_attention_ref, kv_cache_shape  # noqa: E402

VLLM = ["turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"]
OURS = ["tq_k4v4", "tq_k3.5v3.5", "tq_k3v3", "tq_k3o4v3.5"]
COSINE_ONLY = ["tq_k4v3", "tq_k3v4", "tq_k4v2"]
BS = 16
FLUSH_NOTE = {"read": "a 256 MB sum, L2 left holding clean lines",
              "memset": "a 256 MB memset as triton's do_bench",
              "none": "no flush"}


def make_data(b, l, hq, hk, d, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cpu = torch.Generator().manual_seed(seed)
    nblk = b * l // BS
    k = torch.randn(nblk, BS, hk, d, dtype=torch.bfloat16, device="cuda", generator=gen)
    mult = torch.ones(hk, d)
    for h in range(hk):
        mult[h, torch.randperm(d, generator=cpu)[:4]] = 8.0
    k.mul_(mult.to(device="cuda", dtype=torch.bfloat16))
    v = torch.randn(nblk, BS, hk, d, dtype=torch.bfloat16, device="cuda", generator=gen)
    bt = torch.randperm(nblk, device="cuda", generator=gen).to(torch.int32).view(b, l // BS)
    q = torch.randn(b, hq, d, dtype=torch.bfloat16, device="cuda", generator=gen)
    return q, k, v, bt


def contiguous_kv(k, bt, b, l, hk, d):
    out = torch.empty(b, hk, l, d, dtype=k.dtype, device="cuda")
    for i in range(b):
        out[i].copy_(k[bt[i].long()].view(l, hk, d).transpose(0, 1))
    return out


def fill_cache(codec, k, v, hk):
    nblk = k.shape[0]
    cache = torch.empty(kv_cache_shape(nblk, BS, hk, codec), dtype=torch.uint8, device="cuda")
    step = max(1, (1 << 20) // BS)
    for b0 in range(0, nblk, step):
        b1 = min(nblk, b0 + step)
        slots = torch.arange(b0 * BS, b1 * BS, device="cuda", dtype=torch.int64)
        store_kv_triton(codec, k[b0:b1].reshape(-1, hk, k.shape[-1]),
                        v[b0:b1].reshape(-1, hk, k.shape[-1]), cache, slots)
    return cache


def main_shape_case(preset: str, b: int, l: int):
    """(codec, q, cache, block table, seq_lens) of the main shape (32 query / 8 KV heads, head
    size 128) with b sequences of l tokens, the cache filled by the store kernel."""
    q, k, v, bt = make_data(b, l, 32, 8, 128)
    codec = TQCodec(preset, 128, device="cuda")
    cache = fill_cache(codec, k, v, 8)
    lens = torch.full((b,), l, dtype=torch.int32, device="cuda")
    return codec, q, cache, bt, lens


# sequences whose output the PyTorch reference also computes (it decodes whole caches in fp32)
REF_ROWS = 4


def ref_cosines(codec, q, cache, bt, seq_lens, out, ref) -> dict:
    """The kernel's and the PyTorch reference's whole-output cosines vs bf16 on the first
    REF_ROWS sequences, and their difference (issue 25: within ±0.002 at every shape)."""
    n = min(q.shape[0], REF_ROWS)
    ref_out = decode_attention_ref(codec, q[:n], cache, bt[:n], seq_lens[:n])
    sub, want = cosines(out[:n], ref[:n])[0], cosines(ref_out, ref[:n])[0]
    return {"cos_sub": sub, "cos_ref_sub": want, "dcos_ref": sub - want}


def cosines(out, ref):
    o, r = out.float(), ref.float()
    whole = F.cosine_similarity(o.flatten(), r.flatten(), dim=0).item()
    worst = F.cosine_similarity(o, r, dim=-1).min().item()
    return whole, worst


def timed_all(timers, fn):
    """graph_us of the first timer; the other timers' medians (other L2 flush modes) added as
    us_<mode>."""
    r = timers[0].graph_us(fn)
    for t in timers[1:]:
        r[f"us_{t.mode}"] = t.graph_us(fn)["us"]
    return r


def _store_times(timer, codec, q, cache, bt, seq_lens, out) -> dict:
    """One decode step's store of B new tokens: alone (the store kernel) and inside the step
    as the backend runs it (the new K/V handed to the decode, which stores them in its own
    launch on the tensor-core path), timed in turns with the decode alone: the store's share
    is a few µs of 100+."""
    b, hk, d = seq_lens.numel(), cache.shape[1], q.shape[-1]
    kn = torch.randn(b, hk, d, dtype=torch.bfloat16, device="cuda")
    vn = torch.randn(b, hk, d, dtype=torch.bfloat16, device="cuda")
    slots = bt[:, -1].long() * BS + BS - 1
    st = timer.graph_us(lambda: store_kv_triton(codec, kn, vn, cache, slots))
    step_t = timer.paired_us(
        lambda: decode_attention_triton(codec, q, cache, bt, seq_lens, out=out),
        lambda: decode_attention_triton(codec, q, cache, bt, seq_lens, out=out,
                                        new_kv=(kn, vn, slots)))
    return {"store_us": st["us"], "step_us": step_t["b_us"],
            "store_in_step_us": step_t["diff_us"]}


def fa3_rows(timers, fa3, q, k, v, seq_lens, bt, ref, base, bf16_bytes) -> list[dict]:
    """FA3 paged decode on the bf16 cache and on its fp8 (e4m3) copy; [] without FA3."""
    if fa3 is None:
        return []
    out = fa3_mod.decode_bf16(fa3, q, k, v, seq_lens, bt)
    cf = cosines(out, ref)
    r = timed_all(timers, lambda: fa3_mod.decode_bf16(fa3, q, k, v, seq_lens, bt))
    rows = [{**base, "method": "fa3_bf16_paged", "kv_bytes": bf16_bytes, **r, "cos": cf[0],
             "cos_worst": cf[1]}]
    inp = fa3_mod.fp8_inputs(q, k, v)
    try:
        out8 = fa3_mod.decode_fp8(fa3, inp, seq_lens, bt)
    except (RuntimeError, TypeError) as e:   # an FA3 build without fp8
        print(f"  FA3 fp8 failed, no fa3_fp8_paged row: {type(e).__name__}: {str(e)[:200]}",
              flush=True)
        return rows
    c8 = cosines(out8, ref)
    r8 = timed_all(timers, lambda: fa3_mod.decode_fp8(fa3, inp, seq_lens, bt))
    rows.append({**base, "method": "fa3_fp8_paged", "bits_per_elem": 8.0,
                 "kv_bytes": bf16_bytes // 2, **r8, "x_fa3": r8["us"] / r["us"], "cos": c8[0],
                 "cos_worst": c8[1], "cos_vs_fa3_bf16": cosines(out8, out)[0]})
    del inp
    return rows


def padded_rows(timers, presets, q, k, v, bt, seq_lens, ref, base, fa3_us, d_cache):
    """The presets on a cache padded to head size d_cache (the engine's kv_cache_pad_head_size):
    K/V zero-padded before the store, the query padded and the output cut back inside the
    timed call, as the backend does."""
    b, hq, d = q.shape
    hk, pad = k.shape[2], d_cache - d
    rows = []
    for name in presets:
        codec = TQCodec(name, d_cache, device="cuda")
        cache = fill_cache(codec, F.pad(k, (0, pad)), F.pad(v, (0, pad)), hk)
        out = torch.empty((b, hq, d), dtype=torch.bfloat16, device="cuda")

        def call():
            out.copy_(decode_attention_triton(codec, F.pad(q, (0, pad)), cache, bt,
                                              seq_lens)[..., :d])
        call()
        cs = cosines(out, ref)
        r = timed_all(timers, call)
        row = {**base, "method": f"{name}@{d_cache}", "slot_bytes": codec.slot_bytes,
               "bits_per_elem": codec.slot_bytes * 8 / (2 * d),
               "kv_bytes": k.shape[0] * k.shape[1] * hk * codec.slot_bytes,
               "cos": cs[0], "cos_worst": cs[1], "finite": bool(torch.isfinite(out).all()), **r}
        if fa3_us:
            row["x_fa3"] = r["us"] / fa3_us
        print(f"  B={b} D={d} {row['method']:<24} {r['us']:.1f}us x_fa3={row.get('x_fa3', 0):.3f} "
              f"cos={cs[0]:.4f} ({cs[1]:.3f})", flush=True)
        rows.append(row)
        del cache
        torch.cuda.empty_cache()
    return rows


def run_shape(timers, hq, hk, d, b, l, presets, copy_gbs, fa3, cos_only=(), pad_to=None):
    t_start = time.time()
    q, k, v, bt = make_data(b, l, hq, hk, d)
    seq_lens = torch.full((b,), l, dtype=torch.int32, device="cuda")
    rows = []
    base = {"hq": hq, "hk": hk, "d": d, "batch": b, "ctx": l}
    bf16_bytes = b * l * hk * d * 2 * 2

    kc = contiguous_kv(k, bt, b, l, hk, d)
    vc = contiguous_kv(v, bt, b, l, hk, d)
    q4 = q.view(b, hq, 1, d)
    ref = F.scaled_dot_product_attention(q4, kc, vc, enable_gqa=True).view(b, hq, d)
    r = timed_all(timers, lambda: F.scaled_dot_product_attention(q4, kc, vc, enable_gqa=True))
    rows.append({**base, "method": "sdpa_bf16", "kv_bytes": bf16_bytes, **r})
    del kc, vc
    torch.cuda.empty_cache()
    rows += fa3_rows(timers, fa3, q, k, v, seq_lens, bt, ref, base, bf16_bytes)
    torch.cuda.empty_cache()
    fa3_us = next((x["us"] for x in rows if x["method"] == "fa3_bf16_paged"), None)
    for x in rows[1:]:
        print(f"  B={b} L={l} D={d} {x['method']} {x['us']:.1f}us cos={x['cos']:.4f}", flush=True)

    for name in list(presets) + list(cos_only):
        codec = TQCodec(name, d, device="cuda")
        cache = fill_cache(codec, k, v, hk)
        out = torch.full((b, hq, d), float("nan"), dtype=torch.bfloat16, device="cuda")
        decode_attention_triton(codec, q, cache, bt, seq_lens, out=out)
        finite = bool(torch.isfinite(out).all())
        cs = cosines(out, ref)
        row = {**base, "method": name, "slot_bytes": codec.slot_bytes,
               "bits_per_elem": codec.layout.bits_per_element,
               "kv_bytes": b * l * hk * codec.slot_bytes, "cos": cs[0], "cos_worst": cs[1],
               "finite": finite, "kernel": step.plan_decode_store(codec, q, cache),
               **ref_cosines(codec, q, cache, bt, seq_lens, out, ref)}
        if name in presets:
            r = timed_all(timers, lambda: decode_attention_triton(codec, q, cache, bt, seq_lens,
                                                                  out=out))
            row.update(r)
            if fa3_us:
                row["x_fa3"] = r["us"] / fa3_us
            gbs = row["kv_bytes"] / r["us"] / 1e3
            print(f"  B={b} L={l} D={d} {name:<20} {r['us']:.1f}us "
                  f"x_fa3={row.get('x_fa3', 0):.3f} {gbs:.0f}GB/s {100 * gbs / copy_gbs:.0f}% "
                  f"cos={cs[0]:.4f} ({cs[1]:.3f}) vs ref {row['dcos_ref']:+.4f}", flush=True)
            row.update(_store_times(timers[0], codec, q, cache, bt, seq_lens, out))
        rows.append(row)
        del cache, out
        torch.cuda.empty_cache()
    if pad_to:
        rows += padded_rows(timers, presets, q, k, v, bt, seq_lens, ref, base, fa3_us, pad_to)
    for rr in rows:
        if "us" in rr:
            rr["gbs"] = rr["kv_bytes"] / rr["us"] / 1e3
            rr["pct_copy"] = 100 * rr["gbs"] / copy_gbs
            for mode in FLUSH_MODES:
                if f"us_{mode}" in rr:
                    gbs = rr["kv_bytes"] / rr[f"us_{mode}"] / 1e3
                    rr[f"pct_copy_{mode}"] = 100 * gbs / copy_gbs
    del q, k, v, bt
    gc.collect()
    torch.cuda.empty_cache()
    print(f"-- shape hq={hq} hk={hk} d={d} B={b} L={l} done in {time.time() - t_start:.1f}s",
          flush=True)
    return rows


def fmt_table(rows, methods, alt_modes=()):
    head = ("| Hq/Hk/D | B | L | method | bits/elem | µs | x FA3 | KV MB | GB/s | % copy | "
            "store µs: alone / in step (% of attn) | cos (worst), Δ vs reference |"
            + "".join(f" µs, {m} flush (x FA3, % copy) |" for m in alt_modes))
    out = [head, "|" + "---|" * (12 + len(alt_modes))]
    fa3 = {(r["hq"], r["d"], r["batch"], r["ctx"]): r for r in rows
           if r["method"] == "fa3_bf16_paged"}
    for r in rows:
        if r["method"] not in methods or "us" not in r:
            continue
        alt = ""
        for m in alt_modes:
            base = fa3.get((r["hq"], r["d"], r["batch"], r["ctx"]), {}).get(f"us_{m}")
            alt += (f" {r[f'us_{m}']:.1f} ({r[f'us_{m}'] / base:.2f}, "
                    f"{r[f'pct_copy_{m}']:.0f}%) |" if base else f" {r[f'us_{m}']:.1f} |")
        out.append("| {}/{}/{} | {} | {} | {} | {} | {:.1f} | {} | {:.0f} | {:.0f} | {:.0f}% | {} | {} |"
                   .format(r["hq"], r["hk"], r["d"], r["batch"], r["ctx"], r["method"],
                           f"{r['bits_per_elem']:.2f}" if "bits_per_elem" in r else "16",
                           r["us"], f"{r['x_fa3']:.2f}" if "x_fa3" in r else "",
                           r["kv_bytes"] / 1e6, r["gbs"], r["pct_copy"],
                           _store_cell(r),
                           _cos_cell(r))
                   + alt)
    return "\n".join(out)


def _cos_cell(r):
    if "cos" not in r:
        return ""
    cell = f"{r['cos']:.4f} ({r['cos_worst']:.3f})"
    return cell + (f" Δref {r['dcos_ref']:+.4f}" if "dcos_ref" in r else "")


def _store_cell(r):
    if "store_us" not in r:
        return ""
    if "store_in_step_us" not in r:
        return f"{r['store_us']:.1f}"
    return (f"{r['store_us']:.1f} / {r['store_in_step_us']:.1f} "
            f"({100 * r['store_in_step_us'] / r['us']:.1f}%)")


def render(result, tag, presets):
    env, copy = result["env"], result["copy"]
    rows = result["rows"]
    methods = ["sdpa_bf16", "fa3_bf16_paged", "fa3_fp8_paged"] + presets + sorted(
        {r["method"] for r in rows if "@" in r["method"]})  # padded caches (--pad-head-size)
    flushes = result.get("flush", ["memset"])
    md = [f"# {tag}", "", f"- device: {env['device']} ({env['sms']} SMs), torch {env['torch']}, "
          f"triton {env['triton']}, {env['date']}", f"- command: `{env['command']}`",
          f"- D2D copy: {copy['gbs_rw']:.0f} GB/s (read+write, {copy['bytes'] >> 30} GiB)",
          "- decode kernels: " + ", ".join(sorted({f"{r['method']}: {r['kernel']}" for r in rows
                                                   if "kernel" in r and "us" in r})),
          f"- time: CUDA-graph replay, L2 flushed before each rep ({flushes[0]} flush: "
          f"{FLUSH_NOTE[flushes[0]]}), median; x FA3 = time / "
          "fa3_bf16_paged time; fa3_fp8_paged: q, K, V in e4m3 with per-tensor descales (q "
          "quantized before the timing); % copy = effective KV read rate / copy rate; cos vs "
          "bf16 SDPA (worst (seq, head) in brackets); store µs = one decode step's store (B "
          "tokens): alone = the store kernel; in step = decode with the new K/V stored inside "
          "(new_kv: in the decode kernel's own launch on the tensor-core path) minus the "
          "decode alone, median of the differences of the two timed in turns", "",
          fmt_table(rows, methods, flushes[1:]), ""]
    cos_rows = [r for r in rows if "us" not in r and "cos" in r]
    if cos_rows:
        md += ["Cosine only:", ""] + [f"- {r['method']} ({r['bits_per_elem']:.3f} bits/elem) "
                                      f"B={r['batch']} L={r['ctx']}: {r['cos']:.4f} "
                                      f"({r['cos_worst']:.3f})" for r in cos_rows]
    return "\n".join(md) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--contexts", default="4096,16384,65536")
    ap.add_argument("--presets", default=",".join(VLLM + OURS))
    ap.add_argument("--shapes", default="32/8/128",
                    help="query heads/KV heads/head size, comma-separated: each runs the "
                         "batches × contexts grid")
    ap.add_argument("--extra", action="store_true", default=True)
    ap.add_argument("--no-extra", dest="extra", action="store_false")
    ap.add_argument("--flush", default="memset",
                    help="L2 flush modes (bench.common.Timer), comma-separated; the first sets "
                         "µs / x FA3 / % copy, the others add a column each")
    ap.add_argument("--pad-head-size", action="store_true",
                    help="also each preset on a cache zero-padded to the next tensor-core head "
                         "size (80, 96 -> 128), as kv_cache_pad_head_size stores it")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tag", default="decode_h200")
    ap.add_argument("--render", help="only write the markdown of an existing result JSON")
    args = ap.parse_args()

    if args.render:
        with open(args.render) as f:
            res = json.load(f)
        md = render(res, args.tag, args.presets.split(","))
        with open(args.render[:-5] + ".md", "w") as f:
            f.write(md)
        print(md)
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    env = environment()
    print(json.dumps(env), flush=True)
    flushes = args.flush.split(",")
    timers = [Timer(flush=m) for m in flushes]
    copy = copy_bandwidth_gbs()
    print(f"copy bandwidth: {copy['gbs_rw']:.0f} GB/s (read+write)", flush=True)
    fa3 = fa3_mod.load()
    presets = args.presets.split(",")
    rows = []
    result = {"env": env, "copy": copy, "block_size": BS, "rows": rows, "flush": flushes}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{args.tag}.json")

    def save():
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    # the longest context last, after the extra shapes: a time-out loses the least
    ctxs = sorted(int(x) for x in args.contexts.split(","))
    grid = [tuple(int(x) for x in sh.split("/")) for sh in args.shapes.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    shapes = [(*g, b, l) for g in grid for l in ctxs[:-1] for b in batches]
    if args.extra:
        shapes += [(hq, hk, d, 32, 16384) for hq, hk, d in [(64, 8, 128), (32, 8, 64),
                                                            (32, 8, 256)]]
    shapes += [(*g, b, ctxs[-1]) for g in grid for b in batches]
    for hq, hk, d, b, l in shapes:
        rows += run_shape(timers, hq, hk, d, b, l, presets, copy["gbs_rw"], fa3,
                          cos_only=[p for p in VLLM + OURS + COSINE_ONLY if p not in presets]
                          if (hq, d, b, l) == (32, 128, 8, 16384) else (),
                          pad_to=padded_head_size(d) if args.pad_head_size else None)
        save()
    save()
    md = render(result, args.tag, presets)
    with open(os.path.join(args.out, f"{args.tag}.md"), "w") as f:
        f.write(md)
    print(md, flush=True)


if __name__ == "__main__":
    main()
