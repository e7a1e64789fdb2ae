"""Query rotation for the tensor-core decode kernel (Triton): ``q·R`` with R's columns in the
kernel's operand order, times the softmax scale (log2 units), as fp16.

PyTorch twin: :func:`rotate_query_ref`. One small launch per decode step instead of torch's
fp32 cast + GEMM (two kernels); rotating inside the decode kernel instead would repeat it for
every split of a sequence.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_query_kernel(q_ptr, n_rows, r_ptr, out_ptr, scale, D: tl.constexpr,
                         BLOCK: tl.constexpr, BLOCK_C: tl.constexpr):
    # one program per (16 rows, 32 output columns): short dependency chains, many programs
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    d = tl.arange(0, D)
    ok = (rows < n_rows)[:, None]
    q = tl.load(q_ptr + rows[:, None] * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + d[:, None] * D + cols[None, :])
    o = tl.dot(q, r, input_precision="tf32x3") * scale   # fp32-accurate on tensor cores
    tl.store(out_ptr + rows[:, None] * D + cols[None, :], o.to(tl.float16), mask=ok)


def rotate_query_ref(q: torch.Tensor, r: torch.Tensor, scale: float) -> torch.Tensor:
    """(rows, heads, D) → fp16 ``(q·r)·scale`` (r: D × D fp32, columns already permuted)."""
    return ((q.float() @ r) * scale).to(torch.float16)


def rotate_query(q: torch.Tensor, r: torch.Tensor, scale: float) -> torch.Tensor:
    d = q.shape[-1]
    if r.shape != (d, d) or r.dtype != torch.float32:
        raise ValueError(f"rotation must be ({d}, {d}) float32, got {tuple(r.shape)} {r.dtype}")
    q2 = q.reshape(-1, d).contiguous()
    out = torch.empty(q2.shape, dtype=torch.float16, device=q.device)
    block, block_c = 16, min(32, d)
    if d % block_c or d & (d - 1):
        raise ValueError(f"head size {d}: the rotation kernel needs a power of two >= 16")
    grid = (triton.cdiv(q2.shape[0], block), d // block_c)
    _rotate_query_kernel[grid](q2, q2.shape[0], r, out, float(scale), D=d, BLOCK=block,
                               BLOCK_C=block_c, num_warps=2)
    return out.view(q.shape)
