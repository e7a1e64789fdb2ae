"""Teacher-forced perplexity, KL divergence vs the `auto` cache and top-1 agreement, per preset.

Method (one "spec" = text source x context length C):

* The text is tokenized once and cut into windows of C tokens, evenly spaced over the token
  stream and not overlapping; every preset sees the same windows.
* Each window is prefilled through the engine in chunks of `chunk_size` tokens (default 256), so
  its cache is written by real chunked prefill: a token in chunk c attends to the cache of chunks
  0..c-1 — compressed on TurboQuant layers — and to the raw K/V of its own chunk.
* Scored tokens: positions `score_start`..C-1 of each window (default `score_start` =
  `chunk_size`: all but the first chunk), so every scored token has at least `chunk_size`
  compressed tokens of history and at most `chunk_size`-1 raw ones. `score_start` = C//2 scores
  the second half only (longer history per scored token, twice the compute per scored token).
* Windows are added until at least `min_tokens` (default 20,000) tokens are scored.
* The reference is the same engine with kv_cache_dtype "auto". Its log-probs are kept on disk
  (float32 memmap, `scored tokens x vocab x 4` bytes, deleted afterwards) so that only one model
  is in memory at a time.
* Bootstrap unit: a block of about `block_tokens` (default 1024) consecutive scored tokens inside
  one window (blocks never span windows). 95 % percentile-bootstrap intervals over units; the
  comparison of two presets is a paired bootstrap on the same units (stats.py).
"""

from __future__ import annotations

import logging
import math
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from . import data as evdata
from . import scoring, stats
from ..paths import cache_root

logger = logging.getLogger(__name__)

SOURCES = ("shakespeare", "gsm_cot")
GSM_TEXT_SEED = 11  # differs from the GSM eval's question and exemplar seeds
FIGURES = ("ppl", "ppl_delta_pct", "kl", "top1")


@dataclass(frozen=True)
class PPLSpec:
    source: str = "shakespeare"
    context_len: int = 2048
    chunk_size: int = 256
    min_tokens: int = 20_000
    score_start: int | None = None   # None: chunk_size (all but the first chunk)
    block_tokens: int = 1024

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"unknown text source {self.source!r}; expected one of {SOURCES}")
        for k in ("context_len", "chunk_size", "min_tokens", "block_tokens"):
            if not isinstance(getattr(self, k), int) or getattr(self, k) < 1:
                raise ValueError(f"{k} must be a positive integer, got {getattr(self, k)!r}")
        if not 1 <= self.start < self.context_len:
            raise ValueError(f"score_start={self.start} must be in [1, {self.context_len - 1}] "
                             f"for context {self.context_len}")

    @property
    def start(self) -> int:
        return self.chunk_size if self.score_start is None else self.score_start

    @property
    def name(self) -> str:
        return f"{self.source}@{self.context_len}"

    @property
    def num_windows(self) -> int:
        return math.ceil(self.min_tokens / (self.context_len - self.start))


def source_text(source: str, approx_tokens: int) -> str:
    if source == "shakespeare":
        return evdata.shakespeare_text()
    # ~540 characters per gsm_symbolic item; 6 characters per token leaves a margin over the
    # 3-4.5 of common tokenizers. Item i depends only on (seed, i), so the text is stable.
    return evdata.gsm_cot_text(approx_tokens * 6 // 540 + 16, GSM_TEXT_SEED)


def make_windows(token_ids: list[int], num_windows: int, context_len: int) -> list[list[int]]:
    """`num_windows` non-overlapping windows of `context_len` tokens spread evenly over the stream."""
    total = len(token_ids)
    if total < num_windows * context_len:
        raise ValueError(f"text has {total} tokens; {num_windows} windows of {context_len} need "
                         f"{num_windows * context_len}")
    stride = (total - context_len) // max(num_windows - 1, 1)
    return [token_ids[i * stride:i * stride + context_len] for i in range(num_windows)]


def unit_slices(num_scored: int, block_tokens: int) -> list[slice]:
    k = max(1, round(num_scored / block_tokens))
    edges = np.linspace(0, num_scored, k + 1).round().astype(int)
    return [slice(a, b) for a, b in zip(edges[:-1], edges[1:])]


def spec_windows(spec: PPLSpec, tokenizer: Any) -> list[list[int]]:
    n = spec.num_windows
    ids = tokenizer(source_text(spec.source, n * spec.context_len + 1024),
                    add_special_tokens=False)["input_ids"]
    return make_windows(list(ids), n, spec.context_len)


def _units(values: torch.Tensor, slices: list[slice]) -> list[float]:
    return [float(values[s].sum()) for s in slices]


def summarize(ref_units: dict, units: dict, *, n_boot: int = 2000, seed: int = 0) -> dict:
    merged = {**ref_units, **units}
    out = {}
    for m in FIGURES:
        v, lo, hi = stats.bootstrap_ci(merged, m, n_boot=n_boot, seed=seed)
        out[m] = {"value": v, "low": lo, "high": hi}
    return out


def _score_reference(llm: Any, spec: PPLSpec, workdir: str) -> tuple:
    """-> (windows, memmap of reference log-probs, reference units, seconds)."""
    windows = spec_windows(spec, scoring.get_tokenizer(llm))
    slices = unit_slices(spec.context_len - spec.start, spec.block_tokens)
    store = None
    units = {"n": [], "nll_ref": []}
    t0 = time.perf_counter()
    for w, ids in enumerate(windows):
        lp = scoring.score_tokens(llm, ids, spec.chunk_size, spec.start)
        if store is None:
            store = np.lib.format.open_memmap(f"{workdir}/ref.npy", mode="w+", dtype=np.float32,
                                              shape=(len(windows), *lp.shape))
        store[w] = lp.numpy()
        units["n"] += [s.stop - s.start for s in slices]
        units["nll_ref"] += _units(stats.token_nll(lp, torch.tensor(ids[spec.start:])), slices)
    return windows, store, {k: np.asarray(v) for k, v in units.items()}, time.perf_counter() - t0


def _score_preset(llm: Any, spec: PPLSpec, windows: list, store: np.ndarray) -> tuple:
    """-> (units with nll, kl and agree sums, seconds)."""
    slices = unit_slices(spec.context_len - spec.start, spec.block_tokens)
    units = {"nll": [], "kl": [], "agree": []}
    t0 = time.perf_counter()
    for w, ids in enumerate(windows):
        lp = scoring.score_tokens(llm, ids, spec.chunk_size, spec.start)
        ref = torch.from_numpy(np.asarray(store[w]))
        units["nll"] += _units(stats.token_nll(lp, torch.tensor(ids[spec.start:])), slices)
        units["kl"] += _units(stats.token_kl(ref, lp), slices)
        units["agree"] += _units(stats.token_agree(ref, lp), slices)
    return {k: np.asarray(v) for k, v in units.items()}, time.perf_counter() - t0


def _run_spec(spec: PPLSpec, presets: list[str], factory: scoring.LLMFactory, workdir: str,
              reference: str) -> dict:
    t_spec = time.perf_counter()
    windows, store, ref_units, elapsed = scoring.with_llm(
        factory, reference, lambda llm: _score_reference(llm, spec, workdir))
    timings = {reference: round(elapsed, 2)}
    logger.info("%s [%s]: %d windows, %.0f tokens/s", spec.name, reference, len(windows),
                len(windows) * spec.context_len / max(elapsed, 1e-6))
    result = {**asdict(spec), "name": spec.name, "score_start": spec.start, "reference": reference,
              "num_windows": len(windows), "scored_tokens": int(ref_units["n"].sum()),
              "num_units": len(ref_units["n"]),
              "units": {k: v.tolist() for k, v in ref_units.items()}, "presets": {}}
    for preset in presets:
        u, elapsed = scoring.with_llm(factory, preset,
                                      lambda llm: _score_preset(llm, spec, windows, store))
        timings[preset] = round(elapsed, 2)
        f = result["presets"][preset] = {"units": {k: v.tolist() for k, v in u.items()},
                                         **summarize(ref_units, u)}
        logger.info("%s [%s]: PPL %+.2f %%, KL %.4g, top-1 %.4f (%.0f s)", spec.name, preset,
                    f["ppl_delta_pct"]["value"], f["kl"]["value"], f["top1"]["value"], elapsed)
    v, lo, hi = stats.bootstrap_ci(ref_units, "ppl_ref")
    result["reference_ppl"] = {"value": v, "low": lo, "high": hi}
    result["elapsed_s"] = {**timings, "total": round(time.perf_counter() - t_spec, 2)}
    return result


def run_ppl(factory: scoring.LLMFactory, presets: list[str], specs: list[PPLSpec], *,
            reference: str = "auto") -> dict:
    """Score every spec with the reference and each preset; one model in memory at a time."""
    presets = [p for p in presets if p != reference]
    root = cache_root() / "tmp"
    root.mkdir(parents=True, exist_ok=True)
    out = {"reference": reference, "presets": presets, "specs": []}
    for spec in specs:
        workdir = tempfile.mkdtemp(prefix="ppl-", dir=root)
        try:
            out["specs"].append(_run_spec(spec, presets, factory, workdir, reference))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    return out


def pooled_units(result: dict, preset: str, spec_names: list[str] | None = None) -> dict:
    """Units of one preset (with the reference's n and nll_ref) concatenated over specs."""
    parts = [s for s in result["specs"] if spec_names is None or s["name"] in spec_names]
    if not parts:
        raise ValueError(f"no specs named {spec_names}")
    keys = ["n", "nll_ref"] + (["nll", "kl", "agree"] if preset != result["reference"] else [])
    out = {}
    for k in keys:
        src = [s["units"][k] if k in ("n", "nll_ref") else s["presets"][preset]["units"][k]
               for s in parts]
        out[k] = np.concatenate([np.asarray(x, float) for x in src])
    if preset == result["reference"]:  # the reference against itself
        out.update(nll=out["nll_ref"].copy(), kl=np.zeros_like(out["n"]), agree=out["n"].copy())
    return out


def compare(result: dict, preset_a: str, preset_b: str, spec_names: list[str] | None = None,
            *, n_boot: int = 2000, seed: int = 0) -> dict:
    """Paired bootstrap of figure(a) - figure(b) for KL and PPL delta on the same units."""
    ua, ub = pooled_units(result, preset_a, spec_names), pooled_units(result, preset_b, spec_names)
    return {m: stats.paired_diff_ci(ua, ub, m, n_boot=n_boot, seed=seed)
            for m in ("kl", "ppl_delta_pct", "top1")}
