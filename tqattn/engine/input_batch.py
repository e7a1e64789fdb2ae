"""Persistent host buffers for a step's inputs (vLLM's InputBatch idea).

The model runner turns a scheduled step into flat arrays — token ids, positions,
``query_start_loc``, ``seq_lens``, ``num_computed_tokens``, and per KV-cache group a block table
and a slot mapping. Building them from small per-sequence tensors costs more host time than a
decode step's GPU work at a few hundred sequences, so here they live in buffers allocated once
(pinned on CUDA, written through numpy views) and each step moves every buffer to the device in
one non-blocking copy.

Block tables are kept per sequence in a persistent row: a sequence's row keeps its block ids
between steps and only newly allocated ids are written; the step's table is a gather of its rows.
A row is rebuilt from scratch when its sequence was preempted (``num_preemptions`` changed), got
a new block-table list, or holds fewer blocks than were written; rows of sequences that no longer
run are reassigned when rows run out. The contract with the block manager: while a sequence runs
its block tables only grow.

A pinned buffer must not be rewritten while the previous step's copy from it may still be in
flight (a step that samples nothing never syncs with the device): an event recorded after the
copies is waited on before the next write.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .sequence import SequenceStatus


def _capacity(n: int) -> int:
    """Room for n, rounded up to a power of two so that growing buffers are reallocated rarely."""
    return max(16, 1 << (n - 1).bit_length())


class _Buffer:
    """A flat host buffer (pinned on CUDA) with its numpy view and, off the CPU, a device twin."""

    def __init__(self, dtype: torch.dtype, device: torch.device):
        self.dtype, self.device = dtype, device
        self.size = 0
        self.host = self.np = self.dev = None

    def reserve(self, n: int) -> None:
        if n <= self.size:
            return
        self.size = _capacity(n)
        pin = self.device.type == "cuda"
        self.host = torch.empty(self.size, dtype=self.dtype, pin_memory=pin)
        self.np = self.host.numpy()
        self.dev = self.host if self.device.type == "cpu" else torch.empty(self.size, dtype=self.dtype, device=self.device)

    def to_device(self, n: int, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The first n elements on the device (one non-blocking copy), viewed as shape."""
        dev = self.dev[:n]
        if dev.data_ptr() != self.host.data_ptr():
            dev.copy_(self.host[:n], non_blocking=True)
        return dev.view(shape) if shape is not None else dev

    def cpu(self, n: int) -> torch.Tensor:
        return self.host[:n]


@dataclass
class StepInputs:
    """One step's inputs: device tensors (views of persistent buffers, valid for this step)."""
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    query_start_loc: torch.Tensor  # (B+1,) int32
    seq_lens: torch.Tensor  # (B,) int32
    num_computed_tokens: torch.Tensor  # (B,) int32
    block_tables: list[torch.Tensor]  # per group (B, max_blocks) int32
    slot_mappings: list[torch.Tensor]  # per group (T,) int64
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    num_computed_tokens_cpu: torch.Tensor
    num_reqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    num_decodes: int  # leading one-token chunks
    sample_idx: list[int]  # flattened token index of each chunk that reaches its sequence's end


class InputBatch:
    def __init__(self, num_groups: int, block_size: int, device: torch.device):
        self.num_groups = num_groups
        self.block_size = block_size
        self.device = device
        buf = lambda dtype: _Buffer(dtype, device)  # noqa: E731
        self.input_ids, self.positions = buf(torch.int64), buf(torch.int64)
        self.query_start_loc, self.seq_lens, self.num_computed = buf(torch.int32), buf(torch.int32), buf(torch.int32)
        self.block_table = [buf(torch.int32) for _ in range(num_groups)]  # the step's gathered rows
        self.slot_mapping = [buf(torch.int64) for _ in range(num_groups)]
        # Persistent rows: rows[g][r, :written[r]] are the first block ids of owner[r] in group g.
        self.rows = [np.zeros((0, 0), dtype=np.int32) for _ in range(num_groups)]
        self.owner: list = []
        self.owner_key: list = []  # (num_preemptions, the group-0 block table list) the row was written from
        self.written = np.zeros(0, dtype=np.int64)
        self.row_of: dict[int, int] = {}  # id(seq) -> row
        self.free_rows: list[int] = []
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._pending = False

    # ---- persistent block-table rows -------------------------------------------------------------

    def _grow_rows(self, num_rows: int, width: int) -> None:
        old_rows, old_width = self.rows[0].shape
        num_rows, width = max(num_rows, old_rows), max(width, old_width)
        if (num_rows, width) == (old_rows, old_width):
            return
        if num_rows > old_rows:
            num_rows = max(num_rows, 2 * old_rows, 16)
        if width > old_width:
            width = max(width, 2 * old_width, 16)
        for g in range(self.num_groups):
            rows = np.zeros((num_rows, width), dtype=np.int32)
            rows[:old_rows, :old_width] = self.rows[g]
            self.rows[g] = rows
        self.written = np.concatenate([self.written, np.zeros(num_rows - old_rows, dtype=np.int64)])
        self.owner += [None] * (num_rows - old_rows)
        self.owner_key += [None] * (num_rows - old_rows)
        self.free_rows += range(num_rows - 1, old_rows - 1, -1)

    def _take_row(self, seq, scheduled) -> int:
        if not self.free_rows:  # reassign rows whose sequence no longer runs
            in_step = {id(s.seq) for s in scheduled}
            for key, r in list(self.row_of.items()):
                if key not in in_step and self.owner[r].status is not SequenceStatus.RUNNING:
                    self._release(key)
        if not self.free_rows:
            self._grow_rows(len(self.owner) + 1, 0)
        r = self.free_rows.pop()
        self.owner[r] = seq
        self.row_of[id(seq)] = r
        return r

    def _release(self, key: int) -> None:
        r = self.row_of.pop(key)
        self.owner[r] = self.owner_key[r] = None
        self.free_rows.append(r)

    def _sync_row(self, seq, scheduled) -> int:
        """seq's row, with every block id of its tables written."""
        r = self.row_of.get(id(seq))
        if r is None:
            r = self._take_row(seq, scheduled)
        tables = seq.block_tables
        n, done, key = len(tables[0]), self.written[r], self.owner_key[r]
        # New, preempted, or not the tables it had (the list itself is kept: its id stays unique).
        if key is None or key[0] != seq.num_preemptions or key[1] is not tables[0] or n < done:
            self.owner_key[r], done = (seq.num_preemptions, tables[0]), 0
            self.written[r] = 0
            for rows in self.rows:
                rows[r] = 0
        if n > done:
            if n > self.rows[0].shape[1]:
                self._grow_rows(0, n)
            for rows, table in zip(self.rows, tables):
                rows[r, done:n] = table[done:n]
            self.written[r] = n
        return r

    def rows_for(self, scheduled) -> np.ndarray:
        """The row of each scheduled sequence, brought up to date."""
        return np.fromiter((self._sync_row(s.seq, scheduled) for s in scheduled), np.int64, len(scheduled))

    # ---- one step --------------------------------------------------------------------------------

    def _wait_for_copies(self) -> None:
        if self._pending:
            self._copied.synchronize()
            self._pending = False

    def copies_issued(self) -> None:
        """Mark the buffers as in flight until the device has run what is queued now; call it
        again after anything else (a metadata builder) copied from the host buffers."""
        if self._copied is not None:
            self._copied.record()
            self._pending = True

    def prepare(self, scheduled) -> StepInputs:
        """Fill the buffers for a step (decodes first, then prefill chunks) and move them to the device."""
        self._wait_for_copies()
        bs, n = self.block_size, len(scheduled)
        rows = self.rows_for(scheduled)
        q_lens = np.fromiter((s.num_scheduled_tokens for s in scheduled), np.int64, n)
        computed = np.fromiter((s.num_computed_tokens for s in scheduled), np.int64, n)
        seq_lens = computed + q_lens
        qsl = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        num_tokens = int(qsl[-1])
        max_seq_len = int(seq_lens.max())
        width = -(-max_seq_len // bs)
        longer = np.flatnonzero(q_lens != 1)
        num_decodes = int(longer[0]) if len(longer) else n

        for b, size in ((self.input_ids, num_tokens), (self.positions, num_tokens), (self.query_start_loc, n + 1),
                        (self.seq_lens, n), (self.num_computed, n)):
            b.reserve(size)
        if num_decodes == n:
            self.input_ids.np[:n] = [s.seq.token_ids[s.num_computed_tokens] for s in scheduled]
            positions = computed
            token_rows = rows
        else:
            ids = []
            for s in scheduled:
                c = s.num_computed_tokens
                ids += s.seq.token_ids[c:c + s.num_scheduled_tokens]
            self.input_ids.np[:num_tokens] = ids
            positions = np.arange(num_tokens) - np.repeat(qsl[:-1] - computed, q_lens)
            token_rows = np.repeat(rows, q_lens)
        self.positions.np[:num_tokens] = positions
        self.query_start_loc.np[:n + 1] = qsl
        self.seq_lens.np[:n] = seq_lens
        self.num_computed.np[:n] = computed
        block_tables, slot_mappings = [], []
        for g in range(self.num_groups):
            table, slots = self.block_table[g], self.slot_mapping[g]
            table.reserve(n * width)
            slots.reserve(num_tokens)
            self._gather(g, rows, width, table.np[:n * width].reshape(n, width))
            slots.np[:num_tokens] = (self.rows[g][token_rows, positions // bs].astype(np.int64) * bs
                                     + positions % bs)
            block_tables.append(table.to_device(n * width, (n, width)))
            slot_mappings.append(slots.to_device(num_tokens))
        out = StepInputs(
            input_ids=self.input_ids.to_device(num_tokens), positions=self.positions.to_device(num_tokens),
            query_start_loc=self.query_start_loc.to_device(n + 1), seq_lens=self.seq_lens.to_device(n),
            num_computed_tokens=self.num_computed.to_device(n), block_tables=block_tables,
            slot_mappings=slot_mappings, query_start_loc_cpu=self.query_start_loc.cpu(n + 1),
            seq_lens_cpu=self.seq_lens.cpu(n), num_computed_tokens_cpu=self.num_computed.cpu(n),
            num_reqs=n, num_tokens=num_tokens, max_query_len=int(q_lens.max()), max_seq_len=max_seq_len,
            num_decodes=num_decodes,
            sample_idx=[int(qsl[i + 1]) - 1 for i, s in enumerate(scheduled) if s.samples])
        self.copies_issued()
        return out

    def _gather(self, g: int, rows: np.ndarray, width: int, out: np.ndarray) -> None:
        have = min(width, self.rows[g].shape[1])
        np.take(self.rows[g][:, :have], rows, axis=0, out=out[:, :have])
        out[:, have:] = 0

    def prepare_decode(self, scheduled, bucket: int, static: dict) -> None:
        """Write a pure-decode step straight into a CUDA graph's static buffers, padded to bucket
        (padding rows: seq_len 0, block ids 0, slot -1)."""
        self._wait_for_copies()
        bs, n = self.block_size, len(scheduled)
        rows = self.rows_for(scheduled)
        for b in (self.input_ids, self.positions, self.seq_lens, self.num_computed):
            b.reserve(bucket)
        pos = np.fromiter((s.num_computed_tokens for s in scheduled), np.int64, n)
        self.input_ids.np[:n] = [s.seq.token_ids[s.num_computed_tokens] for s in scheduled]
        self.positions.np[:n] = pos
        self.seq_lens.np[:n] = pos + 1
        self.seq_lens.np[n:bucket] = 0
        self.num_computed.np[:n] = pos
        self.num_computed.np[n:bucket] = 0
        width = int(self.written[rows].max())
        for name, b, size in (("input_ids", self.input_ids, n), ("positions", self.positions, n),
                              ("seq_lens", self.seq_lens, bucket), ("num_computed_tokens", self.num_computed, bucket)):
            static[name][:size].copy_(b.cpu(size), non_blocking=True)
        for g in range(self.num_groups):
            table, slots = self.block_table[g], self.slot_mapping[g]
            table.reserve(bucket * width)
            slots.reserve(bucket)
            t = table.np[:bucket * width].reshape(bucket, width)
            self._gather(g, rows, width, t[:n])
            t[n:] = 0
            slots.np[:n] = self.rows[g][rows, pos // bs].astype(np.int64) * bs + pos % bs
            slots.np[n:bucket] = -1
            static["block_tables"][g][:bucket, :width].copy_(table.cpu(bucket * width).view(bucket, width),
                                                            non_blocking=True)
            static["slot_mappings"][g][:bucket].copy_(slots.cpu(bucket), non_blocking=True)
        self.copies_issued()
