"""Per-layer routing: each layer's KV-cache dtype, backend and KV-cache group.

A layer's KV dtype is the engine's ``kv_cache_dtype`` unless the layer is skipped, which keeps
it at full precision ("auto", the model dtype) on FlashAttention:

* ``kv_cache_dtype_skip_layers`` entries: a layer index (int, or a numeric string as vLLM's
  config passes them), the word ``"sliding_window"`` (every sliding-window layer) or the word
  ``"auto"`` (the engine's default): the layers the start-up calibration measures as outliers
  (:func:`auto_full_precision_layers`);
* boundary layers: the first and last ``kv_cache_boundary_layers`` layers. vLLM always keeps 2
  (and cannot turn it off); here it is a setting, :data:`DEFAULT_BOUNDARY_LAYERS` by default,
  to be set from the accuracy measurements.

A TurboQuant ``kv_cache_dtype`` that these rules leave with no layer is an error, not a silent
full-precision cache; the engine logs how many layers the rules keep full precision.

Layers whose caches have the same spec (backend, KV dtype, per-block shape and bytes) share a
KV-cache group; each group gets one metadata builder.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from collections.abc import Iterable, Sequence

import torch

from .backend import AttentionLayer, AttentionLayerSpec, AttentionMetadataBuilder
from .registry import select_backend
from ..quant.presets import PRESETS

DEFAULT_BOUNDARY_LAYERS = 0
SLIDING_WINDOW = "sliding_window"
AUTO_SKIP = "auto"
FULL_PRECISION = "auto"
# Automatic routing: a layer whose calibration error is AUTO_ERROR_FACTOR times the median
# layer's, and at least AUTO_MIN_ERROR nats, is an outlier (Qwen2.5-Coder's layer 0: ~150x; no
# SmolLM2 layer reaches 3x). Outliers are kept full precision, worst first, while the extra bytes
# fit DEFAULT_AUTO_SKIP_BUDGET of the all-compressed cache.
AUTO_ERROR_FACTOR = 8.0
AUTO_MIN_ERROR = 0.1
DEFAULT_AUTO_SKIP_BUDGET = 0.2


def _as_int(x) -> int | None:
    """x as an int if it is an integer (numpy's included), not a bool; else None."""
    if isinstance(x, bool):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def _parse_skip_entry(entry, num_layers: int | None) -> int | str:
    """A layer index or a word; num_layers None: the index's range is not checked yet."""
    last = "N-1" if num_layers is None else num_layers - 1
    allowed = (f"allowed: a layer index 0..{last} (int or numeric string), "
               f"{SLIDING_WINDOW!r} or {AUTO_SKIP!r}")
    if isinstance(entry, str):
        word = entry.strip()
        if word in (SLIDING_WINDOW, AUTO_SKIP):
            return word
        if not word.lstrip("-").isdigit():
            raise ValueError(f"kv_cache_dtype_skip_layers entry {entry!r} is not understood; "
                             f"{allowed}")
        index = int(word)
    elif (index := _as_int(entry)) is None:
        raise ValueError(f"kv_cache_dtype_skip_layers entry {entry!r} is not understood; {allowed}")
    if index < 0 or (num_layers is not None and index >= num_layers):
        model = "" if num_layers is None else f" for a model with {num_layers} layers"
        raise ValueError(f"kv_cache_dtype_skip_layers entry {entry!r} is out of range{model}; {allowed}")
    return index


def boundary_layer_indices(num_layers: int, boundary_layers: int) -> set[int]:
    """First and last ``boundary_layers`` indices (all layers when they overlap)."""
    n = min(boundary_layers, num_layers)
    return set(range(n)) | set(range(num_layers - n, num_layers))


def full_precision_layers(num_layers: int, sliding_windows: Sequence[int | None],
                          skip_layers: Iterable[int | str] = (),
                          boundary_layers: int | None = None,
                          auto_layers: Iterable[int] | None = None) -> dict[str, list[int]]:
    """The layers each routing rule keeps full precision: {"skip_layers": [...],
    "sliding_window": [...], "boundary_layers": [...], "auto": [...]} (a layer may appear under
    several rules). ``auto_layers``: what the calibration chose, required when ``skip_layers``
    has ``"auto"``."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
    if len(sliding_windows) != num_layers:
        raise ValueError(f"sliding_windows has {len(sliding_windows)} entries for "
                         f"{num_layers} layers")
    boundary_layers = check_boundary_layers(boundary_layers)
    entries = {_parse_skip_entry(e, num_layers) for e in routing_entries(skip_layers)}
    if AUTO_SKIP in entries and auto_layers is None:
        raise ValueError(f"kv_cache_dtype_skip_layers has {AUTO_SKIP!r}, which needs the layers "
                         f"the start-up calibration chose (auto_layers); none were given")
    auto = sorted(set(auto_layers or ())) if AUTO_SKIP in entries else []
    if any(not 0 <= i < num_layers for i in auto):
        raise ValueError(f"auto_layers {auto} out of range for {num_layers} layers")
    windowed = [i for i, w in enumerate(sliding_windows) if w is not None]
    return {"skip_layers": sorted(e for e in entries if isinstance(e, int)),
            SLIDING_WINDOW: windowed if SLIDING_WINDOW in entries else [],
            "boundary_layers": sorted(boundary_layer_indices(num_layers, boundary_layers)),
            AUTO_SKIP: auto}


def routing_entries(skip_layers) -> list:
    """``kv_cache_dtype_skip_layers`` as a list of entries (one entry may come alone)."""
    if isinstance(skip_layers, str) or _as_int(skip_layers) is not None:
        return [skip_layers]  # a lone "sliding_window" or index, not its characters
    try:
        return list(skip_layers)
    except TypeError:
        raise ValueError(f"kv_cache_dtype_skip_layers must be a list of layer indices and the words "
                         f"{SLIDING_WINDOW!r} / {AUTO_SKIP!r}, got {skip_layers!r}") from None


def check_boundary_layers(boundary_layers) -> int:
    """The number of boundary layers (None: the default); ValueError naming a bad one."""
    if boundary_layers is None:
        return DEFAULT_BOUNDARY_LAYERS
    n = _as_int(boundary_layers)
    if n is None or n < 0:
        raise ValueError(f"kv_cache_boundary_layers must be an int >= 0, got {boundary_layers!r}")
    return n


def check_routing_args(skip_layers, boundary_layers, auto_skip_budget) -> None:
    """The routing settings a model does not decide, checked before it loads: each skip entry
    (its index range waits for the model), the boundary layers, the automatic routing budget."""
    for e in routing_entries(skip_layers):
        _parse_skip_entry(e, None)
    check_boundary_layers(boundary_layers)
    b = auto_skip_budget
    if isinstance(b, bool) or not isinstance(b, (int, float)) or not (b >= 0 and math.isfinite(b)):
        raise ValueError(f"kv_cache_auto_skip_budget must be a finite number >= 0 (a share of the "
                         f"all-compressed cache's bytes, e.g. 0.2), got {b!r}")


def wants_auto_layers(skip_layers: Iterable[int | str]) -> bool:
    """Whether ``kv_cache_dtype_skip_layers`` asks for automatic routing."""
    return any(isinstance(e, str) and e.strip() == AUTO_SKIP for e in routing_entries(skip_layers))


def without_auto(skip_layers) -> list:
    """The skip entries other than ``"auto"``."""
    return [e for e in routing_entries(skip_layers) if not (isinstance(e, str) and e.strip() == AUTO_SKIP)]


def auto_full_precision_layers(errors: Sequence[float], candidates: Iterable[int],
                               extra_bytes: float | Sequence[float], budget_bytes: float
                               ) -> tuple[list[int], str]:
    """Automatic routing: (layers to keep full precision, why — one line for the plan log).

    ``errors``: each layer's calibration error (attention KL through the codec, nats);
    ``candidates``: the layers the other rules leave compressed; ``extra_bytes``: bytes per token
    a layer costs more in full precision (one number for every layer, or one per layer);
    ``budget_bytes``: the most extra bytes per token.
    Outliers (above :data:`AUTO_ERROR_FACTOR` × the candidates' median and
    :data:`AUTO_MIN_ERROR`) go first-worst-first while they fit the budget."""
    if not (budget_bytes >= 0 and math.isfinite(budget_bytes)):
        raise ValueError(f"the automatic routing budget must be a finite number of bytes >= 0, "
                         f"got {budget_bytes!r}")
    cand = sorted(set(candidates))
    if not cand:
        return [], "automatic routing: no compressed layer to judge"
    errs = sorted(errors[i] for i in cand)
    n = len(errs)
    med = errs[n // 2] if n % 2 else 0.5 * (errs[n // 2 - 1] + errs[n // 2])
    threshold = max(AUTO_ERROR_FACTOR * med, AUTO_MIN_ERROR)
    outliers = sorted((i for i in cand if errors[i] > threshold), key=lambda i: -errors[i])
    rule = (f"threshold {threshold:.3g} nats = max({AUTO_ERROR_FACTOR:g} x the median layer's "
            f"{med:.3g}, {AUTO_MIN_ERROR:g})")
    if not outliers:
        worst = max(cand, key=lambda i: errors[i])
        return [], (f"automatic routing keeps no layer full precision: the worst, layer {worst}, "
                    f"has attention KL {errors[worst]:.3g} nats ({rule})")
    extra = (list(extra_bytes) if isinstance(extra_bytes, Sequence)
             else [extra_bytes] * len(errors))
    fit, spent = 0, 0.0
    for i in outliers:  # worst first; the first that does not fit ends the choice
        if spent + max(extra[i], 0) > budget_bytes:
            break
        fit, spent = fit + 1, spent + max(extra[i], 0)
    chosen, left = sorted(outliers[:fit]), outliers[fit:]
    why = ", ".join(f"layer {i} ({errors[i]:.3g} nats)" for i in outliers[:fit])
    line = (f"automatic routing keeps {len(chosen)} layer(s) full precision: "
            f"{why or 'none'} — {rule}; {spent:.0f} of {budget_bytes:.0f} extra bytes/token")
    if left:
        line += (f"; outliers over the budget stay compressed: "
                 + ", ".join(f"layer {i} ({errors[i]:.3g} nats)" for i in left))
    return chosen, line


def describe_full_precision(rules: dict[str, list[int]], num_layers: int) -> str:
    """'4 of 30 layers (boundary_layers: 0, 1, 28, 29)' for a log line or an error."""
    layers = set().union(*rules.values())
    why = "; ".join(f"{rule}: {', '.join(map(str, idx))}" for rule, idx in rules.items() if idx)
    return f"{len(layers)} of {num_layers} layers" + (f" ({why})" if why else "")


def resolve_kv_cache_dtypes(num_layers: int, sliding_windows: Sequence[int | None],
                            kv_cache_dtype: str, skip_layers: Iterable[int | str] = (),
                            boundary_layers: int | None = None,
                            auto_layers: Iterable[int] | None = None) -> list[str]:
    """The KV-cache dtype of every layer: ``kv_cache_dtype``, or "auto" for skipped layers.

    Raises ValueError when a TurboQuant ``kv_cache_dtype`` would be left with no layer at all:
    the caller asked for a compressed cache and would silently get a full-precision one.
    """
    if kv_cache_dtype not in PRESETS and auto_layers is None:
        auto_layers = ()   # a full-precision cache: nothing to route
    rules = full_precision_layers(num_layers, sliding_windows, skip_layers, boundary_layers,
                                  auto_layers)
    skipped = set().union(*rules.values())
    if kv_cache_dtype in PRESETS and len(skipped) == num_layers:
        n = DEFAULT_BOUNDARY_LAYERS if boundary_layers is None else boundary_layers
        if 2 * n >= num_layers:
            raise ValueError(
                f"kv_cache_boundary_layers={n} keeps the first and last {n} layers of this "
                f"{num_layers}-layer model in full precision, which is every layer, so none would use "
                f"kv_cache_dtype={kv_cache_dtype!r}; use at most {(num_layers - 1) // 2}, or "
                f"kv_cache_dtype='auto' for a full-precision cache")
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} would apply to no layer: the routing keeps "
                         f"{describe_full_precision(rules, num_layers)} full precision; skip fewer "
                         f"layers, or use kv_cache_dtype='auto' for a full-precision cache")
    return [FULL_PRECISION if i in skipped else kv_cache_dtype for i in range(num_layers)]


def _cache_spec_key(layer_backend, spec: AttentionLayerSpec, block_size: int) -> tuple:
    return (layer_backend.name, spec.kv_cache_dtype, layer_backend.kv_cache_torch_dtype(spec),
            tuple(layer_backend.kv_cache_shape(1, block_size, spec)),
            layer_backend.page_bytes(block_size, spec))


def build_attention_layers(specs: Sequence[AttentionLayerSpec], block_size: int = 16, *,
                           backend: str | None = None) -> list[AttentionLayer]:
    """Bind every layer to its backend (from the registry) and a KV-cache group.

    ``backend`` forces one backend by name for every layer (an error for a layer it can't run).
    Groups are numbered in order of first appearance.
    """
    layers, groups = [], {}
    for spec in specs:
        cls = select_backend(spec, backend)
        group = groups.setdefault(_cache_spec_key(cls, spec, block_size), len(groups))
        layers.append(AttentionLayer(spec=spec, backend=cls, impl=cls.impl_cls(spec), group=group))
    return layers


def build_metadata_builders(layers: Sequence[AttentionLayer],
                            device: torch.device | str) -> list[AttentionMetadataBuilder]:
    """One metadata builder per KV-cache group (index = group), each given every layer's impl."""
    impls = {layer.spec.name: layer.impl for layer in layers}
    first_of_group = {}
    for layer in layers:
        first_of_group.setdefault(layer.group, layer)
    return [first_of_group[g].backend.builder_cls(impls, torch.device(device))
            for g in sorted(first_of_group)]


def describe_plan(layers: Sequence[AttentionLayer], block_size: int) -> dict:
    """A summary of the per-layer plan for the engine to log once.

    ``bytes_per_token`` sums the cache bytes of one token over all layers;
    ``capacity_vs_bf16`` is how many more tokens fit than in an all-bf16 cache of the same size.
    """
    bytes_per_token = sum(l.backend.page_bytes(block_size, l.spec) for l in layers) / block_size
    bf16_bytes = sum(2 * l.spec.num_kv_heads * l.spec.head_size * 2 for l in layers)
    groups = {}
    for l in layers:
        g = groups.setdefault(l.group, {"group": l.group, "backend": l.backend.name,
                                        "kv_cache_dtype": l.spec.kv_cache_dtype, "layers": [],
                                        # the head size the cache stores (padded: larger)
                                        "head_size": l.spec.head_size,
                                        "cache_head_size": l.spec.cache_head_size})
        g["layers"].append(l.spec.layer_idx)
    return {
        "num_layers": len(layers),
        "backends": dict(Counter(l.backend.name for l in layers)),
        "kv_cache_dtypes": dict(Counter(l.spec.kv_cache_dtype for l in layers)),
        "groups": [groups[g] for g in sorted(groups)],
        "full_precision_layers": [l.spec.layer_idx for l in layers
                                  if l.spec.kv_cache_dtype == FULL_PRECISION],
        "bytes_per_token": bytes_per_token,
        "bf16_bytes_per_token": bf16_bytes,
        "capacity_vs_bf16": bf16_bytes / bytes_per_token if bytes_per_token else float("inf"),
    }
