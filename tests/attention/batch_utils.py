"""Hand-built batches for the backend tests: requests with cached prefixes, a paged block table
with shuffled blocks, and a plain PyTorch attention to compare against."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tqattn.attention.backend import AttentionLayerSpec, CommonAttentionMetadata

BLOCK_SIZE = 16


@dataclass
class Batch:
    common: CommonAttentionMetadata
    reqs: list[tuple[int, int]]      # (num_computed_tokens, query length) per request
    block_table: torch.Tensor
    q_pos: list[torch.Tensor]        # absolute positions of each request's chunk tokens


def spec(layer_idx=0, *, hq=4, hk=2, d=16, dtype=torch.float32, kv="auto", window=None,
         softcap=0.0, **kw) -> AttentionLayerSpec:
    return AttentionLayerSpec(layer_idx=layer_idx, num_heads=hq, num_kv_heads=hk, head_size=d,
                              scale=1 / math.sqrt(d), dtype=dtype, kv_cache_dtype=kv,
                              sliding_window=window, logits_soft_cap=softcap, **kw)


def _common(reqs, block_table, pad, block_size, device="cpu"):
    q_lens = torch.tensor([q for _, q in reqs], dtype=torch.int64)
    nc = torch.tensor([c for c, _ in reqs], dtype=torch.int32)
    seq_lens = (nc + q_lens).to(torch.int32)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).to(torch.int32)
    slots, q_pos = [], []
    for b, (c, q) in enumerate(reqs):
        pos = torch.arange(c, c + q)
        q_pos.append(pos)
        slots.append(block_table[b, pos // block_size].long() * block_size + pos % block_size)
    slot_mapping = torch.cat(slots + [torch.full((pad,), -1, dtype=torch.int64)])
    num_decodes = 0
    while num_decodes < len(reqs) and reqs[num_decodes][1] == 1:
        num_decodes += 1
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(device), seq_lens=seq_lens.to(device),
        num_computed_tokens=nc.to(device), block_table=block_table.to(device),
        slot_mapping=slot_mapping.to(device), query_start_loc_cpu=qsl.clone(),
        seq_lens_cpu=seq_lens.clone(), num_computed_tokens_cpu=nc.clone(), num_reqs=len(reqs),
        num_actual_tokens=int(q_lens.sum()), max_query_len=int(q_lens.max()),
        max_seq_len=int(seq_lens.max()), num_decodes=num_decodes, num_decode_tokens=num_decodes,
        block_size=block_size)
    return common, q_pos


def make_batch(reqs, *, pad=0, block_size=BLOCK_SIZE, extra_blocks=3, gen=None,
               device="cpu") -> Batch:
    """A step of ``reqs`` = [(num_computed_tokens, query_len), ...], blocks shuffled."""
    need = [math.ceil((c + q) / block_size) for c, q in reqs]
    total = sum(need) + extra_blocks
    ids = torch.randperm(total, generator=gen).to(torch.int32)
    table = torch.zeros(len(reqs), max(need), dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = ids[at:at + n]
        at += n
    common, q_pos = _common(reqs, table, pad, block_size, device)
    return Batch(common, list(reqs), table, q_pos)


def num_blocks(batch: Batch, extra_blocks=3) -> int:
    return int(batch.block_table.max()) + 1 + extra_blocks


def history_batch(batch: Batch) -> Batch | None:
    """The earlier step that stored every request's cached prefix (as one prefill chunk)."""
    reqs = [(0, c) for c, _ in batch.reqs if c > 0]
    if not reqs:
        return None
    rows = torch.tensor([b for b, (c, _) in enumerate(batch.reqs) if c > 0])
    table = batch.block_table[rows]
    common, q_pos = _common(reqs, table, 0, batch.common.block_size,
                            batch.common.block_table.device)
    return Batch(common, reqs, table, q_pos)


def random_qkv(num_tokens, s: AttentionLayerSpec, gen=None, scale=1.0, device="cpu"):
    shape_q = (num_tokens, s.num_heads, s.head_size)
    shape_kv = (num_tokens, s.num_kv_heads, s.head_size)
    q = torch.randn(shape_q, generator=gen) * scale
    k = torch.randn(shape_kv, generator=gen) * scale
    v = torch.randn(shape_kv, generator=gen)
    return tuple(x.to(device=device, dtype=s.dtype) for x in (q, k, v))


def head_major(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The same (T, H, D) values laid out head by head (strides (D, T·D, 1)), as the compiled
    model hands q/k/v to the attention op after RoPE."""
    return tuple(x.transpose(0, 1).contiguous().transpose(0, 1) for x in xs)


def attention(q, k, v, q_pos, k_pos, scale, window=None, softcap=0.0):
    """Plain fp32 attention: q (Lq, Hq, D) at positions q_pos, keys at k_pos; causal, window W
    keeps keys > p − W."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, 1)
    v = v.float().repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    s = s.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)
