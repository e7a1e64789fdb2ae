"""CPU-side batch planning shared by the metadata builders.

Everything here runs in ``build()`` on the CPU copies of the batch (``*_cpu`` tensors), once per
step and KV-cache group, and ends in a few non-blocking host-to-device copies; ``forward`` then
only launches kernels on the device tensors it gets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def segment_arange(lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For segments of ``lens`` (CPU int64): (segment id, offset in segment) of every element."""
    seg = torch.repeat_interleave(torch.arange(lens.numel()), lens)
    starts = torch.cumsum(lens, 0) - lens
    return seg, torch.arange(int(lens.sum())) - starts[seg]


def cumsum0(lens: torch.Tensor) -> torch.Tensor:
    """(n + 1,) offsets [0, l0, l0 + l1, ...] as int32."""
    return torch.cat([lens.new_zeros(1), torch.cumsum(lens, 0)]).to(torch.int32)


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    device = torch.device(device)
    if t.device == device:
        return t
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def window_start(num_computed: torch.Tensor, window: int | None) -> torch.Tensor:
    """First cache position any query of the chunk can see: a query at p sees keys > p − W, and
    the chunk's first query sits at p = num_computed."""
    if window is None:
        return torch.zeros_like(num_computed)
    return (num_computed - window + 1).clamp_min(0)


@dataclass
class KVGather:
    """Layout of packed ``[cached prefix ‖ this step's chunk]`` K/V for one varlen call.

    Request r owns rows ``cu_seqlens_k[r]:cu_seqlens_k[r+1]`` of the packed K/V: its prefix keys
    (cache positions ``[start_r, num_computed_r)``) followed by its chunk. ``prefix_dst`` /
    ``chunk_dst`` are the destination rows; ``prefix_req`` / ``prefix_pos`` the request (row of
    the block table passed to :func:`plan_kv_gather`) and cache position of each prefix key, and
    ``prefix_slots`` its cache slot.
    """
    cu_seqlens_k: torch.Tensor       # (R + 1,) int32
    max_seqlen_k: int
    total_k: int
    prefix_dst: torch.Tensor         # (P,) int64
    prefix_req: torch.Tensor         # (P,) int64
    prefix_pos: torch.Tensor         # (P,) int64
    prefix_slots: torch.Tensor | None  # (P,) int64, when planned with a block table
    chunk_dst: torch.Tensor          # (sum of q_lens,) int64
    prefix_lens_cpu: torch.Tensor    # (R,) int64
    prefix_start_cpu: torch.Tensor   # (R,) int64


def plan_kv_gather(q_lens: torch.Tensor, prefix_start: torch.Tensor, prefix_end: torch.Tensor,
                   device: torch.device, block_table: torch.Tensor | None = None,
                   block_size: int = 0) -> KVGather:
    """Plan the packed K/V of R requests from CPU int64 ``q_lens``, ``prefix_start`` and
    ``prefix_end``; with ``block_table`` (R, max_blocks) also the prefix keys' cache slots."""
    prefix_lens = prefix_end - prefix_start
    k_lens = prefix_lens + q_lens
    cu_k = cumsum0(k_lens)
    req, off = segment_arange(prefix_lens)
    prefix_pos = prefix_start[req] + off
    prefix_dst = cu_k[:-1].long()[req] + off
    chunk_req, chunk_off = segment_arange(q_lens)
    chunk_dst = cu_k[:-1].long()[chunk_req] + prefix_lens[chunk_req] + chunk_off

    req_d, pos_d = to_device(req, device), to_device(prefix_pos, device)
    slots = None
    if block_table is not None:
        slots = block_table[req_d, pos_d // block_size].long() * block_size + pos_d % block_size
    return KVGather(
        cu_seqlens_k=to_device(cu_k, device), max_seqlen_k=int(k_lens.max()) if len(k_lens) else 0,
        total_k=int(k_lens.sum()), prefix_dst=to_device(prefix_dst, device), prefix_req=req_d,
        prefix_pos=pos_d, prefix_slots=slots, chunk_dst=to_device(chunk_dst, device),
        prefix_lens_cpu=prefix_lens, prefix_start_cpu=prefix_start)


def pack_kv(gather: KVGather, prefix: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
    """Packed (total_k, H, D) K or V: ``prefix`` (P, H, D) rows and ``chunk`` rows in place."""
    out = chunk.new_empty((gather.total_k, *chunk.shape[1:]))
    out.index_copy_(0, gather.prefix_dst, prefix.to(chunk.dtype))
    out.index_copy_(0, gather.chunk_dst, chunk)
    return out
