"""TurboQuantCache: a transformers ``Cache`` whose layers store K/V with tqattn's codec.

    from tqattn.integrations.transformers import TurboQuantCache

    cache = TurboQuantCache(model.config, preset="tq_k4v3")
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)

It follows the ``Cache`` / ``CacheLayerMixin`` API of transformers 5.17–5.25 (``DynamicLayer``,
``DynamicSlidingWindowLayer``, ``QuantizedLayer``); it works in ``generate()`` (greedy, sampling,
beam search, left-padded batches) and in a manual forward loop.

Per layer (:class:`TurboQuantLayer`):

* tokens older than the residual window are compressed with the preset's codec, in the engine's
  paged layout (:mod:`tqattn.integrations._kv_store`): the same codec, rotation seed and slot
  bytes as ``tqattn.LLM(kv_cache_dtype=preset)``;
* the newest ``residual_length`` tokens stay in full precision (``QuantizedCache``'s residual
  window; it moves one token at a time, so it always holds exactly the newest tokens).

What attention reads is the engine's rule (``tqattn.attention.turboquant``): an update of several
tokens (a prompt or a chunk) reads the history as the cache held it plus its own tokens raw; a
one-token update (a decode step) reads the cache after storing its token — with a window of 0 it
reads itself compressed, as the engine's decode does. So ``residual_length=0`` reproduces the
engine; the default window (:data:`DEFAULT_RESIDUAL_LENGTH`) comes from the measurement in
``bench/hf_cache_ppl.py`` (README, "transformers").

Attention itself is the model's (sdpa / eager): the compressed history is dequantized on every
step — ``kernels.dequant_kv`` (Triton on CUDA, the PyTorch reference on CPU) — and new tokens are
compressed with ``kernels.store_kv``. The engine's decode kernels, which read the codes without
dequantizing, need the engine's attention hook, not a ``Cache``.

Routing is the engine's (``kv_cache_dtype_skip_layers`` / ``kv_cache_boundary_layers``):
skipped layers are transformers' own ``DynamicLayer`` / ``DynamicSlidingWindowLayer``.

Key centering and automatic routing (the engine's defaults) need the start-up calibration of
the model: :meth:`TurboQuantCache.calibrated` runs it (:mod:`tqattn.engine.calibration`,
cached) and builds the cache the engine would. A layer with a key offset μ compresses k − μ
and adds μ back when it reads its history, so the model's attention sees its own keys — exact
with any attention, soft-capped included. The plain constructor takes ``key_offsets`` directly
and refuses ``"auto"`` in ``skip_layers`` (it has no calibration to route by).
Sliding-window layers that are compressed keep what ``DynamicSlidingWindowLayer`` keeps (the last
``sliding_window - 1`` tokens), compressed beyond the window. Layer types other than full and
sliding attention are refused.

``reorder_cache`` / ``batch_select_indices`` / ``batch_repeat_interleave`` move compressed bytes
(no re-quantization, exact). ``crop`` works, but tokens it brings back into the residual window
stay compressed, so the cache reports ``is_croppable = False`` (transformers' term for a rollback
that leaves no trace), as ``QuantizedCache`` does.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

try:
    from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer
except ImportError as e:
    from ..extras import missing_extra

    raise missing_extra("TurboQuantCache", "hf", e) from e

from ..attention.selector import (AUTO_SKIP, DEFAULT_AUTO_SKIP_BUDGET, check_routing_args,
                                  resolve_kv_cache_dtypes, routing_entries, wants_auto_layers)
from ..attention.turboquant import MODEL_DTYPES, get_codec
from ..models.info import model_info
from ..quant.presets import PRESETS, get_preset
from ._kv_store import CompressedKV

try:  # the keyword generate() and forward() take the cache by: "cache" from 5.2x on
    from transformers.generation.utils import ALL_CACHE_NAMES
except ImportError:
    ALL_CACHE_NAMES = []
CACHE_ARGUMENT = "cache" if "cache" in ALL_CACHE_NAMES else "past_key_values"

# Measured, not guessed: bench/hf_cache_ppl.py --sweep (bench/results/README.md, "transformers").
DEFAULT_RESIDUAL_LENGTH = 128
FULL_PRECISION = "auto"


class TurboQuantLayer(DynamicLayer):
    """One full-attention layer: compressed history + a full-precision residual window.

    ``keys`` / ``values`` hold the residual window (B, Hk, r, D), as in ``QuantizedLayer``;
    ``compressed`` the older tokens.
    """

    is_croppable = False

    def __init__(self, preset: str, residual_length: int = DEFAULT_RESIDUAL_LENGTH,
                 key_offset: torch.Tensor | None = None):
        super().__init__()
        self.preset = get_preset(preset).name
        self.residual_length = residual_length
        self.cumulative_length = 0
        self.compressed: CompressedKV | None = None
        self.key_offset = key_offset   # (Hk, D): compressed keys are stored as k − μ
        self._mu = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.dtype not in MODEL_DTYPES:
            raise TypeError(f"TurboQuantCache: key/value dtype {key_states.dtype} not supported "
                            f"(fp16, bf16, fp32)")
        b, hk, _, d = key_states.shape
        codec = get_codec(self.preset, d, str(key_states.device))
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_zeros(b, hk, 0, d)
        self.values = value_states.new_zeros(b, hk, 0, d)
        self.compressed = CompressedKV(codec, b, hk, key_states.device)
        if self.key_offset is not None:
            if tuple(self.key_offset.shape) != (hk, d):
                raise ValueError(f"TurboQuantCache: key offset of shape "
                                 f"{tuple(self.key_offset.shape)} for keys with {hk} KV heads of "
                                 f"size {d}; expected ({hk}, {d})")
            self._mu = self.key_offset.to(key_states.device, key_states.dtype)[None, :, None, :]
        self.is_initialized = True

    # ---- update -----------------------------------------------------------------------------------

    def _keep(self) -> int | None:
        """How many tokens the layer keeps between steps (None: all)."""
        return None

    def _trim(self, keep: int | None) -> int:
        """Forget all but the newest ``keep`` held tokens (compressed ones are the oldest);
        returns how many raw tokens of the window still have to go."""
        if keep is None:
            return 0
        gone = max(len(self.compressed) + self.keys.shape[-2] - keep, 0)
        from_compressed = min(gone, len(self.compressed))
        self.compressed.drop_front(from_compressed)
        return gone - from_compressed

    def _push(self, key_states: torch.Tensor, value_states: torch.Tensor,
              keep: int | None) -> None:
        """Append the new tokens, forget what slides out of ``keep``, compress what leaves the
        residual window (tokens about to be forgotten are never compressed)."""
        k = torch.cat([self.keys, key_states], dim=-2)
        v = torch.cat([self.values, value_states], dim=-2)
        if keep is not None:
            gone = max(len(self.compressed) + k.shape[-2] - keep, 0)
            from_compressed = min(gone, len(self.compressed))
            self.compressed.drop_front(from_compressed)
            k, v = k[..., gone - from_compressed:, :], v[..., gone - from_compressed:, :]
        spill = max(k.shape[-2] - self.residual_length, 0)
        if spill:
            old = k[..., :spill, :]
            self.compressed.append(old if self._mu is None else old - self._mu, v[..., :spill, :])
        self.keys, self.values = _own(k, spill), _own(v, spill)

    def _read(self, *extra: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        ck, cv = self.compressed.read(self.dtype)
        if self._mu is not None:
            ck = ck + self._mu
        ks = [ck, self.keys] + [e[0] for e in extra]
        vs = [cv, self.values] + [e[1] for e in extra]
        return torch.cat(ks, dim=-2), torch.cat(vs, dim=-2)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        keep = self._keep()
        if key_states.shape[-2] == 1:
            # a decode step reads the cache as it holds its own token (the engine's order);
            # a sliding layer forgets its oldest token only after this step has seen it
            self._push(key_states, value_states, None if keep is None else keep + 1)
            out = self._read()
            raw_gone = self._trim(keep)
            if raw_gone:
                self.keys, self.values = _own(self.keys, raw_gone), _own(self.values, raw_gone)
            return out
        out = self._read((key_states, value_states))
        self._push(key_states, value_states, keep)
        return out

    def _check(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, hk, _, d = self.keys.shape
        if key_states.shape[0] != b or key_states.shape[1] != hk or key_states.shape[-1] != d:
            raise ValueError(f"TurboQuantCache layer holds (batch={b}, kv_heads={hk}, head_dim={d}); "
                             f"got key_states of shape {tuple(key_states.shape)}")
        if value_states.shape != key_states.shape:
            raise ValueError(f"value_states {tuple(value_states.shape)} != key_states "
                             f"{tuple(key_states.shape)}")

    # ---- sizes ------------------------------------------------------------------------------------

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def stored_bytes(self) -> dict[str, int]:
        """Bytes held now: ``compressed`` (slots of the compressed tokens), ``residual`` (the
        full-precision window) and ``allocated`` (both, with the compressed pool's slack)."""
        if not self.is_initialized:
            return {"compressed": 0, "residual": 0, "allocated": 0}
        residual = self.keys.numel() * self.keys.element_size() * 2
        return {"compressed": self.compressed.stored_bytes(), "residual": residual,
                "allocated": self.compressed.allocated_bytes() + residual}

    @property
    def num_compressed_tokens(self) -> int:
        return len(self.compressed) if self.compressed is not None else 0

    # ---- edits ------------------------------------------------------------------------------------

    def reset(self) -> None:
        super().reset()   # DynamicLayer: drops keys/values, clears is_initialized and the length
        self.compressed = None

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the newest ``-tokens_to_remove`` tokens (transformers' negative convention; a
        positive value is the length to keep, as transformers 5.17 still accepts)."""
        if not self.is_initialized:
            return
        if tokens_to_remove > 0:
            tokens_to_remove = -max(self.cumulative_length - tokens_to_remove, 0)
        n = min(-tokens_to_remove, self.cumulative_length)
        if n == 0:
            return
        raw = min(n, self.keys.shape[-2])
        if raw:
            self.keys, self.values = _own(self.keys, 0, -raw), _own(self.values, 0, -raw)
        self.compressed.drop_back(n - raw)
        self.cumulative_length -= n

    def _select(self, index: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        index = index.to(self.keys.device)
        self.keys = self.keys.index_select(0, index)
        self.values = self.values.index_select(0, index)
        self.compressed.select_rows(index)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._select(torch.arange(self.keys.shape[0], device=self.keys.device)[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select(torch.arange(self.keys.shape[0], device=self.keys.device)
                         .repeat_interleave(repeats))

    def offload(self):
        raise NotImplementedError("TurboQuantCache does not offload layers (offloading=False)")

    def prefetch(self):
        raise NotImplementedError("TurboQuantCache does not offload layers (offloading=False)")

    def __repr__(self):
        return (f"{type(self).__name__}(preset={self.preset!r}, "
                f"residual_length={self.residual_length})")


def _own(x: torch.Tensor, start: int, stop: int | None = None) -> torch.Tensor:
    """Tokens [start, stop) of x (B, Hk, T, D) in storage of their own (a slice is a view that
    would keep every token of x alive); x itself when that is all of it."""
    if start == 0 and stop is None:
        return x
    return x[..., start:stop, :].clone()


class TurboQuantSlidingWindowLayer(TurboQuantLayer):
    """A sliding-window layer: keeps what ``DynamicSlidingWindowLayer`` keeps (the last
    ``sliding_window - 1`` tokens), compressed beyond the residual window; same mask sizes."""

    is_sliding = True

    def __init__(self, preset: str, sliding_window: int,
                 residual_length: int = DEFAULT_RESIDUAL_LENGTH,
                 key_offset: torch.Tensor | None = None):
        super().__init__(preset, residual_length, key_offset)
        self.sliding_window = sliding_window

    def _keep(self) -> int | None:
        return self.sliding_window - 1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        w, n = self.sliding_window, self.cumulative_length
        kv_offset = max(n - w + 1, 0)
        kv_length = (w - 1 if n >= w else n) + query_length
        return kv_length, kv_offset

    def get_max_length(self) -> int:
        return self.sliding_window

    def crop(self, tokens_to_remove: int) -> None:
        if self.cumulative_length >= self.sliding_window and tokens_to_remove != 0:
            raise RuntimeError("TurboQuantCache: a sliding-window layer that has reached its window "
                               f"({self.sliding_window} tokens) no longer holds the tokens a crop "
                               "would bring back")
        super().crop(tokens_to_remove)


class TurboQuantCache(Cache):
    """A transformers ``Cache`` that compresses K/V with a tqattn preset.

    Args:
        config: the model's config (or the model): layer count, head size, sliding windows.
        preset: a ``kv_cache_dtype`` preset name (``tqattn presets``), or ``"auto"`` for a
            full-precision cache (every layer transformers' own; a ``DynamicCache`` in all but
            name).
        residual_length: newest tokens kept in full precision per layer (0: the engine's cache).
        skip_layers: layers kept full precision — indices and/or ``"sliding_window"``
            (the engine's ``kv_cache_dtype_skip_layers``).
        boundary_layers: the first and last N layers full precision (the engine's
            ``kv_cache_boundary_layers``; default as the engine's).
        key_offsets: per layer, the (num_kv_heads, head_dim) mean key a compressed layer centers
            by, or None (a (num_layers, num_kv_heads, head_dim) tensor centers every layer);
            None: no centering. :meth:`calibrated` measures them.
        auto_layers: the layers ``"auto"`` in ``skip_layers`` stands for (:meth:`calibrated`).
    """

    def __init__(self, config, preset: str = "tq_k4v3", *,
                 residual_length: int = DEFAULT_RESIDUAL_LENGTH,
                 skip_layers: Iterable[int | str] = (), boundary_layers: int | None = None,
                 key_offsets: torch.Tensor | list[torch.Tensor | None] | None = None,
                 auto_layers: Iterable[int] | None = None):
        config = getattr(config, "config", config)   # a model is accepted too
        if not hasattr(config, "num_hidden_layers") and not hasattr(config, "get_text_config"):
            raise TypeError(f"TurboQuantCache needs the model's config (or the model), got "
                            f"{type(config).__name__}")
        if preset != FULL_PRECISION and preset not in PRESETS:
            raise ValueError(f"TurboQuantCache: unknown preset {preset!r}; valid: "
                             f"{FULL_PRECISION!r}, {', '.join(PRESETS)}")
        if (isinstance(residual_length, bool) or not isinstance(residual_length, int)
                or residual_length < 0):
            raise ValueError(f"TurboQuantCache: residual_length must be an int >= 0, got "
                             f"{residual_length!r}")
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        try:
            info = model_info(text)
        except ValueError as e:
            raise ValueError(f"TurboQuantCache cannot hold this model's layers: {e}") from None
        if preset != FULL_PRECISION:
            get_preset(preset).check_head_dim(info.head_dim)
        if preset != FULL_PRECISION and wants_auto_layers(skip_layers) and auto_layers is None:
            raise ValueError("TurboQuantCache: skip_layers 'auto' needs the model's calibration; "
                             "use TurboQuantCache.calibrated(model, tokenizer, preset), or list "
                             "the layers")
        shape = (info.num_kv_heads, info.head_dim)
        if key_offsets is not None:
            key_offsets = [None if mu is None else torch.as_tensor(mu) for mu in key_offsets]
            if len(key_offsets) != info.num_layers or any(
                    mu is not None and tuple(mu.shape) != shape for mu in key_offsets):
                got = [None if mu is None else tuple(mu.shape) for mu in key_offsets]
                raise ValueError(f"TurboQuantCache: key_offsets {got}; expected one (num_kv_heads, "
                                 f"head_dim) = {shape} tensor or None per layer, "
                                 f"{info.num_layers} layers")
        self.preset = preset
        self.residual_length = residual_length
        self._model_shape = (info.num_layers, info.num_kv_heads, info.head_dim)
        self.layer_kv_cache_dtypes = resolve_kv_cache_dtypes(
            info.num_layers, info.sliding_windows, preset, skip_layers, boundary_layers,
            auto_layers)
        layers = []
        for i, (dtype, window) in enumerate(zip(self.layer_kv_cache_dtypes, info.sliding_windows)):
            mu = None if key_offsets is None else key_offsets[i]
            if dtype == FULL_PRECISION:
                layers.append(DynamicSlidingWindowLayer(window) if window else DynamicLayer())
            elif window:
                layers.append(TurboQuantSlidingWindowLayer(dtype, window, residual_length, mu))
            else:
                layers.append(TurboQuantLayer(dtype, residual_length, mu))
        super().__init__(layers=layers)

    @classmethod
    def calibrated(cls, model, tokenizer=None, preset: str = "tq_k4v3", *,
                   residual_length: int = DEFAULT_RESIDUAL_LENGTH,
                   skip_layers: Iterable[int | str] = (AUTO_SKIP,),
                   boundary_layers: int | None = None, key_centering: bool | None = None,
                   auto_skip_budget: float = DEFAULT_AUTO_SKIP_BUDGET,
                   max_model_len: int | None = None) -> "TurboQuantCache":
        """The cache ``tqattn.LLM`` would build for ``model`` with these settings (the engine's
        defaults: keys centered, ``"auto"`` routing): runs the start-up calibration, cached
        per model. ``tokenizer``: the model's (None: random token ids, as the engine does for
        a model without one); ``max_model_len``: the length the cache serves (default the
        model's ``max_position_embeddings``), which sets the calibration's positions."""
        from ..engine.calibration import plan_keys

        check_routing_args(skip_layers, boundary_layers, auto_skip_budget)
        config = model.config
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        info = model_info(text)
        plan = plan_keys(model, tokenizer, info, type(model).__name__, kv_cache_dtype=preset,
                         skip_layers=routing_entries(skip_layers), boundary_layers=boundary_layers,
                         key_centering=key_centering, auto_skip_budget=auto_skip_budget,
                         max_model_len=max_model_len or info.max_position_embeddings)
        return cls(config, preset, residual_length=residual_length, skip_layers=skip_layers,
                   boundary_layers=boundary_layers, key_offsets=plan.key_offsets,
                   auto_layers=plan.auto_layers)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        layers, hk, d = self._model_shape
        if not 0 <= layer_idx < layers or key_states.dim() != 4 or tuple(key_states.shape[1::2]) != (hk, d):
            raise ValueError(f"this TurboQuantCache was built for a model of {layers} layers with "
                             f"{hk} KV heads of size {d}; got layer {layer_idx} with key_states of "
                             f"shape {tuple(key_states.shape)} (another model's cache?)")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def crop(self, max_length: int) -> None:
        """transformers' crop: a negative value removes that many newest tokens; a positive one
        (the older form) is the length to keep, turned into the negative form for every layer."""
        if max_length > 0:
            max_length = -max(self.get_seq_length() - max_length, 0)
            if max_length == 0:
                return
        super().crop(max_length)

    def stored_bytes(self) -> dict[str, int]:
        """Bytes the cache holds now, summed over layers: ``compressed``, ``residual`` (the
        full-precision windows), ``full_precision`` (skipped layers) and ``allocated``."""
        tot = {"compressed": 0, "residual": 0, "full_precision": 0, "allocated": 0}
        for layer in self.layers:
            if isinstance(layer, TurboQuantLayer):
                for k, v in layer.stored_bytes().items():
                    tot[k] += v
            elif layer.is_initialized:
                n = sum(x.numel() * x.element_size() for x in (layer.keys, layer.values))
                tot["full_precision"] += n
                tot["allocated"] += n
        return tot

    def __repr__(self):
        return (f"{type(self).__name__}(preset={self.preset!r}, "
                f"residual_length={self.residual_length}, layers={self.layers})")
