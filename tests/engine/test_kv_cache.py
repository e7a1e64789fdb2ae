"""KV-cache groups, sizing from one budget, and allocation (no model needed)."""

from __future__ import annotations

import math

import pytest
import torch

from tqattn.attention.backend import AttentionLayer, AttentionLayerSpec
from tqattn.attention.selector import build_attention_layers, resolve_kv_cache_dtypes
from tqattn.engine.kv_cache import (DEFAULT_CPU_KV_CACHE_BYTES, KVCacheConfig, allocate_kv_caches,
                                    bf16_bytes_per_token, determine_num_blocks, kv_cache_groups)

WINDOWS = [8, 8, 8, None]  # gemma3-tiny's layers


def _layers(preset="turboquant_k3v4_nc", skip=("sliding_window",)):
    dtypes = resolve_kv_cache_dtypes(4, WINDOWS, preset, list(skip), 0)
    specs = [AttentionLayerSpec(layer_idx=i, num_heads=4, num_kv_heads=2, head_size=16, scale=0.25,
                                dtype=torch.float32, kv_cache_dtype=dtypes[i], sliding_window=WINDOWS[i])
             for i in range(4)]
    return build_attention_layers(specs, 16)


def test_groups_and_bytes():
    layers = _layers()
    groups = kv_cache_groups(layers, 16)
    assert [(g.backend.name, g.layer_indices) for g in groups] == [("FLASH_ATTN", [0, 1, 2]),
                                                                  ("TURBOQUANT", [3])]
    fp32_page = 2 * 16 * 2 * 16 * 4  # K and V, 16 tokens, 2 heads, head size 16, fp32
    assert groups[0].page_bytes == 3 * fp32_page
    assert groups[1].page_bytes == 16 * 2 * 20  # 20-byte slots (see test_cache_plan)
    config = KVCacheConfig(16, 10, groups)
    assert config.bytes_per_block == 3 * fp32_page + 640 and config.num_tokens == 160
    assert config.total_bytes == 10 * config.bytes_per_block
    assert bf16_bytes_per_token(layers) == 4 * 2 * 2 * 16 * 2

    bad = [AttentionLayer(spec=l.spec, backend=l.backend, impl=l.impl, group=0) for l in layers]
    with pytest.raises(ValueError, match="group 0 mixes backends"):
        kv_cache_groups(bad, 16)
    with pytest.raises(ValueError, match="0..N-1"):
        kv_cache_groups([AttentionLayer(l.spec, l.backend, l.impl, group=2) for l in layers[:1]], 16)


def test_num_blocks_from_one_budget():
    per_block = 1000
    assert determine_num_blocks(per_block, 16, 64, kv_cache_memory_bytes=10_500) == 10
    assert determine_num_blocks(per_block, 16, 64, available_bytes=7_999) == 7
    assert determine_num_blocks(per_block, 16, 64, num_gpu_blocks_override=5,
                                kv_cache_memory_bytes=10**9) == 5
    # the CPU default, capped at what max_num_seqs full-length sequences can use
    assert determine_num_blocks(per_block, 16, 64) == DEFAULT_CPU_KV_CACHE_BYTES // per_block
    assert determine_num_blocks(per_block, 16, 64, max_useful_blocks=12) == 12
    assert determine_num_blocks(per_block, 16, 64, kv_cache_memory_bytes=50_000, max_useful_blocks=12) == 50
    for kwargs, what in [(dict(kv_cache_memory_bytes=3_000), "raise kv_cache_memory_bytes"),
                         (dict(available_bytes=-5), "raise gpu_memory_utilization"),
                         (dict(num_gpu_blocks_override=3), "raise num_gpu_blocks_override")]:
        with pytest.raises(ValueError, match=f"max_model_len=64 tokens needs 4 blocks.*{what}"):
            determine_num_blocks(per_block, 16, 64, **kwargs)


def test_allocate():
    layers = _layers()
    caches = allocate_kv_caches(layers, 3, 16, torch.device("cpu"))
    assert caches[0].shape == (2, 3, 16, 2, 16) and caches[0].dtype == torch.float32
    assert caches[3].dtype == torch.uint8 and caches[3].shape == (3, 2, 16 * 20)
    assert all(not c.any() for c in caches.values())
    total = sum(c.numel() * c.element_size() for c in caches.values())
    assert total == 3 * sum(g.page_bytes for g in kv_cache_groups(layers, 16))
    assert math.isclose(total / 3, KVCacheConfig(16, 3, kv_cache_groups(layers, 16)).bytes_per_block)
