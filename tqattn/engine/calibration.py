"""Start-up calibration: each layer's mean key, and how much the cache's codec hurts its attention.

Forward passes of the loaded model over a fixed built-in text (:mod:`.calibration_text`; random
token ids for a model without a tokenizer), with an attention function that records every
layer's post-RoPE queries and keys. Per layer it keeps:

* ``key_offsets`` (Hk, D): the mean key of each KV head — what key centering subtracts
  (:mod:`tqattn.attention.key_centering`);
* ``errors_centered`` / ``errors_uncentered``: the attention KL (nats) of the last
  :data:`ERROR_QUERIES` queries of each pass, exact keys vs keys through the preset's codec,
  with and without centering, averaged over the two ways the engine reads its cache: every key
  compressed (a decode) and the newest :data:`RAW_TAIL` keys raw (a prefill chunk over a
  compressed history).

Both reads matter. A constant offset costs a norm-and-direction codec its bits, and when raw
and compressed keys meet in one softmax, the compressed keys' error on q·μ shifts the weight of
the whole history (Qwen2.5-Coder: layer 8's history mass 0.20 → 0.55). But centering also moves
where the codec's error falls — keys far from the mean, such as an attention sink's, get a
larger one — and that error is the same for every query, so it adds up where random errors
average out: on SmolLM2, centering every layer lowers the calibration error of 27 of 30 layers
by 1.0–2.2× and still raises the model's KL to the uncompressed model by 20 %. So a layer is
centered only where the calibration error drops at least :data:`CENTERING_MIN_GAIN`-fold
(:meth:`Calibration.centered_layers`): where the offset dominates the layer's error (Qwen's layers
0–4, 6, 8: 2.2–94×; one SmolLM2 layer), and automatic routing ranks layers by the error of the
keys as they will be stored (:func:`tqattn.attention.selector.auto_full_precision_layers`).

Positions. RoPE turns a constant pre-RoPE offset into one that rotates with the position, slowly
in the low-frequency pairs, fast in the others, so the mean post-RoPE key depends on where the
keys sit. A mean over positions 0..N only fits keys near the start (measured on SmolLM2: it makes
keys at positions 6K+ worse than no centering). The passes therefore run the same text at
:data:`CALIBRATION_PASSES` position offsets spread over the served length (``max_model_len``;
attention is relative, so only RoPE's rotation differs between them), and the offset is their
mean: the best constant for keys spread over the whole length.

Deterministic (fixed text, no sampling). The result is cached under the tqattn cache directory,
keyed by a fingerprint of the weights (names, shapes, dtypes and a strided sample of values),
the preset, the positions, the text and the method, so a model pays the passes once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from statistics import median
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..paths import cache_root
from . import calibration_text

logger = logging.getLogger(__name__)

CALIBRATION_TOKENS = 512        # tokens of each pass (fewer if the text or the model is shorter)
CALIBRATION_PASSES = 4          # passes at positions spread over the served length
DUMMY_TOKENS = 64               # random weights: the offsets mean nothing, keep the passes short
ERROR_QUERIES = 64              # the last queries of a pass whose attention the error measures
RAW_TAIL = 128                  # the newest keys a prefill chunk reads raw, in the second read
CENTERING_MIN_GAIN = 2.0        # center a layer where its calibration error drops this much
METHOD_VERSION = 2              # bump when what is computed changes: invalidates the cache
ATTN_NAME = "tqattn_calibrate"


@dataclass
class Calibration:
    preset: str
    key_offsets: torch.Tensor               # (L, Hk, D) float32, CPU
    errors_centered: list[float]            # per layer, attention KL through the codec
    errors_uncentered: list[float]
    num_tokens: int                         # per pass
    positions: list[int]                    # each pass's first position
    seconds: float = 0.0
    cached: bool = False

    def centered_layers(self, mode: bool | None = None) -> list[int]:
        """The layers whose keys are centered: where it lowers the error at least
        :data:`CENTERING_MIN_GAIN`-fold (``mode`` None), every layer (True) or none (False)."""
        if mode is False:
            return []
        return [i for i, (c, u) in enumerate(zip(self.errors_centered, self.errors_uncentered))
                if mode or u >= CENTERING_MIN_GAIN * c]

    def errors(self, centered_layers) -> list[float]:
        """Each layer's error as the cache will hold its keys."""
        on = set(centered_layers)
        return [c if i in on else u
                for i, (c, u) in enumerate(zip(self.errors_centered, self.errors_uncentered))]

    def describe(self, centered_layers, full_precision=()) -> str:
        """The plan log's line; the per-layer figures are those of the compressed layers."""
        how = "from the cache" if self.cached else f"{self.seconds:.1f} s"
        all_errs = self.errors(centered_layers)
        kept = [i for i in range(len(all_errs)) if i not in set(full_precision)] or [0]
        errs = [all_errs[i] for i in kept]
        worst = kept[max(range(len(errs)), key=errs.__getitem__)]
        fp = f" (full-precision layers {sorted(full_precision)} not counted)" if full_precision else ""
        return (f"calibration: {len(self.positions)} passes x {self.num_tokens} tokens (from "
                f"positions {self.positions}), {how}; keys centered on {len(centered_layers)} of "
                f"{len(all_errs)} layers {centered_layers}; {self.preset} attention KL per "
                f"layer{fp}: median {median(errs):.3g} nats, max {all_errs[worst]:.3g} (layer "
                f"{worst}); without centering: median {median(self.errors_uncentered):.3g}, "
                f"max {max(self.errors_uncentered):.3g}")


# ---- the passes ---------------------------------------------------------------------------------

def calibration_token_ids(tokenizer, vocab_size: int, num_tokens: int = CALIBRATION_TOKENS,
                          seed: int = 0) -> list[int]:
    """The built-in text's first ``num_tokens`` tokens (encoded as the engine encodes prompts),
    or seeded random ids when there is no tokenizer."""
    if tokenizer is None:
        gen = torch.Generator().manual_seed(seed)
        n = min(num_tokens, DUMMY_TOKENS)
        return torch.randint(0, vocab_size, (n,), generator=gen).tolist()
    return list(tokenizer.encode(calibration_text.TEXT))[:num_tokens]


def pass_positions(num_tokens: int, max_model_len: int,
                   passes: int = CALIBRATION_PASSES) -> list[int]:
    """First positions of the passes: evenly spread so that they cover [0, max_model_len)."""
    room = max_model_len - num_tokens
    if room <= 0 or passes < 2:
        return [0]
    return sorted({round(i * room / (passes - 1)) for i in range(passes)})


def attention_kl(q: torch.Tensor, k: torch.Tensor, k_hat: torch.Tensor, scale: float,
                 window: int | None = None, softcap: float = 0.0,
                 raw_tail: int = 0) -> float:
    """Mean KL(p || p̂) of the causal attention of the last queries of a sequence.

    q (Hq, n, D): the queries at positions T−n..T−1; k / k_hat (Hk, T, D): exact keys and keys
    as the cache returns them; the newest ``raw_tail`` keys are read exact in p̂ too."""
    hk, t, d = k.shape
    if raw_tail:
        k_hat = torch.cat([k_hat[:, :t - raw_tail], k[:, t - raw_tail:]], 1)
    n = q.shape[1]
    qq = q.float().reshape(hk, q.shape[0] // hk, n, d)
    pos = torch.arange(t - n, t, device=k.device)[:, None]
    keys = torch.arange(t, device=k.device)[None, :]
    visible = keys <= pos
    if window:
        visible &= keys > pos - window

    def logp(kk):
        s = torch.einsum("hgqd,hkd->hgqk", qq, kk.float()) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        return s.masked_fill(~visible, float("-inf")).log_softmax(-1)

    p, p_hat = logp(k), logp(k_hat)
    terms = torch.where(visible, p.exp() * (p - p_hat), torch.zeros((), device=k.device))
    return float(terms.sum(-1).mean())


def through_codec(codec, k: torch.Tensor) -> torch.Tensor:
    """Keys (..., D) encoded and decoded by the codec: what the cache gives back (a codec of a
    larger head size gets them zero-padded, as a padded cache stores them)."""
    d = k.shape[-1]
    if codec.head_dim > d:
        k = torch.nn.functional.pad(k, (0, codec.head_dim - d))
    return codec.decode(codec.encode(k, k))[0][..., :d]


def record_layers(model: torch.nn.Module, input_ids: list[int], on_layer,
                  position_offset: int = 0) -> None:
    """One forward pass of ``model`` over ``input_ids`` that calls ``on_layer(module, q, k,
    scaling, sliding_window, softcap)`` for every attention layer (q (Hq, T, D), k (Hk, T, D),
    post-RoPE); attention itself is computed exactly (causal, windowed, soft-capped as asked).
    The model's attention implementation is restored afterwards. ``position_offset`` shifts the
    positions (RoPE sees the same text further into a sequence)."""
    from transformers import AttentionInterface

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
               sliding_window=None, softcap=None, **kwargs):
        # one unpadded sequence: the mask is causal (and windowed), built here, not by transformers
        on_layer(module, query[0], key[0], scaling, sliding_window, softcap or 0.0)
        hq, hk, t = query.shape[1], key.shape[1], key.shape[2]
        k, v = key.repeat_interleave(hq // hk, 1), value.repeat_interleave(hq // hk, 1)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        pos = torch.arange(t, device=query.device)
        visible = pos[None, :] <= pos[:, None]
        if sliding_window:
            visible &= pos[None, :] > pos[:, None] - sliding_window
        if softcap:
            s = torch.einsum("bhqd,bhkd->bhqk", query.float(), k.float()) * scale
            s = (softcap * torch.tanh(s / softcap)).masked_fill(~visible, float("-inf"))
            out = torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), v.float()).to(query.dtype)
        else:
            out = torch.nn.functional.scaled_dot_product_attention(query, k, v, visible,
                                                                   scale=scale)
        return out.transpose(1, 2), None

    AttentionInterface.register(ATTN_NAME, attend)
    before = model.config._attn_implementation
    device = next(model.parameters()).device
    model.set_attn_implementation(ATTN_NAME)
    try:
        with torch.inference_mode():
            ids = torch.tensor([input_ids], dtype=torch.long, device=device)
            pos = torch.arange(position_offset, position_offset + len(input_ids), device=device)
            model(input_ids=ids, position_ids=pos[None], use_cache=False, logits_to_keep=1)
    finally:
        model.set_attn_implementation(before)


def run_calibration(model: torch.nn.Module, input_ids: list[int], preset: str, head_dim: int,
                    num_layers: int, positions: list[int],
                    cache_head_dims: list[int] | None = None) -> Calibration:
    """The passes and the per-layer figures (no cache). ``cache_head_dims``: the head size each
    layer's compressed cache stores (a padded one measures the padded codec); None: head_dim."""
    from ..attention.turboquant import get_codec

    device = next(model.parameters()).device
    dims = cache_head_dims or [head_dim] * num_layers
    keys: dict[int, list[torch.Tensor]] = {}
    queries: dict[int, list[torch.Tensor]] = {}
    layer_args: dict[int, tuple] = {}

    def on_layer(module, q, k, scaling, window, softcap):
        i = module.layer_idx
        keys.setdefault(i, []).append(k.float())
        queries.setdefault(i, []).append(q[:, -ERROR_QUERIES:].float())
        layer_args[i] = (head_dim ** -0.5 if scaling is None else scaling, window, softcap)

    t0 = time.perf_counter()
    for start in positions:
        record_layers(model, input_ids, on_layer, start)
    missing = sorted(set(range(num_layers)) - set(keys))
    if missing:
        raise RuntimeError(f"the calibration pass saw no attention call for layers {missing}")
    offsets, err_c, err_u = [], [], []
    tail = min(RAW_TAIL, len(input_ids) // 2)

    def error(qs, ks, k_hats, args):   # both reads, every pass
        e = [attention_kl(q, k, kh, *args, raw_tail=r) for q, k, kh in zip(qs, ks, k_hats)
             for r in (0, tail)]
        return sum(e) / len(e)

    with torch.inference_mode():
        for i in range(num_layers):
            k = torch.stack(keys.pop(i))                           # (P, Hk, T, D)
            mu = k.mean((0, 2), keepdim=True)
            # one codec call per layer: every pass, centered and not
            codec = get_codec(preset, dims[i], str(device))
            both = through_codec(codec, torch.cat([k - mu, k])).view(2, *k.shape)
            both[0] += mu
            q = queries.pop(i)
            err_c.append(error(q, k, both[0], layer_args[i]))
            err_u.append(error(q, k, both[1], layer_args[i]))
            offsets.append(mu[0, :, 0].cpu())
    bad = [i for i, e in enumerate(err_c + err_u) if not e == e or e == float("inf")]
    if bad:
        raise RuntimeError(f"the calibration produced non-finite attention errors "
                           f"(layers {sorted({i % num_layers for i in bad})})")
    return Calibration(preset=preset, key_offsets=torch.stack(offsets), errors_centered=err_c,
                       errors_uncentered=err_u, num_tokens=len(input_ids),
                       positions=list(positions), seconds=time.perf_counter() - t0)


# ---- cache ------------------------------------------------------------------------------------

def weights_fingerprint(model: torch.nn.Module, samples: int = 4096) -> str:
    """A hash of every tensor's name, shape and dtype and a strided sample of its values:
    cheap, and different for any other checkpoint, fine-tune or dtype."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // samples)
        h.update(flat[::step][:samples].float().cpu().numpy().tobytes())
    return h.hexdigest()


def cache_path(fingerprint: str, preset: str, input_ids: list[int], positions: list[int],
               cache_head_dims: list[int] | None = None) -> Path:
    key = [METHOD_VERSION, fingerprint, preset, positions, ERROR_QUERIES, RAW_TAIL,
           hashlib.sha256(json.dumps(input_ids).encode()).hexdigest()]
    raw = json.dumps(key + [cache_head_dims] if cache_head_dims else key)
    return cache_root() / "calibration" / f"{hashlib.sha256(raw.encode()).hexdigest()[:24]}.pt"


def calibrate(model: torch.nn.Module, tokenizer, *, preset: str, head_dim: int, num_layers: int,
              vocab_size: int, max_model_len: int, use_cache: bool = True,
              average=None, cache_head_dims: list[int] | None = None) -> Calibration:
    """The calibration of ``model`` for ``preset``: from the cache, else from the passes (then
    cached). ``seconds`` is the whole call's time. ``cache_head_dims``: see
    :func:`run_calibration`.

    ``average`` (tensor parallelism: every rank calls this with its shard): the mean of a list
    of floats over the ranks. The passes then always run (the ranks' forwards are collective)
    and the per-layer errors, each rank's over its own heads, are averaged so that every rank
    makes the same choices; the key offsets stay per rank (its own KV heads)."""
    t0 = time.perf_counter()
    ids = calibration_token_ids(tokenizer, vocab_size)
    positions = pass_positions(len(ids), max_model_len)
    use_cache = use_cache and average is None  # every rank must run the passes
    padded = cache_head_dims if cache_head_dims and set(cache_head_dims) != {head_dim} else None
    path = cache_path(weights_fingerprint(model), preset, ids, positions, padded) if use_cache else None
    if use_cache and path.is_file():
        try:
            d = torch.load(path, weights_only=True)
            return Calibration(preset=preset, key_offsets=d["key_offsets"],
                               errors_centered=d["errors_centered"],
                               errors_uncentered=d["errors_uncentered"], num_tokens=len(ids),
                               positions=positions, seconds=time.perf_counter() - t0, cached=True)
        except Exception as e:  # a truncated or foreign file: compute again and overwrite it
            logger.warning("ignoring an unreadable calibration cache file %s (%s)", path, e)
    cal = run_calibration(model, ids, preset, head_dim, num_layers, positions, padded)
    if average is not None:
        both = average(cal.errors_centered + cal.errors_uncentered)
        cal.errors_centered, cal.errors_uncentered = both[:num_layers], both[num_layers:]
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".partial")
        torch.save({"key_offsets": cal.key_offsets, "errors_centered": cal.errors_centered,
                    "errors_uncentered": cal.errors_uncentered}, tmp)
        tmp.replace(path)
    cal.seconds = time.perf_counter() - t0
    return cal


# ---- the engine's use of it ---------------------------------------------------------------------

def resolve_key_centering(requested: bool | None, kv_cache_dtype: str, info, model_name: str
                          ) -> bool | None:
    """The centering mode: False (off), None (each layer where the calibration says it helps)
    or True (every layer). A model that soft-caps its attention logits is refused with True
    and left uncentered with None (logged): there centering is not exact."""
    from ..quant.presets import PRESETS

    if kv_cache_dtype not in PRESETS or requested is False:
        return False
    cap = info.attn_logit_softcapping
    if cap:
        if requested:
            raise ValueError(
                f"kv_cache_key_centering=True: model {model_name} soft-caps its attention logits "
                f"(cap {cap}); centering shifts every score of a query by q·mu, which the cap's "
                f"tanh does not ignore, so it would change the attention. Use "
                f"kv_cache_key_centering=False (or None: off for such models)")
        logger.info("key centering off: model %s soft-caps its attention logits (cap %s), where "
                    "a constant key offset is not exact", model_name, cap)
        return False
    return requested


@dataclass
class KeyPlan:
    """What the calibration decided for a model and its cache settings."""
    calibration: Calibration | None     # None: the settings need none
    centered_layers: list[int]          # layers whose keys are centered
    auto_layers: list[int] | None       # None: automatic routing not asked for
    routing: str | None = None          # the plan log's line on automatic routing
    full_precision: list[int] = field(default_factory=list)  # every full-precision layer
    seconds: float = 0.0                # what deciding took (the engine's start-up part)

    @property
    def key_offsets(self) -> list[torch.Tensor | None] | None:
        """Per layer, the (Hk, D) offset its keys are centered by, or None; None when no layer
        is centered."""
        if not self.centered_layers:
            return None
        on = set(self.centered_layers)
        return [mu if i in on else None for i, mu in enumerate(self.calibration.key_offsets)]

    def describe(self) -> str | None:
        return (self.calibration.describe(self.centered_layers, self.full_precision)
                if self.calibration else None)


def plan_keys(model: torch.nn.Module, tokenizer, info, model_name: str, *, kv_cache_dtype: str,
              skip_layers, boundary_layers: int | None, key_centering: bool | None,
              auto_skip_budget: float, max_model_len: int, use_cache: bool = True,
              average=None, cache_head_dims: list[int] | None = None) -> KeyPlan:
    """Calibrate if the settings need it (a TurboQuant ``kv_cache_dtype`` with key centering or
    ``"auto"`` routing), choose the centered layers and the automatic ones. ``cache_head_dims``:
    the head size each layer's compressed cache would store (padded ones: the padded codec's
    errors and bytes); None: the model's head size."""
    from ..attention.selector import full_precision_layers, wants_auto_layers
    from ..quant.presets import PRESETS

    auto = wants_auto_layers(skip_layers)
    # bad routing (an index past the model's layers) fails before the calibration's passes
    full_precision_layers(info.num_layers, info.sliding_windows, skip_layers, boundary_layers,
                          [] if auto else None)
    if (kv_cache_dtype not in PRESETS
            or PRESETS[kv_cache_dtype].head_dim_unsupported_reason(info.head_dim)):
        # a full-precision cache, or a preset the layer plan refuses (with the reason)
        return KeyPlan(None, [], [] if auto else None)
    mode = resolve_key_centering(key_centering, kv_cache_dtype, info, model_name)
    if mode is False and not auto:
        return KeyPlan(None, [], None)
    cal = calibrate(model, tokenizer, preset=kv_cache_dtype, head_dim=info.head_dim,
                    num_layers=info.num_layers, vocab_size=info.vocab_size,
                    max_model_len=max_model_len, use_cache=use_cache, average=average,
                    cache_head_dims=cache_head_dims)
    centered = cal.centered_layers(mode)
    layers, line = (choose_auto_layers(cal.errors(centered), info, kv_cache_dtype, skip_layers,
                                       boundary_layers, auto_skip_budget, cache_head_dims)
                    if auto else (None, None))
    # a full-precision layer stores its keys as they are: not centered, and not named so
    fp = set().union(*full_precision_layers(info.num_layers, info.sliding_windows, skip_layers,
                                            boundary_layers, layers).values())
    centered = [i for i in centered if i not in fp]
    logger.info("%s", cal.describe(centered, sorted(fp)))
    if line:
        logger.info("%s", line)
    return KeyPlan(cal, centered, layers, line, sorted(fp))


def choose_auto_layers(errors: list[float], info, kv_cache_dtype: str, skip_layers,
                       boundary_layers: int | None, budget: float,
                       cache_head_dims: list[int] | None = None) -> tuple[list[int], str]:
    """(layers automatic routing keeps full precision, the log line). The layers other rules
    keep are not judged; extra bytes count full precision at 16 bits, so the choice is the
    same on every device that stores the same cache layout (``cache_head_dims``: a padded
    layer's compressed slot is the padded one)."""
    from ..attention.selector import (auto_full_precision_layers, full_precision_layers,
                                      without_auto)
    from ..quant.layout import build_layout

    others = full_precision_layers(info.num_layers, info.sliding_windows, without_auto(skip_layers),
                                   boundary_layers)
    candidates = set(range(info.num_layers)) - set().union(*others.values())
    dims = cache_head_dims or [info.head_dim] * info.num_layers
    slots = [build_layout(kv_cache_dtype, d).slot_bytes for d in dims]
    extra = [info.num_kv_heads * (2 * info.head_dim * 2 - s) for s in slots]
    budget_bytes = budget * info.num_kv_heads * sum(slots)
    return auto_full_precision_layers(errors, candidates, extra, budget_bytes)


def apply_key_offsets(layers, plan: KeyPlan, device) -> int:
    """Give every centered TurboQuant layer its key offset; returns how many got one."""
    offsets = plan.key_offsets
    if offsets is None:
        return 0
    n = 0
    for layer in layers:
        mu = offsets[layer.spec.layer_idx]
        if mu is not None and hasattr(layer.impl, "set_key_offset"):
            layer.impl.set_key_offset(mu, device)
            n += 1
    return n
