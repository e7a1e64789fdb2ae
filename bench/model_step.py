"""The model outside attention vs the engine's decode step, in one run (issue 24's yardstick).

1. Qwen3-4B (dummy weights) forward over a (1, B) decode batch with a trivial opaque attention
   op (a copy of q), CUDA-graph replay, eager transformers code vs the whole forward compiled
   (torch.compile, the token dimension a dynamic size as the engine marks it — one graph for one
   token, one for more — and the engine's Inductor options; the engine itself compiles layer by
   layer, tqattn.engine.compilation.compile_layers): median ms at each B, and the compile time.
2. The engine's decode step through tqattn.LLM (compiled + CUDA graphs, the defaults) for each
   kv-cache dtype: B sequences with ctx-token prompts, median wall time of pure-decode steps,
   plus the engine's start-up parts and its compilations after start-up.

    python3 bench/model_step.py --out $OUT/model_step.json

Prints a markdown table (decode step / compiled trivial forward at the same B) and writes JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Timer, environment  # noqa: E402
from tqattn.engine import compilation  # noqa: E402

TRIVIAL = "bench_trivial"


@torch.library.custom_op("bench::trivial_attention", mutates_args=())
def trivial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return q.clone()


@trivial_attention.register_fake
def _(q, k, v):
    return torch.empty_like(q)


def _trivial_hook(module, query, key, value, attention_mask, **kwargs):
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
    return trivial_attention(q, k, v).unsqueeze(0), None


def compile_whole():
    """The whole forward compiled (the reference of the latency bound: the best a compiled model
    does), its token dimension dynamic as the engine's layers have it."""
    return torch.compile(compilation.model_logits, dynamic=False,
                         options=dict(compilation.INDUCTOR_OPTIONS))


def call_whole(fn, model, *tensors, unbacked: bool = False):
    args = [t if t.is_inference() else t.clone() for t in tensors]
    compilation._mark_tokens(args, args[0].shape[0], mark=torch._dynamo.decorators.mark_unbacked
                             if unbacked else torch._dynamo.mark_dynamic)
    return fn(model, *args)


@torch.inference_mode()
def model_outside_attention(model_name: str, sizes: list[int], unbacked: bool = False) -> dict:
    from transformers import AttentionInterface

    from tqattn.models import load_model

    AttentionInterface.register(TRIVIAL, _trivial_hook)
    t = time.perf_counter()
    model = load_model(model_name, load_format="dummy", dtype="bfloat16", device="cuda").model
    model.set_attn_implementation(TRIVIAL)
    load_s = time.perf_counter() - t
    timer, out = Timer(flush="none"), {"load_s": load_s, "eager_ms": {}, "compiled_ms": {}}
    ids = torch.randint(0, 1000, (max(sizes),), device="cuda")
    pos = torch.arange(max(sizes), device="cuda") + 1000
    index = torch.arange(max(sizes), device="cuda")
    compiled = compile_whole()
    t = time.perf_counter()
    call_whole(compiled, model, ids, pos, index)
    torch.cuda.synchronize()
    out["compile_s"] = time.perf_counter() - t
    for b in sizes:
        args = (model, ids[:b], pos[:b], index[:b])
        out["eager_ms"][b] = timer.graph_us(lambda: compilation.model_logits(*args))["us"] / 1e3
        out["compiled_ms"][b] = timer.graph_us(
            lambda: call_whole(compiled, *args))["us"] / 1e3
    out["graph_breaks"] = compilation.graph_breaks()
    if unbacked:
        # lab: the token dimension unbacked (the engine's choice before session 31: one graph for
        # every size, but fewer fusions), in a fresh compile
        out["unbacked_ms"] = {}
        fn = compile_whole()
        t = time.perf_counter()
        call_whole(fn, model, ids, pos, index, unbacked=True)
        torch.cuda.synchronize()
        out["unbacked_compile_s"] = time.perf_counter() - t
        for b in sizes:
            args = (model, ids[:b], pos[:b], index[:b])
            out["unbacked_ms"][b] = timer.graph_us(
                lambda: call_whole(fn, *args, unbacked=True))["us"] / 1e3
    del model, compiled
    return out


def profile_steps(step, n: int = 6, top: int = 30) -> dict:
    """torch.profiler over n engine steps: GPU kernel time and busy fraction per step, the
    kernels that take most of it, and the host ops that take most CPU time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t) * 1e3 / n
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    first = spans[0][0] if spans else 0.0
    kernels: dict[str, list[float]] = {}
    for e in events:
        k = kernels.setdefault(e.name[:90], [0.0, 0])
        k[0] += e.time_range.elapsed_us()
        k[1] += 1
    cpu = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0),
                 key=lambda e: -e.self_cpu_time_total)[:top]
    return {"steps": n, "wall_ms": wall_ms,
            "gpu_kernel_ms": sum(e.time_range.elapsed_us() for e in events) / 1e3 / n,
            "gpu_busy_ms": busy / 1e3 / n,
            "gpu_span_ms": (end - first) / 1e3 / n if spans else 0.0,
            "top_kernels": [{"name": k, "ms_per_step": v[0] / 1e3 / n, "count_per_step": v[1] / n}
                            for k, v in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]],
            "top_cpu_ops": [{"name": e.key[:90], "self_cpu_ms_per_step": e.self_cpu_time_total
                             / 1e3 / n, "count_per_step": e.count / n} for e in cpu]}


def decode_steps(model_name: str, kv_cache_dtype: str, sizes: list[int], ctx: int,
                 steps: int, kv_bytes: int, profile: bool = False,
                 fuse_projections: bool | None = None) -> dict:
    from tqattn import LLM, SamplingParams

    budget = 8192
    # the first requests decode while the others prefill: room for that, the timed and the
    # profiled steps, so that every request still runs when the steps are timed
    max_tokens = -(-max(sizes) * ctx // budget) + 2 * steps + 16
    llm = LLM(model_name, load_format="dummy", dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
              max_model_len=ctx + max_tokens, max_num_seqs=max(sizes), max_num_batched_tokens=budget,
              enable_prefix_caching=False, kv_cache_memory_bytes=kv_bytes,
              fuse_projections=fuse_projections)
    engine = llm.llm_engine
    out = {"startup_times": engine.startup_times, "step_ms": {}, "cache_tokens":
           engine.plan["cache_tokens"]}
    for b in sizes:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        g = torch.Generator().manual_seed(b)
        vocab = min(engine.model_info.vocab_size, 1000)
        rids = [f"{b}-{i}" for i in range(b)]
        for rid in rids:
            ids = torch.randint(3, vocab, (ctx,), generator=g).tolist()
            engine.add_request(rid, {"prompt_token_ids": ids}, params)
        while not all(engine.requests[r].seq.num_output_tokens for r in rids):
            engine.step()
        times = []
        for _ in range(steps):  # every request is decoding: pure-decode steps
            t = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - t) * 1e3)
        assert all(r in engine.requests for r in rids), "a request finished during the timed steps"
        out["step_ms"][b] = statistics.median(times)
        if profile:
            out.setdefault("profile", {})[b] = profile_steps(engine.step)
        for rid in rids:
            engine.abort_request(rid)
    out["compilations_after_startup"] = engine.compilation_counts()
    del llm, engine
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="Qwen3-4B")
    p.add_argument("--sizes", default="1,64,256", help="decode batch sizes (tokens per step)")
    p.add_argument("--kv-cache-dtypes", default="auto,turboquant_k3v4_nc")
    p.add_argument("--ctx", type=int, default=1024, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per batch size")
    p.add_argument("--kv-cache-gib", type=float, default=48.0,
                   help="KV-cache budget (bf16 needs ~42 GiB for 256 x 1.1K tokens of Qwen3-4B)")
    p.add_argument("--unbacked", action="store_true",
                   help="also time the trivial forward compiled with an unbacked token size")
    p.add_argument("--fuse-projections", choices=["default", "on", "off", "both"],
                   default="default", help="the engine's fuse_projections; both: off, then on")
    p.add_argument("--skip-engine", action="store_true", help="only the trivial forward")
    p.add_argument("--skip-trivial", action="store_true", help="only the engine's steps")
    p.add_argument("--profile", action="store_true",
                   help="also profile a few decode steps per batch size (torch.profiler)")
    p.add_argument("--out", default="model_step.json")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    result = {"env": environment(), "args": vars(args), "engine": {},
              "trivial": None if args.skip_trivial else model_outside_attention(args.model, sizes,
                                                                                args.unbacked)}
    gc.collect()
    torch.cuda.empty_cache()
    fuse = {"default": [(None, "")], "on": [(True, "")], "off": [(False, "")],
            "both": [(False, " unfused"), (True, " fused")]}[args.fuse_projections]
    for dtype in ([] if args.skip_engine else args.kv_cache_dtypes.split(",")):
        for f, tag in fuse:
            result["engine"][dtype + tag] = decode_steps(
                args.model, dtype, sizes, args.ctx, args.steps, int(args.kv_cache_gib * 2**30),
                args.profile, f)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))

    tr = result["trivial"] or {"compile_s": float("nan"), "graph_breaks": None,
                               "eager_ms": dict.fromkeys(sizes, float("nan")),
                               "compiled_ms": dict.fromkeys(sizes, float("nan"))}
    print(f"\n{args.model}, trivial attention op: compile {tr['compile_s']:.1f} s, "
          f"graph breaks {tr['graph_breaks'] or 'none'}")
    dtypes = list(result["engine"])
    print("| B | eager fwd ms | compiled fwd ms | " + " | ".join(
        f"{d} step ms (× compiled fwd)" for d in dtypes) + " |")
    print("|---|---|---|" + "---|" * len(dtypes))
    for b in sizes:
        cells = [f"{result['engine'][d]['step_ms'][b]:.2f} "
                 f"({result['engine'][d]['step_ms'][b] / tr['compiled_ms'][b]:.2f}×)"
                 for d in dtypes]
        print(f"| {b} | {tr['eager_ms'][b]:.2f} | {tr['compiled_ms'][b]:.2f} | "
              + " | ".join(cells) + " |")
    for d in dtypes:
        e = result["engine"][d]
        parts = ", ".join(f"{k} {v:.1f} s" for k, v in e["startup_times"].items())
        c = e["compilations_after_startup"]
        print(f"{d}: start-up {parts}; compilations after start-up: Dynamo {c['dynamo']}, "
              f"Triton {c['triton']} {c['triton_kernels'][:5]}")
    for d in dtypes:
        for b, pr in result["engine"][d].get("profile", {}).items():
            print(f"\n{d} B={b}: wall {pr['wall_ms']:.2f} ms/step, GPU kernels "
                  f"{pr['gpu_kernel_ms']:.2f}, busy {pr['gpu_busy_ms']:.2f}, span "
                  f"{pr['gpu_span_ms']:.2f}")
            for k in pr["top_kernels"]:
                print(f"  {k['ms_per_step']:7.3f} ms {k['count_per_step']:6.1f}x  {k['name']}")
            for k in pr["top_cpu_ops"][:8]:
                print(f"  cpu {k['self_cpu_ms_per_step']:7.3f} ms {k['count_per_step']:6.1f}x  "
                      f"{k['name']}")
    if args.unbacked:
        print("unbacked token size: compile %.1f s; " % tr["unbacked_compile_s"] + ", ".join(
            f"B={b}: {tr['unbacked_ms'][b]:.2f} ms" for b in sizes))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
