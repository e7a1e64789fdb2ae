"""A growing compressed K/V store for a (batch, KV head) grid, in the engine's paged layout.

One uint8 pool ``(blocks, Hk, block_size * slot_bytes)`` as :func:`tqattn.quant.paged.kv_cache_shape`
lays it out, so ``tqattn.kernels.store_kv`` / ``dequant_kv`` run on it (Triton on CUDA, the
reference elsewhere). Block ``c * B + b`` holds tokens ``[c * bs, (c + 1) * bs)`` of batch row b:
every row has the same length (a transformers cache is rectangular; padding is masked, not
skipped), and the batch dimension is the pool's second-slowest axis, so a beam reorder moves
whole pages and never re-quantizes.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..quant.codec import TQCodec
from ..quant.paged import kv_cache_shape

BLOCK_SIZE = 16      # the kernels' smallest block size
GROWTH = 1.25        # pool capacity grows geometrically (amortized copies, <= 25 % slack)


def _normal_tensors():
    # the pool is written in place: one made under torch.inference_mode() could not be written
    # once the model runs outside it (a prefix filled under inference mode, then generate())
    return torch.inference_mode(False)


class CompressedKV:
    """Tokens ``[start, end)`` of every batch row, compressed; local token indices."""

    def __init__(self, codec: TQCodec, batch_size: int, num_kv_heads: int, device):
        self.codec = codec
        self.batch_size = batch_size
        self.num_kv_heads = num_kv_heads
        self.device = torch.device(device)
        self.start = 0   # first live token (sliding windows drop from the front)
        self.end = 0
        with _normal_tensors():
            self.pool = torch.zeros(kv_cache_shape(0, BLOCK_SIZE, num_kv_heads, codec),
                                    dtype=torch.uint8, device=self.device)

    def __len__(self) -> int:
        return self.end - self.start

    # ---- bytes ----------------------------------------------------------------------------------

    @property
    def slot_bytes(self) -> int:
        return self.codec.slot_bytes

    def stored_bytes(self) -> int:
        """Bytes of the live tokens' slots: len × batch × KV heads × slot bytes."""
        return len(self) * self.batch_size * self.num_kv_heads * self.slot_bytes

    def allocated_bytes(self) -> int:
        return self.pool.numel()

    # ---- writes ---------------------------------------------------------------------------------

    def _chunks(self) -> int:
        return self.pool.shape[0] // self.batch_size

    def _reserve(self, end: int) -> None:
        need = -(-end // BLOCK_SIZE)
        have = self._chunks()
        if need <= have:
            return
        new = max(need, int(have * GROWTH) + 1)
        with _normal_tensors():
            grown = torch.zeros((new * self.batch_size, *self.pool.shape[1:]), dtype=torch.uint8,
                                device=self.device)
            grown[:self.pool.shape[0]] = self.pool
        self.pool = grown

    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """key, value (B, Hk, T, D) → compressed at tokens [end, end + T)."""
        b, hk, t, _ = key.shape
        if t == 0:
            return
        self._reserve(self.end + t)
        tok = torch.arange(self.end, self.end + t, device=self.device)
        rows = torch.arange(b, device=self.device)
        block = (tok // BLOCK_SIZE)[None, :] * b + rows[:, None]              # (B, T)
        slots = (block * BLOCK_SIZE + (tok % BLOCK_SIZE)[None, :]).flatten()
        kernels.store_kv(self.codec, key.transpose(1, 2).reshape(b * t, hk, -1),
                         value.transpose(1, 2).reshape(b * t, hk, -1), self.pool, slots)
        self.end += t

    # ---- reads ----------------------------------------------------------------------------------

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The live tokens dequantized: K, V (B, Hk, len, D) of ``dtype``."""
        b, hk, d = self.batch_size, self.num_kv_heads, self.codec.head_dim
        if len(self) == 0:
            empty = torch.zeros(b, hk, 0, d, dtype=dtype, device=self.device)
            return empty, empty.clone()
        c0 = self.start // BLOCK_SIZE
        n = self.end - c0 * BLOCK_SIZE
        nblk = -(-n // BLOCK_SIZE)
        cols = torch.arange(c0, c0 + nblk, device=self.device)
        block_table = (cols[None, :] * b + torch.arange(b, device=self.device)[:, None]).to(torch.int32)
        seq_lens = torch.full((b,), n, dtype=torch.int32, device=self.device)
        cu = torch.arange(0, (b + 1) * n, n, dtype=torch.int32, device=self.device)
        k, v = kernels.dequant_kv(self.codec, self.pool, block_table, seq_lens, cu_seqlens=cu,
                                  max_seq_len=n, dtype=dtype)
        skip = self.start - c0 * BLOCK_SIZE

        def shape(x):
            return x.view(b, n, hk, d)[:, skip:].transpose(1, 2)

        return shape(k), shape(v)

    # ---- edits ----------------------------------------------------------------------------------

    def drop_front(self, m: int) -> None:
        """Forget the oldest m live tokens; whole chunks no row needs are freed."""
        self.start += min(m, len(self))
        dead = self.start // BLOCK_SIZE
        if dead:
            with _normal_tensors():
                self.pool = self.pool[dead * self.batch_size:].clone()
            self.start -= dead * BLOCK_SIZE
            self.end -= dead * BLOCK_SIZE

    def drop_back(self, m: int) -> None:
        """Forget the newest m live tokens (their bytes are overwritten by later appends)."""
        self.end -= min(m, len(self))

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (any length, repeats allowed): beam reorder, expansion."""
        index = index.to(self.device)
        c = self._chunks()
        pages = self.pool.view(c, self.batch_size, *self.pool.shape[1:])
        with _normal_tensors():
            self.pool = pages.index_select(1, index).flatten(0, 1)
        self.batch_size = index.numel()
