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

A step is filled in two halves: :meth:`InputBatch.fill` (or ``fill_decode``) writes the host
buffers and returns them as a :class:`StepHost`; :meth:`InputBatch.upload` (or ``to_static``)
moves them to the device. With tensor parallelism rank 0 fills, sends the StepHost to the other
ranks, and each of them :meth:`InputBatch.load` loads it into its own buffers before uploading.
"""

from __future__ import annotations

import dataclasses
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
class StepHost:
    """One step's inputs as host arrays: what rank 0 fills and every rank uploads.

    A CUDA-graph decode step (``bucket`` set) is padded to the bucket: seq_lens, num_computed_tokens,
    the block tables and the slot mappings have ``bucket`` rows; input_ids and positions have
    ``num_reqs``; query_start_loc is empty (the graph's is static)."""
    input_ids: np.ndarray  # (T,) int64
    positions: np.ndarray  # (T,) int64
    query_start_loc: np.ndarray  # (B+1,) int32
    seq_lens: np.ndarray  # (B,) int32
    num_computed_tokens: np.ndarray  # (B,) int32
    block_tables: list[np.ndarray]  # per group (B, max_blocks) int32
    slot_mappings: list[np.ndarray]  # per group (T,) int64
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    num_decodes: int
    sample_idx: list[int]
    bucket: int | None = None


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
        return self.upload(self.fill(scheduled))

    def fill(self, scheduled) -> StepHost:
        """Write a step's inputs (decodes first, then prefill chunks) into the host buffers."""
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
            block_tables.append(table.np[:n * width].reshape(n, width))
            self._gather(g, rows, width, block_tables[-1])
            slots.np[:num_tokens] = (self.rows[g][token_rows, positions // bs].astype(np.int64) * bs
                                     + positions % bs)
            slot_mappings.append(slots.np[:num_tokens])
        return StepHost(
            input_ids=self.input_ids.np[:num_tokens], positions=self.positions.np[:num_tokens],
            query_start_loc=self.query_start_loc.np[:n + 1], seq_lens=self.seq_lens.np[:n],
            num_computed_tokens=self.num_computed.np[:n], block_tables=block_tables,
            slot_mappings=slot_mappings, num_reqs=n, max_query_len=int(q_lens.max()),
            max_seq_len=max_seq_len, num_decodes=num_decodes,
            sample_idx=[int(qsl[i + 1]) - 1 for i, s in enumerate(scheduled) if s.samples])

    def upload(self, h: StepHost) -> StepInputs:
        """A filled (or loaded) step's buffers on the device."""
        n, num_tokens = h.num_reqs, len(h.input_ids)
        out = StepInputs(
            input_ids=self.input_ids.to_device(num_tokens), positions=self.positions.to_device(num_tokens),
            query_start_loc=self.query_start_loc.to_device(n + 1), seq_lens=self.seq_lens.to_device(n),
            num_computed_tokens=self.num_computed.to_device(n),
            block_tables=[self.block_table[g].to_device(t.size, t.shape) for g, t in enumerate(h.block_tables)],
            slot_mappings=[self.slot_mapping[g].to_device(num_tokens) for g in range(self.num_groups)],
            query_start_loc_cpu=self.query_start_loc.cpu(n + 1), seq_lens_cpu=self.seq_lens.cpu(n),
            num_computed_tokens_cpu=self.num_computed.cpu(n), num_reqs=n, num_tokens=num_tokens,
            max_query_len=h.max_query_len, max_seq_len=h.max_seq_len, num_decodes=h.num_decodes,
            sample_idx=h.sample_idx)
        self.copies_issued()
        return out

    def load(self, h: StepHost) -> StepHost:
        """A step another rank filled, written into this batch's host buffers (returned as views
        of them, ready for upload / to_static)."""
        self._wait_for_copies()

        def put(buf: _Buffer, a: np.ndarray) -> np.ndarray:
            buf.reserve(max(a.size, 1))
            view = buf.np[:a.size].reshape(a.shape)
            view[...] = a
            return view

        return dataclasses.replace(
            h, input_ids=put(self.input_ids, h.input_ids), positions=put(self.positions, h.positions),
            query_start_loc=put(self.query_start_loc, h.query_start_loc),
            seq_lens=put(self.seq_lens, h.seq_lens), num_computed_tokens=put(self.num_computed, h.num_computed_tokens),
            block_tables=[put(self.block_table[g], t) for g, t in enumerate(h.block_tables)],
            slot_mappings=[put(self.slot_mapping[g], t) for g, t in enumerate(h.slot_mappings)])

    def _gather(self, g: int, rows: np.ndarray, width: int, out: np.ndarray) -> None:
        have = min(width, self.rows[g].shape[1])
        np.take(self.rows[g][:, :have], rows, axis=0, out=out[:, :have])
        out[:, have:] = 0

    def fill_decode(self, scheduled, bucket: int) -> StepHost:
        """A pure-decode step's host buffers, padded to bucket (padding rows: seq_len 0, block
        ids 0, slot -1), for :meth:`to_static` into a CUDA graph's static buffers."""
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
        tables, slot_mappings = [], []
        for g in range(self.num_groups):
            table, slots = self.block_table[g], self.slot_mapping[g]
            table.reserve(bucket * width)
            slots.reserve(bucket)
            t = table.np[:bucket * width].reshape(bucket, width)
            self._gather(g, rows, width, t[:n])
            t[n:] = 0
            slots.np[:n] = self.rows[g][rows, pos // bs].astype(np.int64) * bs + pos % bs
            slots.np[n:bucket] = -1
            tables.append(t)
            slot_mappings.append(slots.np[:bucket])
        return StepHost(
            input_ids=self.input_ids.np[:n], positions=self.positions.np[:n],
            query_start_loc=np.zeros(0, dtype=np.int32), seq_lens=self.seq_lens.np[:bucket],
            num_computed_tokens=self.num_computed.np[:bucket], block_tables=tables,
            slot_mappings=slot_mappings, num_reqs=n, max_query_len=1, max_seq_len=int(pos.max()) + 1,
            num_decodes=n, sample_idx=list(range(n)), bucket=bucket)

    def to_static(self, h: StepHost, static: dict) -> None:
        """A filled (or loaded) decode step's buffers into the CUDA graph's static inputs."""
        n, bucket = h.num_reqs, h.bucket
        for name, b, size in (("input_ids", self.input_ids, n), ("positions", self.positions, n),
                              ("seq_lens", self.seq_lens, bucket), ("num_computed_tokens", self.num_computed, bucket)):
            static[name][:size].copy_(b.cpu(size), non_blocking=True)
        for g, t in enumerate(h.block_tables):
            width = t.shape[1]
            static["block_tables"][g][:bucket, :width].copy_(self.block_table[g].cpu(bucket * width).view(bucket, width),
                                                            non_blocking=True)
            static["slot_mappings"][g][:bucket].copy_(self.slot_mapping[g].cpu(bucket), non_blocking=True)
        self.copies_issued()
