"""tqattn's attention as a transformers attention implementation ("tqattn").

The model runner feeds a flattened (1, T) batch with position_ids; each attention module then
calls :func:`tqattn_attention`, which finds its layer in the forward context, stores the step's
K/V into the paged cache and runs the layer's backend. transformers builds no mask for an
implementation it has no mask function for, so causality and windows are entirely the backend's.
"""

from __future__ import annotations

import torch

from tqattn.attention.forward_context import get_forward_context

ATTN_IMPLEMENTATION = "tqattn"


def tqattn_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None,
                     scaling: float | None = None, dropout: float = 0.0,
                     sliding_window: int | None = None, softcap: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """query (1, Hq, T, D), key/value (1, Hk, T, D) -> ((1, T, Hq, D), None)."""
    ctx = get_forward_context()
    layer = ctx.layers[module.layer_idx]
    spec = layer.spec
    # The layer plan was built from the config; a model that disagrees at run time would
    # silently attend differently, so check (plain Python, free under CUDA graph replay).
    if ((sliding_window or None) != spec.sliding_window
            or (scaling is not None and abs(scaling - spec.scale) > 1e-6 * spec.scale)
            or float(softcap or 0.0) != spec.logits_soft_cap):
        raise RuntimeError(
            f"layer {module.layer_idx}: the model called attention with sliding_window="
            f"{sliding_window}, scaling={scaling}, softcap={softcap}, but the KV-cache plan has "
            f"sliding_window={spec.sliding_window}, scale={spec.scale}, "
            f"softcap={spec.logits_soft_cap}")
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    kv_cache = ctx.kv_caches[module.layer_idx]
    metadata = ctx.metadata[layer.group]
    out = layer.impl.store_and_forward(q, k, v, kv_cache, metadata)
    return out.unsqueeze(0), None


def register() -> str:
    """Register the implementation with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, tqattn_attention)
    return ATTN_IMPLEMENTATION


def use_tqattn(model: torch.nn.Module) -> None:
    """Switch a loaded transformers model to tqattn attention."""
    model.set_attn_implementation(register())
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise RuntimeError(f"{type(model).__name__} did not accept the tqattn attention "
                           f"implementation (it does not use transformers' AttentionInterface)")
