"""``tqattn::attention``: one layer's attention as an opaque PyTorch custom op.

``torch.compile`` sees only the op's signature — (q, k, v, layer) -> output of q's shape
and dtype — never its body, so Dynamo does not trace the metadata, the cache or the kernels,
and the model code around it (norms, RoPE, MLP, residual adds) compiles into fused kernels.
The body finds what a step needs in the forward context: the layer's backend impl, its paged
KV cache and its group's metadata (vLLM's ``unified_attention``). The cache is written inside
the op (a side effect the graph does not see); that is safe because every layer's output
depends on the op of the layer before it, so the ops run in model order.
"""

from __future__ import annotations

import torch

from .forward_context import get_forward_context


@torch.library.custom_op("tqattn::attention", mutates_args=())
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              layer: torch.Tensor) -> torch.Tensor:
    """query (T, Hq, D), key/value (T, Hk, D) -> (T, Hq, D) in query's dtype; stores the K/V.
    ``layer``: the layer index as a 0-dim int64 CPU tensor (a module buffer: a graph input, so
    every decoder layer shares one compiled graph instead of specializing on its index)."""
    layer_idx = int(layer)
    ctx = get_forward_context()
    layer = ctx.layers[layer_idx]
    return layer.impl.store_and_forward(query, key, value, ctx.kv_caches[layer_idx],
                                        ctx.metadata[layer.group])


@attention.register_fake
def _(query, key, value, layer):
    return torch.empty_like(query, memory_format=torch.contiguous_format)
