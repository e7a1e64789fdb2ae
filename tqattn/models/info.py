"""Per-layer attention facts of a Hugging Face config, for the engine's per-layer plan.

Works on any transformers 5.x decoder config by attribute access; it does not import
transformers. Sliding windows follow HF's convention: a query at position i attends to keys
j with i - sliding_window < j <= i (the window counts the query itself), which is
FlashAttention's window_size=(sliding_window - 1, 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelInfo:
    model_type: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    layer_types: list[str]  # "full_attention" or "sliding_attention", one per layer
    sliding_windows: list[int | None]  # None for full-attention layers
    rope_parameters: list[dict[str, Any]]  # per layer, e.g. {"rope_type": "default", "rope_theta": 1e6}
    scaling: float  # softmax scale applied to q.k
    attn_logit_softcapping: float | None

    @property
    def num_sliding_layers(self) -> int:
        return sum(w is not None for w in self.sliding_windows)


_KNOWN_LAYER_TYPES = ("full_attention", "sliding_attention")


def model_info(hf_config: Any) -> ModelInfo:
    cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    kind = getattr(cfg, "model_type", type(cfg).__name__)
    missing = [a for a in ("num_hidden_layers", "num_attention_heads", "hidden_size",
                           "max_position_embeddings") if not isinstance(getattr(cfg, a, None), int)]
    if missing:
        raise ValueError(f"a {kind!r} config has no {', '.join(missing)}: not a decoder of "
                         f"attention layers this project runs")
    v_head_dim = getattr(cfg, "v_head_dim", None)
    if getattr(cfg, "kv_lora_rank", None) or v_head_dim not in (None, getattr(cfg, "head_dim", None)):
        raise ValueError(f"a {kind!r} config has latent (MLA) attention or value heads of another size "
                         f"than its keys; the cache holds keys and values of one head size")
    n_layers = cfg.num_hidden_layers
    n_q = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_q
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_q

    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is None:
        # Older-style configs (e.g. Mistral): one window, if any, for every layer.
        layer_types = ["sliding_attention" if window else "full_attention"] * n_layers
    layer_types = list(layer_types)
    if len(layer_types) != n_layers:
        raise ValueError(f"config has {len(layer_types)} layer_types for {n_layers} layers")
    for t in set(layer_types):
        if t not in _KNOWN_LAYER_TYPES:
            raise ValueError(f"unsupported layer type {t!r}; supported: {list(_KNOWN_LAYER_TYPES)}")
    if "sliding_attention" in layer_types and not window:
        raise ValueError("config has sliding_attention layers but no sliding_window")
    windows = [window if t == "sliding_attention" else None for t in layer_types]

    rope = getattr(cfg, "rope_parameters", None) or {}
    if set(rope) & set(_KNOWN_LAYER_TYPES):  # Gemma 3 style: one rope dict per layer type
        rope_per_layer = [dict(rope[t]) for t in layer_types]
    else:
        rope_per_layer = [dict(rope) for _ in layer_types]

    # Gemma scales by query_pre_attn_scalar**-0.5 instead of head_dim**-0.5.
    scale_base = getattr(cfg, "query_pre_attn_scalar", None) or head_dim

    return ModelInfo(
        model_type=cfg.model_type,
        num_layers=n_layers,
        num_q_heads=n_q,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        layer_types=layer_types,
        sliding_windows=windows,
        rope_parameters=rope_per_layer,
        scaling=scale_base**-0.5,
        attn_logit_softcapping=getattr(cfg, "attn_logit_softcapping", None),
    )
