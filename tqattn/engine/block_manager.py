"""Paged KV-cache block allocation with prefix caching, for one or more KV-cache groups.

Layers with different cache specs (e.g. TurboQuant layers and full-precision layers) live in
separate groups, each with its own pool of blocks (pools differ in size because bytes per block
differ). A sequence holds the same number of blocks in every group: groups share the block size and
are allocated, freed and prefix-cached in lockstep.

Each pool keeps a free queue ordered by eviction priority (front = evicted first). A freed block
that holds a registered prefix (has a hash) keeps it while it waits in the queue and is revived by
a prefix hit; it loses the hash only when it is taken for new data.
"""

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence as Seq

from .sequence import Sequence


def hash_block(parent: bytes | None, token_ids: Seq[int], extra_key: Hashable = None) -> bytes:
    """Hash of a full block given its parent block's hash: it names the whole prefix.

    A cryptographic digest rather than hash(): a collision would silently reuse another
    prompt's K/V.
    """
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", token_ids).tobytes())
    if extra_key is not None:
        h.update(repr(extra_key).encode())
    return h.digest()


def slot_for(block_table: Seq[int], pos: int, block_size: int) -> int:
    """Cache slot of token position `pos`: block_id * block_size + offset."""
    return block_table[pos // block_size] * block_size + pos % block_size


class _Pool:
    """The blocks of one KV-cache group."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.hash: list[bytes | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}  # prefix hash -> block id

    def take_free(self) -> int:
        bid, _ = self.free.popitem(last=False)
        if self.hash[bid] is not None:  # evict its prefix
            del self.cached[self.hash[bid]]
            self.hash[bid] = None
        self.ref[bid] = 1
        return bid

    def take_cached(self, bid: int) -> None:
        if self.ref[bid] == 0:
            del self.free[bid]
        self.ref[bid] += 1

    def release(self, bid: int) -> None:
        self.ref[bid] -= 1
        if self.ref[bid] == 0:
            self.free[bid] = None
            if self.hash[bid] is None:  # holds nothing reusable: hand it out before cached blocks
                self.free.move_to_end(bid, last=False)

    def register(self, bid: int, h: bytes) -> None:
        # If another block already holds this prefix (two requests computed it at once),
        # keep that one; this block stays unregistered.
        if self.hash[bid] is None and h not in self.cached:
            self.cached[h] = bid
            self.hash[bid] = h


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int | Seq[int], block_size: int, enable_prefix_caching: bool = True):
        sizes = [num_blocks] if isinstance(num_blocks, int) else list(num_blocks)
        if not sizes or any(not isinstance(n, int) or n < 1 for n in sizes):
            raise ValueError(f"num_blocks must be a positive int or a list of them (one per KV-cache group), got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pools = [_Pool(n) for n in sizes]

    @property
    def num_groups(self) -> int:
        return len(self.pools)

    @property
    def num_blocks(self) -> list[int]:
        return [p.num_blocks for p in self.pools]

    def num_free_blocks(self, group: int = 0) -> int:
        """Blocks that can be handed out, including evictable cached ones."""
        return len(self.pools[group].free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by sequences, in the fullest group."""
        return max(1 - len(p.free) / p.num_blocks for p in self.pools)

    def _tables(self, seq: Sequence) -> list[list[int]]:
        if len(seq.block_tables) != self.num_groups:
            assert not any(seq.block_tables), "sequence holds blocks of another block manager"
            seq.block_tables = [[] for _ in self.pools]
        return seq.block_tables

    def _block_hashes(self, seq: Sequence, n: int) -> list[bytes]:
        """Hashes of the first n full blocks of seq (cached on seq: tokens are only appended)."""
        hashes, bs = seq.block_hashes, self.block_size
        for i in range(len(hashes), n):
            hashes.append(hash_block(hashes[-1] if hashes else None,
                                     seq.token_ids[i * bs:(i + 1) * bs], seq.extra_key))
        return hashes[:n]

    def get_computed_blocks(self, seq: Sequence) -> int:
        """Number of leading tokens of a not-yet-allocated seq whose K/V are in the prefix cache.

        A whole number of blocks, cached in every group, and never all of seq's tokens: the last
        one is always recomputed so the step yields its logits.
        """
        if not self.enable_prefix_caching or any(seq.block_tables):
            return 0
        n = 0
        for h in self._block_hashes(seq, (seq.num_tokens - 1) // self.block_size):
            if not all(h in p.cached for p in self.pools):
                break
            n += 1
        return n * self.block_size

    def _plan(self, seq: Sequence, num_new_tokens: int, num_cached_tokens: int):
        """(prefix-hit block ids per group, number of fresh blocks each group needs) for an allocation."""
        bs, held = self.block_size, len(seq.block_table)
        total = seq.num_computed_tokens + num_cached_tokens + num_new_tokens
        if total > seq.num_tokens:
            raise ValueError(f"cannot allocate {total} token slots for seq {seq.seq_id!r}, which has {seq.num_tokens} tokens")
        hits = [[] for _ in self.pools]
        if num_cached_tokens:
            if held or seq.num_computed_tokens or num_cached_tokens % bs:
                raise ValueError("num_cached_tokens is only for a fresh sequence and must be a multiple of block_size")
            try:
                for h in self._block_hashes(seq, num_cached_tokens // bs):
                    for g, p in enumerate(self.pools):
                        hits[g].append(p.cached[h])
            except KeyError:
                raise ValueError(f"num_cached_tokens={num_cached_tokens} is not a prefix-cache hit; use get_computed_blocks()") from None
        return hits, max(0, _cdiv(total, bs) - held - len(hits[0]))

    def _taken(self, hits, num_new_blocks) -> list[int]:
        # A hit on a block with ref 0 takes it out of the free queue too.
        return [num_new_blocks + sum(p.ref[b] == 0 for b in hit) for p, hit in zip(self.pools, hits)]

    def _fits(self, hits, num_new_blocks) -> bool:
        return all(n <= len(p.free) for p, n in zip(self.pools, self._taken(hits, num_new_blocks)))

    def can_allocate(self, seq: Sequence, num_new_tokens: int, num_cached_tokens: int = 0) -> bool:
        return self._fits(*self._plan(seq, num_new_tokens, num_cached_tokens))

    def num_blocks_to_take(self, seq: Sequence, num_new_tokens: int, num_cached_tokens: int = 0) -> list[int]:
        """Per group, how many blocks allocate_slots with these arguments would take from the free queue."""
        return self._taken(*self._plan(seq, num_new_tokens, num_cached_tokens))

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, num_cached_tokens: int = 0) -> bool:
        """Make seq's block tables cover num_computed_tokens + num_cached_tokens + num_new_tokens.

        num_cached_tokens (from get_computed_blocks) takes the prefix-hit blocks for a fresh seq;
        the caller then sets seq.num_computed_tokens to it. Returns False, changing nothing, when
        some group lacks free blocks.
        """
        total = seq.num_computed_tokens + num_new_tokens
        if (not num_cached_tokens and seq.block_tables and total <= len(seq.block_tables[0]) * self.block_size
                and total <= seq.num_tokens):  # fast path (most decodes): the tables cover it already
            return True
        hits, num_new_blocks = self._plan(seq, num_new_tokens, num_cached_tokens)
        if not self._fits(hits, num_new_blocks):
            return False
        tables = self._tables(seq)
        for p, table, hit in zip(self.pools, tables, hits):
            for b in hit:  # hits first, so taking fresh blocks cannot evict them
                p.take_cached(b)
            table.extend(hit)
            table.extend(p.take_free() for _ in range(num_new_blocks))
        if hits[0]:
            seq.num_hashed_blocks = len(hits[0])
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register seq's full blocks whose K/V are computed; call after num_computed_tokens advanced."""
        if not self.enable_prefix_caching:
            return
        start, end = seq.num_hashed_blocks, seq.num_computed_tokens // self.block_size
        if end <= start:
            return
        hashes = self._block_hashes(seq, end)
        for p, table in zip(self.pools, seq.block_tables):
            for i in range(start, end):
                p.register(table[i], hashes[i])
        seq.num_hashed_blocks = end

    def free(self, seq: Sequence) -> None:
        """Drop seq's blocks. Tail blocks are released first, so they are evicted first."""
        for p, table in zip(self.pools, seq.block_tables):
            for b in reversed(table):
                p.release(b)
            table.clear()
        seq.num_hashed_blocks = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (e.g. after a weight update). Blocks in use are unaffected."""
        for p in self.pools:
            p.cached.clear()
            p.hash = [None] * p.num_blocks

    def slot_mapping(self, seq: Sequence, start: int, end: int, group: int = 0) -> list[int]:
        """Cache slots of token positions [start, end) of seq in the given group."""
        table, bs = seq.block_tables[group], self.block_size
        return [table[i // bs] * bs + i % bs for i in range(start, end)]

    def check_invariants(self, seqs: Seq[Sequence] | None = None) -> None:
        """Assert the pools are consistent; with seqs (all live ones), also the reference counts."""
        for g, p in enumerate(self.pools):
            for b in range(p.num_blocks):
                assert p.ref[b] >= 0, (g, b, p.ref[b])
                assert (p.ref[b] == 0) == (b in p.free), f"group {g} block {b}: ref {p.ref[b]}, in free queue {b in p.free}"
                if p.hash[b] is not None:
                    assert p.cached.get(p.hash[b]) == b, (g, b)
            assert len(p.cached) == sum(h is not None for h in p.hash), g
            assert self.enable_prefix_caching or not p.cached
        if seqs is None:
            return
        refs = [[0] * p.num_blocks for p in self.pools]
        for seq in seqs:
            tables = seq.block_tables
            if not any(tables):
                continue
            assert len({len(t) for t in tables}) == 1, f"seq {seq.seq_id!r}: groups not in lockstep"
            assert len(tables[0]) >= _cdiv(seq.num_computed_tokens, self.block_size), seq
            assert seq.num_hashed_blocks <= seq.num_computed_tokens // self.block_size, seq
            for g, t in enumerate(tables):
                assert len(set(t)) == len(t), f"seq {seq.seq_id!r} holds a block twice"
                for b in t:
                    refs[g][b] += 1
        for g, p in enumerate(self.pools):
            assert refs[g] == p.ref, f"group {g}: ref counts do not match the block tables"
