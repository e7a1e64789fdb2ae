"""The ``tqattn`` command line. Subcommands import what they need lazily."""

from __future__ import annotations

import argparse
import json
import sys


def _print_table(rows: list[dict], cols: list[tuple[str, str]]) -> None:
    cells = [[h for _, h in cols]] + [[_fmt(r.get(k)) for k, _ in cols] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    for j, line in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
        if j == 0:
            print("  ".join("-" * w for w in widths))


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return "" if x is None else str(x)


def cmd_presets(args) -> int:
    from .quant.presets import PRESETS
    from .quant.report import preset_row

    rows = [preset_row(name, args.head_dim) for name in PRESETS]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"KV-cache presets at head size {args.head_dim} (bytes per token per KV head; "
          f"bf16 K+V = {4 * args.head_dim})")
    _print_table(rows, [("preset", "preset"), ("slot_bytes", "bytes"),
                        ("bits_per_element", "bits/elem"), ("compression_vs_bf16", "vs bf16"),
                        ("key_codec", "keys"), ("key_bits", "k bits"), ("value_codec", "values"),
                        ("value_bits", "v bits"), ("description", "notes")])
    return 0


def cmd_codec_report(args) -> int:
    from .quant.report import codec_report

    rep = codec_report(args.head_dim, args.preset or None, seed=args.seed)
    if args.json:
        rep["command"] = "tqattn " + " ".join(sys.argv[1:])
        print(json.dumps(rep, indent=1))
        return 0
    print(f"Codec report, head size {args.head_dim}: heavy-tailed keys with outlier channels "
          f"(gaussian-data attention cosine in the last column)")
    for r in rep["presets"]:
        r["gauss_cos"] = r["gaussian"]["attn_cosine"]
    _print_table(rep["presets"], [("preset", "preset"), ("slot_bytes", "bytes"),
                                  ("bits_per_element", "bits/elem"), ("key_mse", "key mse"),
                                  ("ip_rel_err", "ip rel err"), ("ip_bias", "ip bias"),
                                  ("value_mse", "value mse"), ("attn_cosine", "attn cos"),
                                  ("gauss_cos", "attn cos (gauss)")])
    print("\nExact-law key codebooks (levels in units of 1/sqrt(d)):")
    _print_table(rep["key_codebook"], [("bits", "bits"), ("key_mse", "mse"),
                                       ("theory_mse", "theory"), ("levels", "levels")])
    return 0


def cmd_env(args) -> int:
    from .attention.env_report import collect_env, format_env

    env = collect_env()
    print(json.dumps(env, indent=1, default=str) if args.json else format_env(env))
    return 0


def cmd_generate(args) -> int:
    import time

    from .engine.llm import LLM
    from .engine.llm_engine import format_plan
    from .engine.sampling import SamplingParams

    llm = LLM(args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
              kv_cache_dtype_skip_layers=args.kv_cache_dtype_skip_layers,
              kv_cache_boundary_layers=args.kv_cache_boundary_layers,
              max_model_len=args.max_model_len, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
              load_format=args.load_format, seed=args.seed, device=args.device,
              enforce_eager=args.enforce_eager)
    engine = llm.llm_engine
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            seed=args.seed if args.temperature > 0 else None)
    if args.token_ids:
        prompts = [{"prompt_token_ids": _token_ids(p)} for p in args.prompt]
    elif not args.no_chat and getattr(llm.tokenizer, "chat_template", None):
        prompts = [{"prompt": p, "prompt_token_ids": llm._encode_chat(llm.apply_chat_template(
            [{"role": "user", "content": p}]))} for p in args.prompt]
    else:
        prompts = list(args.prompt)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.json and len(prompts) > 1)
    end = time.perf_counter()

    first = max(o.metrics.first_token_time for o in outputs)
    n_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    n_decode = sum(len(o.outputs[0].token_ids) - 1 for o in outputs)
    timings = {"load_s": engine.load_time, "generate_s": end - start, "prefill_s": first - start,
               "prefill_tok_s": n_prompt / max(first - start, 1e-9),
               "decode_s": end - first, "decode_tok_s": n_decode / max(end - first, 1e-9)}
    if args.json:
        print(json.dumps({
            "model": engine.loaded.name, "device": str(engine.device), "dtype": str(engine.loaded.dtype),
            "kv_cache_dtype": args.kv_cache_dtype, "cache_plan": engine.plan, "timings": timings,
            "outputs": [{"prompt": p if isinstance(p, str) else p.get("prompt"),
                         "prompt_token_ids": o.prompt_token_ids, "token_ids": o.outputs[0].token_ids,
                         "text": o.outputs[0].text, "finish_reason": o.outputs[0].finish_reason}
                        for p, o in zip(args.prompt, outputs)]}, indent=1))
        return 0
    print(format_plan(engine.plan))
    print(f"load {timings['load_s']:.1f} s, prefill {timings['prefill_tok_s']:.1f} tok/s, "
          f"decode {timings['decode_tok_s']:.1f} tok/s")
    for p, o in zip(args.prompt, outputs):
        c = o.outputs[0]
        print(f"\n>>> {p}\n{c.text if llm.tokenizer is not None else c.token_ids}")
    return 0


def _token_ids(s: str) -> list[int]:
    try:
        return [int(t) for t in s.replace(",", " ").split()]
    except ValueError:
        raise SystemExit(f"--token-ids: {s!r} is not a comma-separated list of token ids") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tqattn", description="TurboQuant KV-cache attention")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("presets", help="list KV-cache presets with exact byte accounting")
    p.add_argument("--head-dim", type=_head_dim, default=128)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_presets)

    p = sub.add_parser("codec-report", help="measure each preset's quantization quality")
    p.add_argument("--head-dim", type=_head_dim, default=128)
    p.add_argument("--preset", action="append", type=_preset_name,
                   help="preset to measure (repeatable; default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_codec_report)

    p = sub.add_parser("env", help="device, FlashAttention versions and the version chosen")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_env)

    p = sub.add_parser("generate", help="generate text with a model (default: embedded SmolLM2-135M)")
    p.add_argument("prompt", nargs="+", help="prompt text (chat-formatted when the model has a template)")
    p.add_argument("--model", default="default",
                   help="HF model dir, .gguf file, shipped config name (with --load-format dummy), "
                        "or 'default' (SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--kv-cache-dtype", default="auto", help="'auto' or a preset (see `tqattn presets`)")
    p.add_argument("--kv-cache-dtype-skip-layers", default=[], type=_skip_layers,
                   help="comma-separated layer indices and/or 'sliding_window' kept full precision")
    p.add_argument("--kv-cache-boundary-layers", type=int, default=None,
                   help="keep the first and last N layers full precision (default: the selector's)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy", "gguf", "safetensors"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--no-chat", action="store_true", help="send prompts as plain text, no chat template")
    p.add_argument("--token-ids", action="store_true",
                   help="each PROMPT is a comma-separated list of token ids (models without a tokenizer)")
    p.add_argument("--json", action="store_true", help="print tokens, text, timings and the cache plan as JSON")
    p.set_defaults(func=cmd_generate)
    from .evals.cli import add_eval_parser

    add_eval_parser(sub)
    from .benchmarks.cli import add_bench_parser

    add_bench_parser(sub)
    return ap


def _head_dim(s: str) -> int:
    try:
        d = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"head size must be an integer, got {s!r}") from None
    if d < 8 or d % 2:
        raise argparse.ArgumentTypeError(f"head size {d} not supported: need an even integer >= 8")
    return d


def _skip_layers(s: str) -> list[int | str]:
    return [int(x) if x.strip().lstrip("-").isdigit() else x.strip() for x in s.split(",") if x.strip()]


def _preset_name(s: str) -> str:
    from .quant.presets import get_preset

    try:
        return get_preset(s).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
