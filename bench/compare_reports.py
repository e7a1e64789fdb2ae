"""Paired comparison of one preset across two `tqattn eval report` runs on the same windows.

Two runs of the same perplexity specs score the same tokens (windows are a function of the spec),
so a setting that is not a preset — boundary layers, skip layers — can be compared like presets:
a paired bootstrap of figure(A) − figure(B) over the shared units (tqattn.evals.stats).

    python3 bench/compare_reports.py A/report.json B/report.json [--model-a NAME] [--model-b NAME]
        [--presets P,...] [--specs S,...] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tqattn.evals import ppl, stats  # noqa: E402

METRICS = ("kl", "ppl_delta_pct", "top1")


def _model(report: dict, name: str | None) -> dict:
    models = [m for m in report["models"] if "ppl" in m]
    if name is not None:
        models = [m for m in models if m["name"] == name]
    if len(models) != 1:
        known = [m["name"] for m in report["models"]]
        raise SystemExit(f"need exactly one model with perplexity results (--model-*): {known}")
    return models[0]


def compare(ra: dict, rb: dict, presets: list[str], specs: list[str]) -> list[dict]:
    rows = []
    for p in presets:
        ua, ub = ppl.pooled_units(ra, p, specs), ppl.pooled_units(rb, p, specs)
        rows.append({"preset": p, **{m: stats.paired_diff_ci(ua, ub, m) for m in METRICS}})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--model-a")
    ap.add_argument("--model-b")
    ap.add_argument("--presets", help="default: the presets both runs have")
    ap.add_argument("--specs", help="default: the specs both runs have")
    ap.add_argument("--out")
    args = ap.parse_args()
    reps = [json.load(open(p)) for p in (args.a, args.b)]
    ma, mb = _model(reps[0], args.model_a), _model(reps[1], args.model_b)
    ra, rb = ma["ppl"], mb["ppl"]
    specs = (args.specs.split(",") if args.specs else
             [s["name"] for s in ra["specs"] if s["name"] in {t["name"] for t in rb["specs"]}])
    presets = (args.presets.split(",") if args.presets else
               [p for p in ra["presets"] if p in rb["presets"]])
    rows = compare(ra, rb, presets, specs)
    command = "python3 bench/compare_reports.py " + " ".join(sys.argv[1:])
    lines = [f"# {ma['name']} ({args.a}) − {mb['name']} ({args.b})", "",
             f"command: `{command}`  ",
             f"Specs pooled: {', '.join(specs)}; paired bootstrap, 95 % intervals; "
             f"negative = A lower.", "",
             "| preset | ΔKL | Δ(PPL Δ %) | Δtop-1 |", "|---|---|---|---|"]
    for r in rows:
        cells = [f"{r[m]['diff']:+.4f} [{r[m]['low']:+.4f}, {r[m]['high']:+.4f}]" for m in METRICS]
        lines.append(f"| {r['preset']} | " + " | ".join(cells) + " |")
    md = "\n".join(lines) + "\n"
    print(md)
    if args.out:
        with open(args.out, "w") as f:
            f.write(md)


if __name__ == "__main__":
    main()
