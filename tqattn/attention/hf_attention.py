"""tqattn's attention as a transformers attention implementation ("tqattn").

The model runner feeds a flattened (1, T) batch with position_ids; each attention module then
calls :func:`tqattn_attention`, which checks the call against the layer's plan and runs the
``tqattn::attention`` custom op (:mod:`tqattn.attention.op`): the op stores the step's K/V into
the paged cache and runs the layer's backend. transformers builds no mask for an implementation
it has no mask function for, so causality and windows are entirely the backend's.

:func:`use_tqattn` binds each attention module to its layer's :class:`AttentionLayerSpec`
(``module.tqattn_spec``): the plan check reads only module attributes, so under
``torch.compile`` it runs once, while tracing, and costs nothing per step.
"""

from __future__ import annotations

import torch

from .backend import AttentionLayerSpec
from .op import attention, attention_exact_strides

ATTN_IMPLEMENTATION = "tqattn"


def tqattn_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None,
                     scaling: float | None = None, dropout: float = 0.0,
                     sliding_window: int | None = None, softcap: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """query (1, Hq, T, D), key/value (1, Hk, T, D) -> ((1, T, Hq, D), None)."""
    spec: AttentionLayerSpec | None = getattr(module, "tqattn_spec", None)
    if spec is None:
        raise RuntimeError(f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) "
                           f"has no tqattn layer plan; switch the model with use_tqattn(model, "
                           f"layers)")
    # The layer plan was built from the config; a model that disagrees at run time would
    # silently attend differently, so check.
    if ((sliding_window or None) != spec.sliding_window
            or (scaling is not None and abs(scaling - spec.scale) > 1e-6 * spec.scale)
            or float(softcap or 0.0) != spec.logits_soft_cap):
        raise RuntimeError(
            f"layer {spec.layer_idx}: the model called attention with sliding_window="
            f"{sliding_window}, scaling={scaling}, softcap={softcap}, but the KV-cache plan has "
            f"sliding_window={spec.sliding_window}, scale={spec.scale}, "
            f"softcap={spec.logits_soft_cap}")
    q, k, v = (_tokens_first(x) for x in (query, key, value))
    op = attention if q.shape[1] > 1 and k.shape[1] > 1 else attention_exact_strides
    return op(q, k, v, module.tqattn_layer).unsqueeze(0), None


def _tokens_first(x: torch.Tensor) -> torch.Tensor:
    """(1, H, T, D) -> (T, H, D), a view (the op takes any token and head strides)."""
    return x[0].transpose(0, 1)


def register() -> str:
    """Register the implementation with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, tqattn_attention)
    return ATTN_IMPLEMENTATION


def use_tqattn(model: torch.nn.Module, specs: list[AttentionLayerSpec]) -> None:
    """Switch a loaded transformers model to tqattn attention, each layer bound to its spec.

    transformers gives every attention module its ``layer_idx``; modules with one (some models'
    decoder layers carry it too, harmlessly) get ``tqattn_spec``.
    """
    by_idx = {s.layer_idx: s for s in specs}
    bound = set()
    for m in model.modules():
        idx = getattr(m, "layer_idx", None)
        if isinstance(idx, int) and idx in by_idx:
            m.tqattn_spec = by_idx[idx]
            m.register_buffer("tqattn_layer", torch.tensor(idx, device="cpu"),
                              persistent=False)  # the op reads it on the host
            bound.add(idx)
    if bound != set(by_idx):
        raise RuntimeError(f"{type(model).__name__}: no module with layer_idx for layers "
                           f"{sorted(set(by_idx) - bound)} of the KV-cache plan")
    model.set_attn_implementation(register())
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise RuntimeError(f"{type(model).__name__} did not accept the tqattn attention "
                           f"implementation (it does not use transformers' AttentionInterface)")
