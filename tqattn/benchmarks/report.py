"""Summaries of a throughput run: request metrics, step timeline, the step-time check, and the
markdown / plot / terminal table written from the result dict."""

from __future__ import annotations

import logging
import statistics
from pathlib import Path

from tqattn import text_table

logger = logging.getLogger(__name__)

STEP_RULE = ("no step takes more than 2x the median of the steps of its kind and size "
             "(decode: the CUDA graph bucket, else the batch; other kinds: the token count, both "
             "rounded up to a power of two); a step's time is read on the device's timeline where "
             "there is one (CUDA: its device time plus the device's idle gap before it), else it is "
             "the host's wall time")


def percentiles(xs: list[float]) -> dict | None:
    if not xs:
        return None
    s = sorted(xs)

    def q(p):  # linear interpolation between closest ranks
        k = (len(s) - 1) * p
        lo, hi = int(k), min(int(k) + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)
    return {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "mean": statistics.fmean(s), "max": s[-1]}


def request_metrics(outputs, elapsed_s: float) -> dict:
    """Token counts, throughput, and per-request TTFT / time per output token (ms)."""
    n_in = sum(len(o.prompt_token_ids) for o in outputs)
    n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttft, tpot = [], []
    for o in outputs:
        m, k = o.metrics, len(o.outputs[0].token_ids)
        ttft.append((m.first_token_time - m.arrival_time) * 1e3)
        if k > 1:
            tpot.append((m.finished_time - m.first_token_time) * 1e3 / (k - 1))
    return {"num_requests": len(outputs), "input_tokens": n_in, "output_tokens": n_out,
            "output_tok_s": n_out / elapsed_s, "total_tok_s": (n_in + n_out) / elapsed_s,
            "ttft_ms": percentiles(ttft), "tpot_ms": percentiles(tpot)}


def timeline_columns(records) -> dict:
    fields = ("kind", "num_tokens", "num_seqs", "num_decodes", "graph_bucket", "wall_ms", "host_ms",
              "num_preempted", "device_ms", "device_idle_ms")
    return {f: [getattr(r, f) for r in records] for f in fields}


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def step_size(r) -> int:
    if r.kind == "decode" and r.graph_bucket is not None:
        return r.graph_bucket
    return _pow2(r.num_tokens)


def step_summary(records) -> dict:
    """Per kind: steps, tokens, time; the slowest step; the median pure-decode step at the
    largest decode batch (wall and host time)."""
    by_kind = {}
    for kind in ("decode", "prefill", "mixed"):
        rs = [r for r in records if r.kind == kind]
        if rs:
            ms = [r.wall_ms for r in rs]
            by_kind[kind] = {"steps": len(rs), "tokens": sum(r.num_tokens for r in rs),
                             "total_s": sum(ms) / 1e3, "median_ms": statistics.median(ms), "max_ms": max(ms)}
    out = {"num_steps": len(records), "total_tokens": sum(r.num_tokens for r in records),
           "total_s": sum(r.wall_ms for r in records) / 1e3, "by_kind": by_kind,
           "max_step": None, "decode_at_largest_batch": None}
    if records:
        i = max(range(len(records)), key=lambda j: records[j].wall_ms)
        r = records[i]
        out["max_step"] = {"index": i, "kind": r.kind, "num_tokens": r.num_tokens, "num_seqs": r.num_seqs,
                           "wall_ms": r.wall_ms}
    decodes = [r for r in records if r.kind == "decode"]
    if decodes:
        batch = max(r.num_seqs for r in decodes)
        rs = [r for r in decodes if r.num_seqs == batch]
        out["decode_at_largest_batch"] = {
            "batch": batch, "steps": len(rs), "graph_bucket": rs[0].graph_bucket,
            "median_ms": statistics.median(r.wall_ms for r in rs),
            "median_host_ms": statistics.median(r.host_ms for r in rs),
            "device_idle_fraction": device_idle_fraction(rs)}
    out["decode_device_idle_fraction"] = device_idle_fraction(decodes)
    return out


def device_idle_fraction(records) -> float | None:
    """Share of the device's time spent idle before these steps (CUDA events; None without)."""
    rs = [r for r in records if r.device_ms is not None and r.device_idle_ms is not None]
    if not rs:
        return None
    idle = sum(r.device_idle_ms for r in rs)
    return idle / (idle + sum(r.device_ms for r in rs))


def step_time_ms(r) -> float:
    """A step's time for the step check. On CUDA, the device's timeline: from the previous
    step's end to this step's end (device time + the idle gap before it; a mid-run stall such as
    a compilation leaves the device idle, so it shows). The host's wall time is not used there:
    with async scheduling a step's tokens reach the host only after the next step is launched,
    so a decode step followed by a long eager launch looks slow on the host while the device ran
    it at its normal speed. Elsewhere (CPU), the host's wall time."""
    if r.device_ms is not None:
        return r.device_ms + (r.device_idle_ms or 0.0)
    return r.wall_ms


def _violations(records, groups, factor: float, time_of) -> list[dict]:
    bad = []
    for (kind, size), idx in groups.items():
        med = statistics.median(time_of(records[i]) for i in idx)
        bad += [{"index": i, "kind": kind, "size": size, "ms": time_of(records[i]),
                 "wall_ms": records[i].wall_ms, "median_ms": med, "ratio": time_of(records[i]) / med}
                for i in idx if time_of(records[i]) > factor * med]
    return sorted(bad, key=lambda b: -b["ratio"])


def step_check(records, factor: float = 2.0) -> dict:
    """The step-time rule: steps slower than factor x the median of their (kind, size) group,
    timed by :func:`step_time_ms`; ``host_wall_violations`` counts the same rule on the host's
    wall times, for information."""
    groups: dict[tuple[str, int], list[int]] = {}
    for i, r in enumerate(records):
        groups.setdefault((r.kind, step_size(r)), []).append(i)
    bad = _violations(records, groups, factor, step_time_ms)
    device = bool(records) and all(r.device_ms is not None for r in records)
    return {"rule": STEP_RULE, "factor": factor, "timeline": "device" if device else "host wall",
            "ok": not bad, "num_steps": len(records), "num_groups": len(groups),
            "num_violations": len(bad), "worst": bad[:10],
            "host_wall_violations": len(_violations(records, groups, factor, lambda r: r.wall_ms))}


# ---- output --------------------------------------------------------------------------------------

def _f(x, fmt="{:.1f}", na="n/a"):
    return na if x is None else fmt.format(x)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def _pct(d: dict | None, key: str) -> float | None:
    return None if d is None else d[key]


def summary_rows(result: dict) -> list[dict]:
    """One flat row per dtype (what the terminal table and the markdown's main table show)."""
    rows, base = [], result["results"][0] if result["results"] else None
    for r in result["results"]:
        d = r["steps"]["decode_at_largest_batch"]
        comp = r["compilations_after_startup"]
        rows.append({
            "kv_cache_dtype": r["kv_cache_dtype"],
            "output_tok_s": r["output_tok_s"],
            "vs_first": r["output_tok_s"] / base["output_tok_s"] if base["output_tok_s"] else None,
            "total_tok_s": r["total_tok_s"],
            "decode_ms": d["median_ms"] if d else None, "decode_batch": d["batch"] if d else None,
            "decode_host_ms": d["median_host_ms"] if d else None,
            "decode_idle": d.get("device_idle_fraction") if d else None,
            "ttft_p50_ms": _pct(r["ttft_ms"], "p50"), "tpot_p50_ms": _pct(r["tpot_ms"], "p50"),
            "max_step_ms": r["steps"]["max_step"]["wall_ms"] if r["steps"]["max_step"] else None,
            "preemptions": r["num_preemptions"],
            "recomputed_pct": 100 * r["recomputed_fraction_of_prompt_tokens"],
            "compilations": comp["total"],
            "step_check": f"{'ok' if r['step_check']['ok'] else 'FAIL'} ({r['step_check']['num_violations']})",
        })
    return rows


_TABLE = [("kv_cache_dtype", "kv-cache dtype", "{}"), ("output_tok_s", "out tok/s", "{:.0f}"),
          ("vs_first", "x first", "{:.2f}"), ("total_tok_s", "total tok/s", "{:.0f}"),
          ("decode_ms", "decode ms", "{:.2f}"), ("decode_batch", "at batch", "{}"),
          ("decode_host_ms", "host ms", "{:.2f}"), ("decode_idle", "dev idle", "{:.1%}"),
          ("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"),
          ("tpot_p50_ms", "TPOT p50 ms", "{:.2f}"), ("max_step_ms", "max step ms", "{:.0f}"),
          ("preemptions", "preempt", "{}"), ("recomputed_pct", "recomp %", "{:.1f}"),
          ("compilations", "compiles", "{}"), ("step_check", "2x check", "{}")]


def format_table(result: dict) -> str:
    return text_table.format_table([h for _, h, _ in _TABLE],
                                   [[_f(row[k], fmt) for k, _, fmt in _TABLE] for row in summary_rows(result)])


def _layers_summary(attention: list[dict]) -> str:
    """'TURBOQUANT fa3: layers 0-35' style runs of consecutive layers with the same choice."""
    runs, out = [], []
    for a in attention:
        key = (a["backend"], a["fa_version"], a.get("paged_fa3_decode"))
        if runs and runs[-1][0] == key and runs[-1][2] == a["layer"] - 1:
            runs[-1][2] = a["layer"]
        else:
            runs.append([key, a["layer"], a["layer"]])
    for (backend, fa, paged), lo, hi in runs:
        fa_s = f"FA{fa}" if fa is not None else "SDPA"
        extra = ", paged FA3 decode" if paged else ""
        out.append(f"{backend} (prefill {fa_s}{extra}): layers {lo}-{hi}" if hi > lo
                   else f"{backend} (prefill {fa_s}{extra}): layer {lo}")
    return "; ".join(out)


def provenance(env: dict, command: str | None) -> list[str]:
    """The device, the versions and the command of a result (collect_env's dict), as markdown lines."""
    dev = env.get("device_name") or env.get("device") or ("cuda" if env.get("cuda_available") else "cpu")
    versions = ", ".join(f"{name} {env[key]}" for name, key in (
        ("python", "python"), ("torch", "torch"), ("triton", "triton"), ("transformers", "transformers"),
        ("tqattn", "tqattn"), ("tokenspeed-fa3", "tokenspeed_fa3"), ("FlashAttention versions", "fa_versions"))
        if env.get(key) is not None)
    return [f"Device {dev}; {versions}.", f"- command: `{command}`" if command else "- command: not recorded."]


def describe_builds(builds: dict) -> str:
    """The warm-up's Triton builds (loaded from the disk cache / compiled) and the precompile's
    (an engine's ``startup_builds``)."""
    w, p = builds.get("warmup"), builds.get("precompile")
    text = (f"warm-up: {w['triton_loaded']} Triton builds from the disk cache, "
            f"{w['triton_compiled']} compiled, {w['dynamo']} Dynamo compiles" if w else "no warm-up")
    if "precompile" in builds:
        text += ("; precompile failed (see the log)" if p is None else
                 f"; precompile: {p['compiled']} of {p['submitted']} new builds by {p['workers']} "
                 f"workers in {p['total_s']:.1f} s, {p['cached']} already cached, "
                 f"{len(p['failed']) + len(p['unbuilt'])} not precompiled")
    return text


def startup_line(r: dict) -> str:
    """A dtype's start-up parts (s), then what its warm-up built and the precompile's summary."""
    line = f"- `{r['kv_cache_dtype']}`: " + ", ".join(f"{k} {v:.2f}" for k, v in r["startup_times"].items())
    builds = r.get("startup_builds")
    return line + f"; {describe_builds(builds)}" if builds else line


def markdown(result: dict) -> str:
    w, res = result["workload"], result["results"]
    lines = [
        f"# Throughput: {w['name']} ({w['num_prompts']} x {w['input_len']} in / {w['output_len']} out)",
        "",
        f"Model `{result['model']}`.",
        *provenance(result["env"], result.get("command")),
        f"Engine arguments (the same for every dtype): `{result['engine_kwargs']}`; random prompt ids "
        f"(seed {result['seed']}), ignore_eos, temperature {result['temperature']}, "
        f"warm-up prompts {result['warmup_prompts']}.",
        "",
        "| measure | " + " | ".join(f"`{r['kv_cache_dtype']}`" for r in res) + " |",
        "|---|" + "---|" * len(res),
    ]

    def row(name, fn):
        lines.append(f"| {name} | " + " | ".join(fn(r) for r in res) + " |")

    base = res[0]["output_tok_s"] if res else None
    row("output tok/s", lambda r: f"{r['output_tok_s']:.0f}" + (f" ({r['output_tok_s'] / base:.2f}x)" if base else ""))
    row("total tok/s", lambda r: f"{r['total_tok_s']:.0f}")
    row("elapsed s", lambda r: f"{r['elapsed_s']:.2f}")
    for key, name in (("ttft_ms", "TTFT ms"), ("tpot_ms", "TPOT ms")):
        row(f"{name} p50 / p90 / p99", lambda r, k=key: "n/a" if r[k] is None else
            f"{r[k]['p50']:.1f} / {r[k]['p90']:.1f} / {r[k]['p99']:.1f}")

    def decode(r):
        d = r["steps"]["decode_at_largest_batch"]
        return "n/a" if d is None else (f"{d['median_ms']:.2f} ms at {d['batch']} seqs "
                                        f"(host {d['median_host_ms']:.2f} ms, {d['steps']} steps)")
    row("median pure-decode step, largest batch", decode)
    row("device idle before pure-decode steps (largest batch / all)", lambda r: " / ".join(
        _f(x, "{:.1%}") for x in ((r["steps"]["decode_at_largest_batch"] or {}).get(
            "device_idle_fraction"), r["steps"].get("decode_device_idle_fraction"))))
    row("max step", lambda r: "n/a" if r["steps"]["max_step"] is None else
        f"{r['steps']['max_step']['wall_ms']:.0f} ms ({r['steps']['max_step']['kind']}, "
        f"{r['steps']['max_step']['num_tokens']} tokens, step {r['steps']['max_step']['index']})")
    for kind in ("prefill", "mixed", "decode"):
        row(f"{kind} steps: count, total s", lambda r, k=kind: "0" if k not in r["steps"]["by_kind"] else
            f"{r['steps']['by_kind'][k]['steps']}, {r['steps']['by_kind'][k]['total_s']:.2f} s")
    row("2x-median step check", lambda r: ("ok" if r["step_check"]["ok"] else "FAIL") +
        f" ({r['step_check']['num_violations']} of {r['step_check']['num_steps']} steps)")
    row("compilations after start-up", lambda r: _compilations(r["compilations_after_startup"]))
    row("KV capacity (tokens)", lambda r: f"{r['kv_capacity_tokens']:,} ({_gib(r['kv_cache_bytes'])})")
    if any(r.get("tensor_parallel_size", 1) > 1 for r in res):
        row("tensor parallel: ranks, heads per rank", lambda r: f"{r.get('tensor_parallel_size', 1)}: "
            f"{r.get('q_heads_per_rank', 'n/a')} attention, {r.get('kv_heads_per_rank', 'n/a')} KV")
        row("KV cache per rank", lambda r: _gib(r.get("kv_cache_bytes_per_rank", r["kv_cache_bytes"])))
        row("output tok/s per rank", lambda r: f"{r.get('output_tok_s_per_rank', r['output_tok_s']):.0f}")
    row("peak concurrent sequences", lambda r: str(r["peak_concurrent_seqs"]))
    row("preemptions", lambda r: str(r["num_preemptions"]))
    row("tokens prefilled again", lambda r: f"{r['num_recomputed_tokens']:,} "
        f"({100 * r['recomputed_fraction_of_prompt_tokens']:.1f} % of prompt tokens)")
    row("start-up s", lambda r: f"{r['startup_s']:.1f}")
    lines += ["", "Start-up breakdown (s):", ""]
    lines += [startup_line(r) for r in res]
    lines += ["", "Attention per layer:", ""]
    lines += [f"- `{r['kv_cache_dtype']}`: {_layers_summary(r['attention'])}" for r in res]
    lines += ["", f"Step check: {STEP_RULE}.", ""]
    for r in res:
        c = r["step_check"]
        worst = "; ".join(f"step {b['index']} {b['kind']} size {b['size']}: {b['ms']:.0f} ms vs median "
                          f"{b['median_ms']:.0f}" for b in c["worst"][:5])
        lines.append(f"- `{r['kv_cache_dtype']}` ({c.get('timeline', 'host wall')} timeline): "
                     f"{c['num_violations']} violations in {c['num_groups']} groups"
                     + (f"; worst: {worst}" if worst else "")
                     + (f"; on the host's wall times: {c['host_wall_violations']}"
                        if "host_wall_violations" in c else ""))
    return "\n".join(x for x in lines if x is not None) + "\n"


def plot_steps(result: dict, path: Path) -> bool:
    """Step wall time over the run, one series per dtype; False (logged) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        logger.warning("matplotlib is not installed: no step-time plot (pip install matplotlib; "
                       "tqattn's [eval] extra has it)")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r in result["results"]:
        ms = r["timeline"]["wall_ms"]
        t, x = 0.0, []
        for m in ms:
            t += m / 1e3
            x.append(t)
        ax.plot(x, ms, lw=0.8, marker=".", ms=2, label=r["kv_cache_dtype"])
    ax.set_yscale("log")
    ax.set_xlabel("time in run (s)")
    ax.set_ylabel("step wall time (ms)")
    w = result["workload"]
    ax.set_title(f"{w['name']}: {w['num_prompts']} x {w['input_len']} in / {w['output_len']} out")
    ax.grid(True, which="both", alpha=0.3)
    if result["results"]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _compilations(c: dict) -> str:
    """'Dynamo 0, Triton 1 (kernel names)'."""
    names = c.get("dynamo_frames", []) + c.get("triton_kernels", [])
    return f"Dynamo {c['dynamo']}, Triton {c['triton']}" + (f" ({'; '.join(names)})" if names else "")
