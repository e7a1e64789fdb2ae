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
    return ap


def _head_dim(s: str) -> int:
    try:
        d = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"head size must be an integer, got {s!r}") from None
    if d < 8 or d % 2:
        raise argparse.ArgumentTypeError(f"head size {d} not supported: need an even integer >= 8")
    return d


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
