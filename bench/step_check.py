"""Re-read the step check of recorded `tqattn bench throughput` runs under the current rule.

The throughput JSON keeps every step's record (its ``timeline``), so the check
(:func:`tqattn.benchmarks.report.step_check`) can be evaluated again on the same steps when the
rule changes — no new run, the same measurements.

    python bench/step_check.py bench/results/throughput_cache-bound_h200_s17.json.xz \\
        bench/results/throughput_chat_h200_s17.json --out bench/results/step_check_s17_h200.md
"""

from __future__ import annotations

import argparse
import json
import lzma
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqattn.benchmarks import report  # noqa: E402
from tqattn.engine.outputs import StepRecord  # noqa: E402


def records(timeline: dict) -> list[StepRecord]:
    n = len(timeline["kind"])
    return [StepRecord(**{k: v[i] for k, v in timeline.items()}) for i in range(n)]


def load(path: str) -> dict:
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="throughput JSON files (.json or .json.xz)")
    p.add_argument("--out", default=None, help="markdown file to write")
    a = p.parse_args()
    lines = ["# Step check re-read from recorded throughput runs", "",
             f"- command: `python {' '.join(sys.argv)}`", "", f"Rule: {report.STEP_RULE}.", "",
             "| run | kv-cache dtype | device | steps | recorded check (host wall) | check now | "
             "timeline | on host wall times | worst now |",
             "|---|---|---|---|---|---|---|---|---|"]
    for path in a.runs:
        run = load(path)
        device = run.get("env", {}).get("device_name") or run.get("env", {}).get("device")
        for r in run["results"]:
            old, new = r["step_check"], report.step_check(records(r["timeline"]))
            worst = "; ".join(f"step {b['index']} {b['kind']} {b['ms']:.1f} ms vs {b['median_ms']:.1f}"
                              for b in new["worst"][:3]) or "-"
            lines.append(f"| {Path(path).name} | `{r['kv_cache_dtype']}` | {device} | {new['num_steps']} | "
                         f"{'ok' if old['ok'] else 'FAIL'} ({old['num_violations']}) | "
                         f"{'ok' if new['ok'] else 'FAIL'} ({new['num_violations']}) | {new['timeline']} | "
                         f"{new['host_wall_violations']} | {worst} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
