"""Query rotation for the tensor-core decode kernel (Triton): ``q·R`` with R's columns in the
kernel's operand order, times the softmax scale (log2 units), as fp16.

PyTorch twin: :func:`rotate_query_ref`. One small launch per decode step instead of torch's
fp32 cast + GEMM (two kernels); rotating inside the decode kernel instead would repeat it for
every split of a sequence. :func:`rotate_block` is also run by the store kernel's query
programs (kernels/store.py: ``store_kv_and_rotate_query``), which saves this launch when the
step's new K/V are stored together with the decode.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


BLOCK, BLOCK_C = 16, 32  # rows, output columns per program: short chains, many programs
# from this many rows on, 64-row blocks (4 warps): at 4096 rows (B = 128, 32 heads) 1024
# programs of 16 rows kept the decode waiting (decode step 181.8 → 175.8 µs at B = 128, 4K;
# neutral at 256 and 1024 rows: bench/results/decode_tune_s8_packed_h200_prelim.md)
LARGE_ROWS, LARGE_BLOCK = 1024, 64
# inside the store's launch (store_kv_and_rotate_query) the programs take the store's warps and
# registers (one 8-warp program per SM): fewer, larger query blocks there
FUSED_BLOCK = 64


@triton.jit
def rotate_block(q_ptr, n_rows, r_ptr, out_ptr, scale, pid, D: tl.constexpr,
                 BLOCK: tl.constexpr, BLOCK_C: tl.constexpr):
    """Block pid (row-block major) of out = fp16((q·r)·scale)."""
    rows = (pid // (D // BLOCK_C)) * BLOCK + tl.arange(0, BLOCK)
    cols = (pid % (D // BLOCK_C)) * BLOCK_C + tl.arange(0, BLOCK_C)
    d = tl.arange(0, D)
    ok = (rows < n_rows)[:, None]
    q = tl.load(q_ptr + rows[:, None] * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + d[:, None] * D + cols[None, :])
    o = tl.dot(q, r, input_precision="tf32x3") * scale   # fp32-accurate on tensor cores
    tl.store(out_ptr + rows[:, None] * D + cols[None, :], o.to(tl.float16), mask=ok)


@triton.jit
def _rotate_query_kernel(q_ptr, n_rows, r_ptr, out_ptr, scale, D: tl.constexpr,
                         BLOCK: tl.constexpr, BLOCK_C: tl.constexpr,
                         LAUNCH_DEPENDENTS: tl.constexpr):
    if LAUNCH_DEPENDENTS:  # a programmatic dependent (the decode kernel) may start now
        tl.extra.cuda.gdc_launch_dependents()
    rotate_block(q_ptr, n_rows, r_ptr, out_ptr, scale, tl.program_id(0), D, BLOCK, BLOCK_C)


def rotate_query_ref(q: torch.Tensor, r: torch.Tensor, scale: float) -> torch.Tensor:
    """(rows, heads, D) → fp16 ``(q·r)·scale`` (r: D × D fp32, columns already permuted)."""
    return ((q.float() @ r) * scale).to(torch.float16)


def num_blocks(rows: int, d: int, block: int = BLOCK) -> int:
    return triton.cdiv(rows, block) * (d // BLOCK_C)


def check_and_alloc(q: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q as contiguous (rows, D), fp16 output (rows, D)) after checking shapes (r must be
    row-major: the kernel reads it with row stride D)."""
    d = q.shape[-1]
    if r.shape != (d, d) or r.dtype != torch.float32:
        raise ValueError(f"rotation must be ({d}, {d}) float32, got {tuple(r.shape)} {r.dtype}")
    if not r.is_contiguous():
        raise ValueError(f"rotation must be contiguous (row-major), strides {r.stride()}")
    if d % BLOCK_C or d & (d - 1):
        raise ValueError(f"head size {d}: the rotation kernel needs a power of two >= {BLOCK_C}")
    q2 = q.reshape(-1, d).contiguous()
    return q2, torch.empty(q2.shape, dtype=torch.float16, device=q.device)


def rotate_query(q: torch.Tensor, r: torch.Tensor, scale: float,
                 launch_dependents: bool = False, block: int | None = None) -> torch.Tensor:
    """launch_dependents (sm_90+): let a kernel launched after this one with programmatic
    dependent launch start before this one ends (it waits for this output itself). block: rows
    per program (default: BLOCK, LARGE_BLOCK from LARGE_ROWS rows on)."""
    q2, out = check_and_alloc(q, r)
    block = block or (LARGE_BLOCK if q2.shape[0] >= LARGE_ROWS else BLOCK)
    if block not in (16, 32, 64):
        raise ValueError(f"block={block}: the rotation kernel takes 16, 32 or 64 rows")
    _rotate_query_kernel[(num_blocks(q2.shape[0], q.shape[-1], block),)](
        q2, q2.shape[0], r, out, float(scale), D=q.shape[-1], BLOCK=block, BLOCK_C=BLOCK_C,
        LAUNCH_DEPENDENTS=launch_dependents, num_warps=2 if block == 16 else 4)
    return out.view(q.shape)
