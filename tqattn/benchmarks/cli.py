"""`tqattn bench ...`: wired into tqattn/cli.py with `add_bench_parser(subparsers)`."""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from pathlib import Path

from tqattn.evals.cli import _positive


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    from .throughput import WORKLOADS

    bench = subparsers.add_parser("bench", help="benchmarks: throughput")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    p = sub.add_parser(
        "throughput", help="offline generation throughput for several kv-cache dtypes",
        description="Offline throughput of one workload for each kv-cache dtype, with identical engine "
                    "arguments: tokens/s, TTFT/TPOT percentiles, the step timeline, preemptions, "
                    "compilations, start-up. Writes JSON, markdown and a step-time plot to --out-dir.")
    p.add_argument("--workload", required=True, choices=list(WORKLOADS),
                   help="; ".join(f"{w.name}: {w.num_prompts} x {w.input_len} in / {w.output_len} out"
                                  + (f", {w.kv_cache_memory_bytes / 2**30:g} GiB KV" if w.kv_cache_memory_bytes
                                     else "") for w in WORKLOADS.values()))
    p.add_argument("--kv-cache-dtypes", type=_str_list, default=["auto", "turboquant_k3v4_nc"],
                   help="comma-separated kv-cache dtypes, run in this order (ratios are vs the first)")
    p.add_argument("--num-prompts", type=_positive, help="override the workload's number of prompts")
    p.add_argument("--input-len", type=_positive, help="override the workload's prompt length")
    p.add_argument("--output-len", type=_positive, help="override the workload's output length")
    p.add_argument("--warmup-prompts", type=int, default=0,
                   help="generate this many prompts (up to 16 tokens each) before the measured run")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=0, help="prompt token ids and engine seed")
    p.add_argument("--out-dir", default="bench_throughput", help="JSON, markdown and PNG go here")
    add_engine_args(p)
    p.set_defaults(func=cmd_throughput)
    return bench


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine flags of the benchmark (one place, to be shared with the other commands)."""
    p.add_argument("--model", default="Qwen3-4B",
                   help="HF model dir, .gguf, or a shipped config name (dummy weights), e.g. Qwen3-4B, Llama-3.1-8B")
    p.add_argument("--load-format", default=None, choices=["auto", "dummy", "gguf", "safetensors"],
                   help="default: dummy for a shipped config name, else auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--kv-cache-dtype-skip-layers", type=_skip_layers, default=[],
                   help="comma-separated layer indices and/or 'sliding_window' kept full precision")
    p.add_argument("--kv-cache-boundary-layers", type=int, default=0,
                   help="keep the first and last N layers full precision (default 0: every layer "
                        "uses the dtype under test)")
    p.add_argument("--max-model-len", type=_positive, help="default: input + output length")
    p.add_argument("--max-num-seqs", type=_positive, default=256)
    p.add_argument("--max-num-batched-tokens", type=_positive, default=8192)
    p.add_argument("--block-size", type=_positive, default=16)
    p.add_argument("--kv-cache-memory-bytes", type=_bytes,
                   help="KV-cache budget, e.g. 8GiB (default: the workload's, else gpu_memory_utilization)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--num-gpu-blocks-override", type=_positive)
    p.add_argument("--enforce-eager", action="store_true", help="no compilation, no CUDA graphs")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")


def engine_kwargs_from_args(args, workload) -> dict:
    """LLM(...) keyword arguments from add_engine_args' flags (prefix caching always off)."""
    from tqattn.models import model_config_path

    load_format = args.load_format or ("dummy" if model_config_path(args.model) is not None else "auto")
    kw = dict(load_format=load_format, dtype=args.dtype, kv_cache_dtype_skip_layers=args.kv_cache_dtype_skip_layers,
              kv_cache_boundary_layers=args.kv_cache_boundary_layers,
              max_model_len=args.max_model_len or workload.input_len + workload.output_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              block_size=args.block_size, enable_prefix_caching=False,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes or workload.kv_cache_memory_bytes,
              gpu_memory_utilization=args.gpu_memory_utilization,
              num_gpu_blocks_override=args.num_gpu_blocks_override, seed=args.seed,
              enforce_eager=args.enforce_eager, device=args.device)
    return {k: v for k, v in kw.items() if v is not None}


def cmd_throughput(args) -> int:
    import dataclasses

    from . import report
    from .throughput import WORKLOADS, run_throughput

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    w = WORKLOADS[args.workload]
    w = dataclasses.replace(w, **{k: v for k, v in (("num_prompts", args.num_prompts),
                                                     ("input_len", args.input_len),
                                                     ("output_len", args.output_len)) if v is not None})
    engine_kwargs = engine_kwargs_from_args(args, w)
    command = "tqattn " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    result = run_throughput(args.model, args.kv_cache_dtypes, w, engine_kwargs, seed=args.seed,
                            temperature=args.temperature, warmup_prompts=args.warmup_prompts, command=command)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"throughput_{w.name}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str))
    (out / f"{stem}.md").write_text(report.markdown(result))
    plotted = report.plot_steps(result, out / f"{stem}_steps.png")
    print(report.format_table(result))
    print(f"wrote {out / stem}.json, .md" + (f", {stem}_steps.png" if plotted else ""))
    return 0


def _str_list(s: str) -> list[str]:
    items = [x.strip() for x in s.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {s!r}")
    return items


def _skip_layers(s: str) -> list[int | str]:
    return [int(x) if x.strip().lstrip("-").isdigit() else x.strip() for x in s.split(",") if x.strip()]


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def _bytes(s: str) -> int:
    t = s.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    try:
        v = float(num) * _UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"expected a byte count like 8GiB, 512MiB or 1073741824, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive byte count, got {s!r}")
    return int(v)
