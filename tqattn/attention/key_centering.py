"""Key centering: a constant key per KV head, subtracted before a layer's keys reach the codec.

Some models' keys carry a large constant offset per (layer, KV head) — Qwen2/2.5's key bias puts
60–97 % of the post-RoPE key energy of some layers in one vector — and a norm-and-direction
quantizer spends its bits on it. Subtracting the offset μ first leaves the codes for what
varies.

Why it is exact. With centered keys every score of a query q moves by the same constant:
q·(k_j − μ) = q·k_j − q·μ for all keys j of its (layer, KV head), and softmax ignores a
constant added to all of a row's scores. So attention over centered keys equals attention over
the original keys — provided that

* every key a query sees is centered: the cache holds k − μ, and FlashAttention reads the raw
  chunk centered wherever the chunk's queries also see the compressed prefix (a first chunk,
  which sees only itself, needs no centering: all its keys shift alike either way);
* partial attentions merged by LSE come from the same centered keys (the short-continuation
  merge of decode rows over the prefix with FlashAttention over the chunk): each part's LSE is
  lower by the same q·μ, so the merge weights are unchanged. The merged LSE stays internal (the
  backend returns outputs only);
* scores are not soft-capped: tanh(s/c) is not shift-invariant, so a soft-capped layer is
  refused (:func:`centering_unsupported_reason`).

μ is a persistent device tensor of the layer. The store subtracts it inside its own kernel (no
extra pass over the keys); FlashAttention gets centered keys (one elementwise kernel) only where
a compressed prefix shares its softmax, and a decode step centers its few new keys before the
decode kernel stores them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import AttentionLayerSpec


def centering_unsupported_reason(spec: AttentionLayerSpec) -> str | None:
    """Why centering the keys of this layer would change its attention, or None."""
    if spec.logits_soft_cap:
        return (f"{spec.name} soft-caps its attention logits (cap {spec.logits_soft_cap}): "
                f"centering shifts every score of a query by q·μ, which tanh does not ignore, so "
                f"it would change the attention; turn key centering off for this model")
    return None


class KeyOffset:
    """One layer's key offset μ (Hk, D), held on the device in the model dtype."""

    def __init__(self, offset: torch.Tensor, spec: AttentionLayerSpec,
                 device: torch.device | str | None = None):
        reason = centering_unsupported_reason(spec)
        if reason is not None:
            raise ValueError(reason)
        shape = (spec.num_kv_heads, spec.head_size)
        if tuple(offset.shape) != shape:
            raise ValueError(f"{spec.name}: key offset of shape {tuple(offset.shape)}; expected "
                             f"(num_kv_heads, head_size) = {shape}")
        if not bool(torch.isfinite(offset).all()):
            raise ValueError(f"{spec.name}: the key offset has non-finite values")
        self.tensor = offset.detach().to(device=device or offset.device,
                                         dtype=spec.dtype).contiguous()
        self._for_store: tuple | None = None  # (rotation, (μ, μ·R))

    def center(self, key: torch.Tensor) -> torch.Tensor:
        """key (T, Hk, D) − μ, a new tensor."""
        return key - self.tensor

    def for_store(self, rotation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(μ, μ·R) in fp32, each (Hk, D) (D: the rotation's size), for a store that centers as
        it encodes (R: the codec's rotation; the kernel rotates k and subtracts μ·R, as it does
        for outliers).
        μ is the model-dtype value :meth:`center` subtracts, so both shift scores alike."""
        if self._for_store is None or self._for_store[0] is not rotation:
            # a cache padded past the head size (spec.kv_cache_head_size): μ padded with zeros
            mu = F.pad(self.tensor.float(), (0, rotation.shape[0] - self.tensor.shape[-1]))
            mu_rot = (mu.double() @ rotation.to(mu.device).double()).float()
            self._for_store = (rotation, (mu, mu_rot))
        return self._for_store[1]
