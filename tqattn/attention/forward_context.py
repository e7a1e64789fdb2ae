"""The forward context: what the attention calls of one model step need, set by the model runner.

Model code (transformers) calls attention with only (module, q, k, v, ...). The model runner puts
everything else — each layer's backend impl and KV-cache tensor, and each KV-cache group's
metadata for this step — in a module-level context for the duration of the forward pass.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from .backend import AttentionLayer


@dataclass
class ForwardContext:
    layers: dict[int, AttentionLayer]  # layer_idx -> layer bound to its backend and group
    kv_caches: dict[int, torch.Tensor]  # layer_idx -> its paged cache
    metadata: list[Any]  # per KV-cache group: its backend's built metadata


_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _context is None:
        raise RuntimeError("tqattn attention was called outside a forward context; run the model "
                           "through tqattn's model runner (or inside set_forward_context)")
    return _context


@contextmanager
def set_forward_context(context: ForwardContext):
    global _context
    prev, _context = _context, context
    try:
        yield context
    finally:
        _context = prev
