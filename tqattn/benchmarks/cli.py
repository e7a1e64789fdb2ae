"""`tqattn bench ...`: wired into tqattn/cli.py with `add_bench_parser(subparsers)`."""

from __future__ import annotations

import argparse
import json

from tqattn.engine.arg_utils import add_engine_args, kv_cache_dtype, non_negative_int, temperature
from tqattn.engine.arg_utils import engine_kwargs_from_args as engine_kwargs
from tqattn.evals.cli import _positive, command_line, setup_run_output, writable_dir


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    from .throughput import WORKLOADS

    bench = subparsers.add_parser("bench", help="benchmarks: throughput, serve")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    p = sub.add_parser(
        "throughput", help="offline generation throughput for several kv-cache dtypes",
        description="Offline throughput of one workload for each kv-cache dtype, with identical engine "
                    "arguments: tokens/s, TTFT/TPOT percentiles, the step timeline, preemptions, "
                    "compilations, start-up. Writes JSON, markdown and a step-time plot to --out-dir. "
                    f"Default model: {DEFAULT_MODEL} with dummy weights, on a GPU (on a CPU name a small "
                    "one, e.g. --model qwen3-tiny).")
    p.add_argument("--workload", required=True, choices=list(WORKLOADS),
                   help="; ".join(f"{w.name}: {w.num_prompts} x {w.input_len} in / {w.output_len} out"
                                  + (f", {w.kv_cache_memory_bytes / 2**30:g} GiB KV" if w.kv_cache_memory_bytes
                                     else "") for w in WORKLOADS.values()))
    p.add_argument("--kv-cache-dtypes", type=_str_list, default=["auto", "turboquant_k3v4_nc"],
                   help="comma-separated kv-cache dtypes, run in this order (ratios are vs the first)")
    p.add_argument("--num-prompts", type=_positive, help="override the workload's number of prompts")
    p.add_argument("--input-len", type=_positive, help="override the workload's prompt length")
    p.add_argument("--output-len", type=_positive, help="override the workload's output length")
    p.add_argument("--warmup-prompts", type=non_negative_int, default=0,
                   help="generate this many prompts (up to 16 tokens each) before the measured run")
    p.add_argument("--temperature", type=temperature, default=0.0, help="0 = greedy")
    p.add_argument("--out-dir", default="bench_throughput", help="JSON, markdown and PNG go here")
    _add_engine_args(p)
    p.set_defaults(func=cmd_throughput)

    p = sub.add_parser(
        "serve", help="streaming load against an OpenAI-compatible server",
        description="N streaming completions sent all at once (or at --request-rate) against --url, or "
                    "against a `tqattn serve` started per kv-cache dtype with --server-args; reports TTFT, "
                    "TPOT and end-to-end percentiles and throughput (JSON + markdown in --out-dir).")
    p.add_argument("--url", help="a running server (http://host:port); default: start `tqattn serve` per dtype")
    p.add_argument("--server-args", default="--model Qwen3-4B --load-format dummy",
                   help="flags for the `tqattn serve` this command starts (engine flags as in tqattn generate)")
    p.add_argument("--kv-cache-dtypes", type=_str_list, default=["auto", "turboquant_k3v4_nc"],
                   help="comma-separated kv-cache dtypes, one server each (not with --url)")
    p.add_argument("--model", dest="served_model", help="the API model name to send (default: none)")
    p.add_argument("--num-prompts", type=_positive, default=64, help="requests")
    p.add_argument("--input-len", type=_positive, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=_positive, default=32, help="generated tokens per request")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (Poisson arrivals); inf: all at once")
    p.add_argument("--max-concurrency", type=_positive, help="requests in flight at most")
    p.add_argument("--warmup-prompts", type=non_negative_int, default=4,
                   help="requests sent (and not measured) first")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrivals")
    p.add_argument("--out-dir", default="bench_serve", help="JSON and markdown go here")
    p.add_argument("--tag", default="serve", help="file name stem")
    p.set_defaults(func=cmd_serve)
    return bench


def cmd_serve(args) -> int:
    from .serve import run_bench

    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    return run_bench(args, command_line())


# the default model: a GPU benchmark's (~16 GB of fp32 dummy weights on a CPU)
DEFAULT_MODEL = "Qwen3-4B"


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """The shared engine flags with the benchmark's defaults (a shipped config with dummy weights,
    every layer on the dtype under test, the anchor runs' step budget); the kv-cache dtype comes
    from --kv-cache-dtypes and prefix caching is always off."""
    add_engine_args(p, exclude={
        "kv_cache_dtype": "the kv-cache dtypes to compare come from --kv-cache-dtypes",
        "enable_prefix_caching": "prefix caching is always off, so that every prompt is prefilled"})
    p.set_defaults(model=None, load_format=None, kv_cache_boundary_layers=0,
                   max_model_len=None, max_num_batched_tokens=8192)


def engine_kwargs_from_args(args, workload) -> dict:
    """LLM(...) keyword arguments from the engine flags, for one workload (--seed also seeds the
    prompts)."""
    from tqattn.models import model_config_path

    args = argparse.Namespace(**vars(args))
    if args.model is None:
        import torch

        if args.device == "cpu" or not torch.cuda.is_available():
            raise ValueError(f"bench throughput's default model, {DEFAULT_MODEL} with dummy weights, is "
                             f"a GPU benchmark (~16 GB of fp32 weights on a CPU); on a CPU name a "
                             f"small one, e.g. --model qwen3-tiny")
        args.model = DEFAULT_MODEL
    if args.load_format is None:
        args.load_format = "dummy" if model_config_path(args.model) is not None else "auto"
    args.max_model_len = args.max_model_len or workload.input_len + workload.output_len
    args.kv_cache_memory_bytes = args.kv_cache_memory_bytes or workload.kv_cache_memory_bytes
    args.enable_prefix_caching = False
    kw = engine_kwargs(args)
    kw.pop("model")
    return kw


def cmd_throughput(args) -> int:
    import dataclasses

    from . import report
    from .throughput import WORKLOADS, run_throughput

    setup_run_output()
    w = WORKLOADS[args.workload]
    w = dataclasses.replace(w, **{k: v for k, v in (("num_prompts", args.num_prompts),
                                                     ("input_len", args.input_len),
                                                     ("output_len", args.output_len)) if v is not None})
    engine_kwargs = engine_kwargs_from_args(args, w)
    out = writable_dir(args.out_dir)
    command = command_line()
    result = run_throughput(args.model or DEFAULT_MODEL, args.kv_cache_dtypes, w, engine_kwargs, seed=args.seed,
                            temperature=args.temperature, warmup_prompts=args.warmup_prompts, command=command)
    stem = f"throughput_{w.name}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str))
    (out / f"{stem}.md").write_text(report.markdown(result))
    plotted = report.plot_steps(result, out / f"{stem}_steps.png")
    print(report.format_table(result))
    print(f"wrote {out / stem}.json, .md" + (f", {stem}_steps.png" if plotted else ""))
    return 0


def _str_list(s: str) -> list[str]:
    """Comma-separated kv-cache dtypes, each checked as --kv-cache-dtype is."""
    items = [kv_cache_dtype(x.strip()) for x in s.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {s!r}")
    return items
