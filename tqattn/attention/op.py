"""``tqattn::attention``: one layer's attention as an opaque PyTorch custom op.

``torch.compile`` sees only the op's signature — (q, k, v, layer) -> output of q's shape
and dtype — never its body, so Dynamo does not trace the metadata, the cache or the kernels,
and the model code around it (norms, RoPE, MLP, residual adds) compiles into fused kernels.
The body finds what a step needs in the forward context: the layer's backend impl, its paged
KV cache and its group's metadata (vLLM's ``unified_attention``). The cache is written inside
the op (a side effect the graph does not see); that is safe because every layer's output
depends on the op of the layer before it, so the ops run in model order.

The op takes any strides with a contiguous last dimension (``flexible_layout``): Inductor then
hands over q and k as its RoPE kernels laid them out, instead of copying them into the layout
eager mode would have had (one copy kernel per input and layer; the backends take strides).
``tqattn::attention_exact_strides`` (the same body, Inductor's default constraint) serves
layers with a single query or KV head: Inductor cannot order the strides of such a buffer,
whose size-1 dims can both hold the token count.
"""

from __future__ import annotations

import hashlib

import torch

from .forward_context import get_forward_context


def _attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               layer: torch.Tensor) -> torch.Tensor:
    """query (T, Hq, D), key/value (T, Hk, D), any strides -> contiguous (T, Hq, D) in query's
    dtype; stores the K/V. ``layer``: the layer index as a 0-dim int64 CPU tensor (a module
    buffer: a graph input, so every decoder layer shares one compiled graph instead of
    specializing on its index)."""
    layer_idx = int(layer)
    ctx = get_forward_context()
    layer = ctx.layers[layer_idx]
    query, key, value = (x if x.stride(-1) == 1 else x.contiguous() for x in (query, key, value))
    return layer.impl.store_and_forward(query, key, value, ctx.kv_caches[layer_idx],
                                        ctx.metadata[layer.group])


def _fake(query, key, value, layer):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


attention = torch.library.custom_op("tqattn::attention", _attention, mutates_args=(),
                                    tags=(torch.Tag.flexible_layout,))
attention.register_fake(_fake)
attention_exact_strides = torch.library.custom_op("tqattn::attention_exact_strides", _attention,
                                                  mutates_args=())
attention_exact_strides.register_fake(_fake)


def fingerprint(ops=(attention, attention_exact_strides)) -> str:
    """12 hex digits of a hash of the ops' schemas and tags. Inductor's graph cache key names a
    custom op and its arguments but not its tags, so a graph cached before a tag changed would
    be reused with the old layout handling: the engine keeps its Inductor cache in a folder per
    fingerprint (:func:`tqattn.engine.compilation.use_cache_dirs`)."""
    h = hashlib.sha256()
    for op in ops:
        overload = op._opoverload
        h.update(f"{overload._schema}|{sorted(str(t) for t in overload.tags)}\n".encode())
    return h.hexdigest()[:12]
