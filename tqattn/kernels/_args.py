"""Argument checks of the kernel entry points: dtypes and shapes only, never a value read from
the device (that would be a host sync, and the kernels run under CUDA graphs). Values (slot
numbers, sequence lengths against the block table) are trusted, as in vLLM's kernels."""

from __future__ import annotations

import torch

from ..quant.codec import FLOAT_DTYPES

INDEX_DTYPES = (torch.int32, torch.int64)


def check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16/bfloat16/float32, got {t.dtype}")


def check_index(name: str, t: torch.Tensor, *, dim: int = 1, min_len: int | None = None,
                length: int | None = None) -> None:
    """An int32/int64 tensor of ``dim`` dimensions whose first has ``length`` entries (or at
    least ``min_len``)."""
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimension(s), got shape {tuple(t.shape)}")
    n = t.shape[0]
    if length is not None and n != length:
        raise ValueError(f"{name} has {n} entries, expected {length}")
    if min_len is not None and n < min_len:
        raise ValueError(f"{name} has {n} entries, fewer than the {min_len} needed")


def check_decode_args(rows: int, block_table: torch.Tensor, seq_lens: torch.Tensor,
                      query_start_loc: torch.Tensor | None, window: int | None) -> None:
    """The batch of a decode call: B sequences (seq_lens), a block-table row each, and without
    ``query_start_loc`` one query row each (with it, B + 1 row offsets)."""
    check_index("seq_lens", seq_lens)
    batch = seq_lens.shape[0]
    check_index("block_table", block_table, dim=2, min_len=batch)
    if query_start_loc is None:
        if rows != batch:
            raise ValueError(f"q has {rows} rows but there are {batch} sequences (pass "
                             f"query_start_loc for several rows a sequence)")
    else:
        check_index("query_start_loc", query_start_loc, length=batch + 1)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise ValueError(f"window must be None or an int >= 0 (0: no window), got {window!r}")
