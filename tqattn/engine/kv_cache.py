"""KV-cache groups, sizing from one memory budget, and allocation.

Layers with different cache specs (TurboQuant presets, full precision) live in separate KV-cache
groups (the selector assigns ``AttentionLayer.group``). Every group shares the block size and the
block manager allocates all groups in lockstep — a sequence holds the same number of blocks in
each — so every group gets the same number of blocks, and one block "costs" the sum of the
``page_bytes`` of every layer. The number of blocks comes from one budget: an explicit byte
budget, a fraction of the GPU's free memory, or a block count.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tqattn.attention.backend import AttentionBackend, AttentionLayer

logger = logging.getLogger(__name__)

GiB = 1 << 30
DEFAULT_CPU_KV_CACHE_BYTES = 1 * GiB


@dataclass
class KVCacheGroup:
    index: int
    backend: type[AttentionBackend]
    layer_indices: list[int]
    page_bytes: int  # bytes of one block, summed over the group's layers


@dataclass
class KVCacheConfig:
    block_size: int
    num_blocks: int  # per group (the same in every group)
    groups: list[KVCacheGroup]

    @property
    def bytes_per_block(self) -> int:
        return sum(g.page_bytes for g in self.groups)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def kv_cache_groups(layers: list[AttentionLayer], block_size: int) -> list[KVCacheGroup]:
    """The groups of a layer plan, in group-index order; checks each group has one backend."""
    by_group: dict[int, list[AttentionLayer]] = {}
    for layer in layers:
        by_group.setdefault(layer.group, []).append(layer)
    if sorted(by_group) != list(range(len(by_group))):
        raise ValueError(f"KV-cache group indices must be 0..N-1, got {sorted(by_group)}")
    groups = []
    for g in range(len(by_group)):
        members = by_group[g]
        backends = {layer.backend for layer in members}
        if len(backends) != 1:
            raise ValueError(f"KV-cache group {g} mixes backends {sorted(b.name for b in backends)}")
        groups.append(KVCacheGroup(
            index=g, backend=members[0].backend,
            layer_indices=[layer.spec.layer_idx for layer in members],
            page_bytes=sum(layer.backend.page_bytes(block_size, layer.spec) for layer in members)))
    return groups


def bf16_bytes_per_token(layers: list[AttentionLayer]) -> int:
    """What a bf16 cache of the same layers would take per token (K and V)."""
    return sum(2 * layer.spec.num_kv_heads * layer.spec.head_size * 2 for layer in layers)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def determine_num_blocks(bytes_per_block: int, block_size: int, max_model_len: int, *,
                         kv_cache_memory_bytes: int | None = None,
                         available_bytes: int | None = None,
                         num_gpu_blocks_override: int | None = None,
                         max_useful_blocks: int | None = None) -> int:
    """Blocks per group from one budget; raises when one max-length sequence would not fit.

    Precedence: num_gpu_blocks_override, then kv_cache_memory_bytes, then available_bytes (what
    gpu_memory_utilization leaves after the model and a profile run), then the CPU default
    (capped at ``max_useful_blocks``, what max_num_seqs full-length sequences can use).
    """
    if num_gpu_blocks_override is not None:
        num_blocks, source = num_gpu_blocks_override, f"num_gpu_blocks_override={num_gpu_blocks_override}"
        what_to_raise = "num_gpu_blocks_override"
    else:
        if kv_cache_memory_bytes is not None:
            budget, source = kv_cache_memory_bytes, f"kv_cache_memory_bytes={kv_cache_memory_bytes}"
            what_to_raise = "kv_cache_memory_bytes"
        elif available_bytes is not None:
            budget = available_bytes
            source = f"gpu_memory_utilization (leaves {_fmt_bytes(max(budget, 0))} for the KV cache)"
            what_to_raise = "gpu_memory_utilization (or set kv_cache_memory_bytes)"
        else:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
            source = f"the default CPU budget of {_fmt_bytes(budget)}"
            what_to_raise = "kv_cache_memory_bytes"
        num_blocks = max(budget, 0) // bytes_per_block
        if available_bytes is None and kv_cache_memory_bytes is None and max_useful_blocks:
            num_blocks = min(num_blocks, max_useful_blocks)
    need = -(-max_model_len // block_size)
    if num_blocks < need:
        raise ValueError(
            f"the KV cache from {source} holds {num_blocks} blocks of {block_size} tokens "
            f"({num_blocks * block_size} tokens, {_fmt_bytes(bytes_per_block)} per block), but one "
            f"sequence of max_model_len={max_model_len} tokens needs {need} blocks "
            f"({_fmt_bytes(need * bytes_per_block)}); raise {what_to_raise}, lower max_model_len, "
            f"or pick a smaller kv_cache_dtype")
    return num_blocks


def allocate_kv_caches(layers: list[AttentionLayer], num_blocks: int, block_size: int,
                       device: torch.device) -> dict[int, torch.Tensor]:
    """One zeroed paged cache tensor per layer, by layer index."""
    return {layer.spec.layer_idx: torch.zeros(
                layer.backend.kv_cache_shape(num_blocks, block_size, layer.spec),
                dtype=layer.backend.kv_cache_torch_dtype(layer.spec), device=device)
            for layer in layers}
