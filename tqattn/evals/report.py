"""Preset sweep: bytes, perplexity/KL/top-1, NIAH and (optionally) GSM accuracy in one table.

A plan (YAML, shipped under tqattn/configs/evals/report/) lists the presets, the baseline preset
for paired comparisons, and per model the perplexity specs, the NIAH grid and the GSM settings.
A model may add routing variants — ``variants: {NAME: {engine args}}`` run for
``variant_presets`` (default: all its presets) — as extra rows ``"PRESET [NAME]"`` next to the
rows of the engine's default routing, each paired against its preset's default row.
`run_report(plan, out_dir)` writes report.json, report.md and quality_vs_bits.png (+ NIAH heat
maps). Bytes per token are for the whole model: the sum over layers of K+V bytes of all KV heads,
with full-precision layers (auto, skip and boundary layers) counted at 2 bytes per element (bf16).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..paths import report_plans_dir
from . import data as evdata
from . import gsm8k, niah, ppl, scoring

logger = logging.getLogger(__name__)

FP_BYTES = 2  # full-precision cache layers are counted as bf16
# Scoring relies on each window being prefilled from scratch in fixed chunks.
NO_PREFIX_CACHE = {"enable_prefix_caching": False}


# ----------------------------------------------------------------------------- bytes per token

def model_config(model: str) -> Any:
    """The HF config of an eval model reference, without loading weights."""
    import transformers

    from tqattn.models.configs import model_config_path

    if model == "default":
        model = "SmolLM2-135M"
    elif model == evdata.INTERNAL_QWEN:  # same architecture as Qwen2.5-0.5B
        model = "Qwen2.5-0.5B"
    p = Path(model).expanduser()
    if p.is_dir():
        return transformers.AutoConfig.from_pretrained(p, local_files_only=True)
    if p.suffix == ".gguf" and p.is_file():
        return transformers.AutoConfig.from_pretrained(p.parent, gguf_file=p.name,
                                                       local_files_only=True)
    shipped = p if p.suffix == ".json" and p.is_file() else model_config_path(model)
    if shipped is None:
        raise FileNotFoundError(f"cannot find a config for model {model!r}")
    raw = json.loads(Path(shipped).read_text())
    return transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)


def kv_bytes_per_token(info: Any, kv_cache_dtype: str, *, skip_layers=(),
                       boundary_layers: int | None = None, auto_layers=None) -> dict:
    """Whole-model K+V bytes per token; layers are routed by the engine's own selector
    (``auto_layers``: what automatic routing chose, when ``skip_layers`` has "auto")."""
    from tqattn.attention.selector import resolve_kv_cache_dtypes
    from tqattn.quant.layout import build_layout

    dtypes = resolve_kv_cache_dtypes(info.num_layers, info.sliding_windows, kv_cache_dtype,
                                     skip_layers, boundary_layers, auto_layers)
    fp_slot = 2 * info.head_dim * FP_BYTES
    slots = [fp_slot if d == "auto" else build_layout(d, info.head_dim).slot_bytes for d in dtypes]
    total = sum(slots) * info.num_kv_heads
    elems = 2 * info.head_dim * info.num_kv_heads * info.num_layers
    return {"bytes_per_token": total, "bits_per_element": total * 8 / elems,
            "compression_vs_bf16": elems * FP_BYTES / total,
            "full_precision_layers": [i for i, d in enumerate(dtypes) if d == "auto"],
            "slot_bytes": max(slots) if kv_cache_dtype == "auto" else min(slots)}


# ----------------------------------------------------------------------------- plans

def load_plan(name_or_path: str) -> dict:
    import yaml

    p = Path(name_or_path).expanduser()
    if not p.is_file():
        p = report_plans_dir() / f"{Path(name_or_path).name.removesuffix('.yaml')}.yaml"
    if not p.is_file():
        known = sorted(x.stem for x in report_plans_dir().glob("*.yaml"))
        raise FileNotFoundError(f"no report plan {name_or_path!r}; shipped plans: {known}")
    plan = yaml.safe_load(p.read_text())
    validate_plan(plan, str(p))
    return plan


def validate_plan(plan: Any, where: str = "plan") -> None:
    from tqattn.quant.presets import PRESETS

    if not isinstance(plan, dict) or not isinstance(plan.get("models"), list) or not plan["models"]:
        raise ValueError(f"{where}: needs a non-empty 'models' list")
    names = list(plan.get("presets", [])) + [plan.get("baseline")] * ("baseline" in plan)
    names += [p for m in plan["models"] if isinstance(m, dict) for p in m.get("presets", [])]
    for p in names:
        if p not in PRESETS:
            raise ValueError(f"{where}: unknown preset {p!r}; expected one of {', '.join(PRESETS)}")
    for m in plan["models"]:
        if not isinstance(m, dict) or "model" not in m:
            raise ValueError(f"{where}: each model needs at least 'model', got {m!r}")
        extra = set(m) - {"name", "model", "load_format", "engine_args", "presets", "ppl", "niah",
                          "gsm", "variants", "variant_presets"}
        if extra:
            raise ValueError(f"{where}: unknown model keys {sorted(extra)}")
        variants = m.get("variants") or {}
        if not isinstance(variants, dict) or not all(
                isinstance(k, str) and isinstance(v, dict) for k, v in variants.items()):
            raise ValueError(f"{where}: 'variants' maps a name to engine arguments, got "
                             f"{variants!r}")
        for p in m.get("variant_presets") or []:
            if p not in PRESETS:
                raise ValueError(f"{where}: unknown preset {p!r} in variant_presets")
        for spec in m.get("ppl") or []:
            ppl.PPLSpec(**spec)  # raises with the bad field named


# ----------------------------------------------------------------------------- the sweep

def _gsm_for_presets(model: dict, presets: list[str], factory_for, settings: dict) -> dict:
    out = {}
    base = gsm8k.parse_config({
        "model": model["model"], "kv_cache_dtype": "auto", "engine_args": model.get("engine_args"),
        "num_questions": settings.get("num_questions", 50), "num_shots": settings.get("num_shots", 5),
        "max_tokens": settings.get("max_tokens", 256),
        "data": {"source": "gsm_symbolic", "seed": settings.get("seed", 1234)},
        "pass": {"threshold": 0.0}}, "report-gsm")
    for p in ["auto"] + [p for p in presets if p != "auto"]:
        r = gsm8k.run_gsm8k(replace(base, kv_cache_dtype=p, name=f"report-{p}"), factory=factory_for)
        out[p] = {"accuracy": r["accuracy"], "num_questions": r["num_questions"]}
    return out


def model_presets(plan: dict, model: dict) -> list[str]:
    """The presets a model of the plan runs: its own list or the plan's, plus the baseline."""
    presets = list(model.get("presets") or plan.get("presets") or [])
    baseline = plan.get("baseline", "turboquant_k3v4_nc")
    return presets if baseline in presets else presets + [baseline]


def variant_keys(model: dict, presets: list[str]) -> dict[str, tuple[str, str | None]]:
    """Every row key of a model -> (preset, variant name or None for the default routing)."""
    keys = {p: (p, None) for p in presets}
    for v in model.get("variants") or {}:
        for p in model.get("variant_presets") or presets:
            keys[f"{p} [{v}]"] = (p, v)
    return keys


def _routing_factory(model: dict, keys: dict, factory, routing: dict, centered: dict):
    """A factory of row keys: the preset with its variant's engine arguments; records each
    engine's full-precision layers in ``routing`` and its key-centered layers in ``centered``
    (the start-up calibration decides both).
    A given ``factory`` (tests) gets the variant's engine arguments as keywords."""
    variants = model.get("variants") or {}

    def make(key):
        preset, v = keys.get(key, (key, None))
        extra = variants.get(v, {})
        if factory is not None:
            llm = factory(preset, **extra) if extra else factory(preset)
        else:
            llm = scoring.make_llm(model["model"], preset, load_format=model.get("load_format"),
                                   engine_args={**NO_PREFIX_CACHE, **(model.get("engine_args") or {}),
                                                **extra})
        plan = getattr(llm, "kv_cache_plan", None)
        if isinstance(plan, dict) and "full_precision_layers" in plan:
            routing[key] = list(plan["full_precision_layers"])
        if isinstance(plan, dict) and "centered_layers" in plan:
            centered[key] = list(plan["centered_layers"])
        return llm
    return make


def run_model(model: dict, presets: list[str], *, factory=None, skip=()) -> dict:
    name = model.get("name") or model["model"]
    keys = variant_keys(model, presets)
    routing: dict[str, list[int]] = {}
    centered: dict[str, list[int]] = {}
    make = _routing_factory(model, keys, factory, routing, centered)
    res: dict = {"name": name, "model": model["model"], "engine_args": model.get("engine_args", {}),
                 "variants": model.get("variants") or {}, "rows": keys, "routing": routing,
                 "centered": centered}
    t0 = time.perf_counter()
    if model.get("ppl") and "ppl" not in skip:
        res["ppl"] = ppl.run_ppl(make, list(keys), [ppl.PPLSpec(**s) for s in model["ppl"]])
    if model.get("niah") and "niah" not in skip:
        n = dict(model["niah"])
        res["niah"] = niah.run_niah(make, n.pop("presets", list(keys)), **n)
    if model.get("gsm") and "gsm" not in skip:
        res["gsm"] = _gsm_for_presets(model, presets, make, model["gsm"])
    res["elapsed_s"] = round(time.perf_counter() - t0, 1)
    return res


def table_rows(model_res: dict, presets: list[str], info: Any, engine_args: dict) -> list[dict]:
    keys = model_res.get("rows") or {p: (p, None) for p in presets}
    routing = model_res.get("routing") or {}
    rows = []
    for p in ["auto"] + [x for x in keys if x != "auto"]:
        preset, v = keys.get(p, (p, None))
        if p in routing:   # what the engine chose at start-up
            b = kv_bytes_per_token(info, preset, skip_layers=routing[p], boundary_layers=0)
        else:
            args = {**engine_args, **(model_res.get("variants") or {}).get(v, {})}
            b = kv_bytes_per_token(info, preset,
                                   skip_layers=args.get("kv_cache_dtype_skip_layers", ()),
                                   boundary_layers=args.get("kv_cache_boundary_layers"),
                                   auto_layers=[] if preset == "auto" else None)
        row = {"model": model_res["name"], "preset": p, "kv_cache_dtype": preset, "variant": v,
               "full_precision_layers": b["full_precision_layers"] if preset != "auto" else None,
               # None: not reported (the auto cache, or an engine from before key centering)
               "centered_layers": (model_res.get("centered") or {}).get(p),
               "bytes_per_token": b["bytes_per_token"],
               "bits_per_element": round(b["bits_per_element"], 3),
               "compression": round(b["compression_vs_bf16"], 3)}
        if "ppl" in model_res:
            u = ppl.pooled_units(model_res["ppl"], p)
            s = ppl.summarize({k: u[k] for k in ("n", "nll_ref")},
                              {k: u[k] for k in ("nll", "kl", "agree")})
            row.update({m: s[m] for m in ppl.FIGURES})
            row["specs"] = {sp["name"]: {m: (sp["presets"][p][m] if p in sp["presets"] else None)
                                         for m in ppl.FIGURES} for sp in model_res["ppl"]["specs"]}
        if "niah" in model_res and p in model_res["niah"]["presets"]:
            row["niah"] = model_res["niah"]["presets"][p]["accuracy"]
        if "gsm" in model_res and p in model_res["gsm"]:
            row["gsm"] = model_res["gsm"][p]["accuracy"]
        rows.append(row)
    return rows


def variant_comparisons(model_res: dict) -> list[dict]:
    """Each preset's default-routing row paired against each of its variant rows: default −
    variant, pooled and per spec (negative: the default is better)."""
    if "ppl" not in model_res:
        return []
    out = []
    for key, (preset, v) in (model_res.get("rows") or {}).items():
        if v is None or key not in model_res["ppl"]["presets"] or preset not in model_res["ppl"]["presets"]:
            continue
        for label, names in _spec_groups(model_res["ppl"]["specs"]):
            c = ppl.compare(model_res["ppl"], preset, key, names)
            out.append({"model": model_res["name"], "preset": preset, "variant": key,
                        "spec": label, "kl_diff": c["kl"], "ppl_delta_diff": c["ppl_delta_pct"],
                        "top1_diff": c["top1"]})
    return out


def comparisons(model_res: dict, rows: list[dict], baseline: str) -> list[dict]:
    """Each default-routing preset at no more bytes/token than `baseline`, paired against it
    (pooled and per spec)."""
    if "ppl" not in model_res or baseline not in model_res["ppl"]["presets"]:
        return []
    limit = next(r["bytes_per_token"] for r in rows if r["preset"] == baseline)
    out = []
    for r in rows:
        p = r["preset"]
        if p in (baseline, "auto") or r["bytes_per_token"] > limit or r.get("variant"):
            continue
        for label, names in _spec_groups(model_res["ppl"]["specs"]):
            c = ppl.compare(model_res["ppl"], p, baseline, names)
            better = all(c[m]["high"] < 0 for m in ("kl", "ppl_delta_pct"))
            out.append({"model": model_res["name"], "preset": p, "baseline": baseline,
                        "spec": label,
                        "bytes_per_token": r["bytes_per_token"], "baseline_bytes": limit,
                        "kl_diff": c["kl"], "ppl_delta_diff": c["ppl_delta_pct"],
                        "lower_kl_and_ppl_delta": better})
    return out


def _spec_groups(specs: list[dict]) -> list[tuple[str, list[str] | None]]:
    """All specs pooled, each context length pooled over its sources, then each spec."""
    groups: list[tuple[str, list[str] | None]] = [("pooled", None)]
    by_ctx: dict[int, list[str]] = {}
    for s in specs:
        by_ctx.setdefault(s["context_len"], []).append(s["name"])
    if len(by_ctx) > 1 or len(specs) > 1:
        groups += [(f"all@{c}", names) for c, names in by_ctx.items() if len(names) > 1]
        groups += [(s["name"], [s["name"]]) for s in specs]
    return groups


def _ci(f: dict | None, fmt: str) -> str:
    if not f:
        return "–"
    return f"{fmt.format(f['value'])} [{fmt.format(f['low'])}, {fmt.format(f['high'])}]"


def markdown(report: dict) -> str:
    lines = ["# KV-cache preset sweep", "",
             f"Command: `{report['command']}`  ",
             f"Date: {report.get('date', '?')} to {report.get('finished', '(running)')}; "
             f"versions: {', '.join(f'{k} {v}' for k, v in report.get('versions', {}).items())}  ",
             f"Plan: `{report['plan_name']}`; "
             f"reference: `auto` cache; figures pooled over all perplexity specs of a model; "
             f"[95 % bootstrap interval]. Bytes/token: whole model, K+V, all layers "
             f"(full-precision layers as bf16).", ""]
    head = ("| model | preset | full-precision layers | centered layers | bytes/token | bits/elem | "
            "compression | PPL Δ % | KL (nats) | top-1 agree | NIAH | GSM |")
    lines += [head, "|" + "---|" * 12]
    for r in report["rows"]:
        gsm = f"{r['gsm']:.3f}" if r.get("gsm") is not None else "–"
        nh = f"{r['niah']:.2f}" if r.get("niah") is not None else "–"
        fp = r.get("full_precision_layers")
        fp = "all" if fp is None else ", ".join(map(str, fp)) or "none"
        cl = r.get("centered_layers")
        cl = "–" if cl is None else ", ".join(map(str, cl)) or "none"
        lines.append(f"| {r['model']} | {r['preset']} | {fp} | {cl} | {r['bytes_per_token']} | "
                     f"{r['bits_per_element']:.2f} | {r['compression']:.2f}× | "
                     f"{_ci(r.get('ppl_delta_pct'), '{:+.2f}')} | {_ci(r.get('kl'), '{:.4f}')} | "
                     f"{_ci(r.get('top1'), '{:.4f}')} | {nh} | {gsm} |")
    for m in report["models"]:
        if "ppl" not in m:
            continue
        lines += ["", f"## {m['name']}: perplexity specs", ""]
        for s in m["ppl"]["specs"]:
            lines.append(f"- `{s['name']}`: {s['num_windows']} windows of {s['context_len']} tokens, "
                         f"chunk {s['chunk_size']}, scored from position {s['score_start']}, "
                         f"{s['scored_tokens']} scored tokens in {s['num_units']} bootstrap units; "
                         f"reference PPL {_ci(s['reference_ppl'], '{:.3f}')}")
        lines += ["", "| preset | spec | PPL Δ % | KL | top-1 |", "|---|---|---|---|---|"]
        for s in m["ppl"]["specs"]:
            for p, f in s["presets"].items():
                lines.append(f"| {p} | {s['name']} | {_ci(f['ppl_delta_pct'], '{:+.2f}')} | "
                             f"{_ci(f['kl'], '{:.4f}')} | {_ci(f['top1'], '{:.4f}')} |")
    if report["comparisons"]:
        lines += ["", f"## Paired comparisons against `{report['baseline']}` "
                  "(presets at no more bytes/token; difference = preset − baseline)", "",
                  "| model | preset | spec | bytes (vs base) | ΔKL | Δ(PPL Δ %) | both lower, CI excl. 0 |",
                  "|---|---|---|---|---|---|---|"]
        for c in report["comparisons"]:
            k, q = c["kl_diff"], c["ppl_delta_diff"]
            lines.append(f"| {c['model']} | {c['preset']} | {c['spec']} | {c['bytes_per_token']} "
                         f"({c['baseline_bytes']}) | {k['diff']:+.4f} [{k['low']:+.4f}, {k['high']:+.4f}] | "
                         f"{q['diff']:+.3f} [{q['low']:+.3f}, {q['high']:+.3f}] | "
                         f"{'yes' if c['lower_kl_and_ppl_delta'] else 'no'} |")
    if report.get("variant_comparisons"):
        lines += ["", "## Default routing against the variants (same tokens; difference = default − "
                  "variant, negative: the default is better)", "",
                  "| model | preset | variant | spec | ΔKL | Δ(PPL Δ %) | Δtop-1 |",
                  "|---|---|---|---|---|---|---|"]
        for c in report["variant_comparisons"]:
            k, q, t = c["kl_diff"], c["ppl_delta_diff"], c["top1_diff"]
            lines.append(f"| {c['model']} | {c['preset']} | {c['variant']} | {c['spec']} | "
                         f"{k['diff']:+.4f} [{k['low']:+.4f}, {k['high']:+.4f}] | "
                         f"{q['diff']:+.3f} [{q['low']:+.3f}, {q['high']:+.3f}] | "
                         f"{t['diff']:+.4f} [{t['low']:+.4f}, {t['high']:+.4f}] |")
    return "\n".join(lines) + "\n"


def plot_quality(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for model in dict.fromkeys(r["model"] for r in report["rows"]):
        rows = [r for r in report["rows"] if r["model"] == model and r["preset"] != "auto"
                and r.get("kl")]
        if not rows:
            continue
        xs = [r["bits_per_element"] for r in rows]
        ys = [max(r["kl"]["value"], 1e-6) for r in rows]
        err = [[max(y - max(r["kl"]["low"], 1e-7), 0) for y, r in zip(ys, rows)],
               [max(r["kl"]["high"] - y, 0) for y, r in zip(ys, rows)]]
        ax.errorbar(xs, ys, yerr=err, fmt="o", capsize=3, label=model)
        for x, y, r in zip(xs, ys, rows):
            ax.annotate(r["preset"].replace("turboquant_", "vllm:"), (x, y), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("stored bits per K/V element (whole model)")
    ax.set_ylabel("KL vs auto cache (nats/token)")
    ax.set_title("Quality vs cache size")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_report(plan: dict, out_dir: str | Path, *, command: str = "", plan_name: str = "",
               factories: dict | None = None, skip=()) -> dict:
    """Run the plan and write report.json / report.md / quality_vs_bits.png under out_dir.

    `factories` maps a model's `model` string to an LLM factory (tests).
    """
    validate_plan(plan)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    baseline = plan.get("baseline", "turboquant_k3v4_nc")
    report = {"command": command, "plan_name": plan_name, "plan": plan, "baseline": baseline,
              "date": utc_now(), "models": [], "rows": [], "comparisons": [], "variant_comparisons": [],
              "versions": run_versions()}
    for m in plan["models"]:
        presets = model_presets(plan, m)
        f = (factories or {}).get(m["model"])
        res = run_model(m, presets, factory=f, skip=skip)
        info = _model_info(m)
        rows = table_rows(res, presets, info, m.get("engine_args") or {})
        report["models"].append(res)
        report["rows"] += rows
        report["comparisons"] += comparisons(res, rows, baseline)
        report["variant_comparisons"] += variant_comparisons(res)
        if "niah" in res:
            niah.plot_heatmaps(res["niah"], out_dir, res["name"])
        _write(report, out_dir)  # partial results survive a later failure
    report["finished"] = utc_now()
    _write(report, out_dir)
    plot_quality(report, out_dir / "quality_vs_bits.png")
    return report


def _model_info(m: dict) -> Any:
    from tqattn.models.info import model_info

    return model_info(model_config(m["model"]))


def _write(report: dict, out_dir: Path) -> None:
    (out_dir / "report.json").write_text(json.dumps(report, indent=1, default=_json_default))
    (out_dir / "report.md").write_text(markdown(report))


def _json_default(x):
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, float) and math.isnan(x):
        return None
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


def utc_now() -> str:
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def run_versions() -> dict:
    import platform

    import torch

    v = {"python": platform.python_version(), "torch": torch.__version__,
         "device": "cuda" if torch.cuda.is_available() else "cpu"}
    from importlib import metadata

    # the installed distribution's version: reasoning_gym.__version__ lags its releases
    # (0.1.19 inside 0.1.25), and generated problems depend on the release
    for dist in ("transformers", "reasoning-gym"):
        try:
            v[dist.replace("-", "_")] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return v
