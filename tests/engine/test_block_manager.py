import random

import pytest

from tqattn.engine.block_manager import BlockManager, hash_block, slot_for
from tqattn.engine.sequence import Sequence


def compute(bm, seq, n, cached=0):
    """Allocate and 'run' n tokens of seq (as one scheduler step would)."""
    assert bm.allocate_slots(seq, n, cached)
    seq.num_computed_tokens = seq.num_computed_tokens + cached + n
    bm.cache_full_blocks(seq)


def snapshot(bm, seqs=()):
    return ([list(p.free) for p in bm.pools], [list(p.ref) for p in bm.pools], dict(bm.pools[0].cached),
            [[list(t) for t in s.block_tables] for s in seqs])


def test_allocation_and_free_accounting():
    bm = BlockManager(10, block_size=4)
    a = Sequence(range(10))
    assert bm.can_allocate(a, 10)
    compute(bm, a, 10)
    assert len(a.block_table) == 3 and bm.num_free_blocks() == 7 and bm.usage == pytest.approx(0.3)
    a.append_token(99)  # 11 tokens: still 3 blocks
    compute(bm, a, 1)
    assert len(a.block_table) == 3
    a.append_token(98)  # 12 computed -> the 13th token opens a 4th block
    a.append_token(97)
    compute(bm, a, 2)
    assert len(a.block_table) == 4 and bm.num_free_blocks() == 6
    assert bm.slot_mapping(a, 3, 5) == [slot_for(a.block_table, 3, 4), a.block_table[1] * 4]

    b = Sequence(range(100, 130))  # needs 8 blocks, only 6 free: refused without side effects
    before = snapshot(bm, [a, b])
    assert not bm.can_allocate(b, 30)
    assert not bm.allocate_slots(b, 30)
    assert snapshot(bm, [a, b]) == before
    bm.check_invariants([a, b])

    bm.free(a)
    assert bm.num_free_blocks() == 10 and bm.usage == 0 and a.block_table == []
    bm.check_invariants([a, b])
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager([4, 0], block_size=4)


def test_prefix_hit_after_finish_reuses_full_blocks_only():
    bm = BlockManager(16, block_size=4)
    a = Sequence([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    compute(bm, a, 10)
    a_blocks = list(a.block_table)
    bm.free(a)

    b = Sequence([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13])
    assert bm.get_computed_blocks(b) == 8  # the partial third block of a was never registered
    compute(bm, b, 5, cached=8)
    assert b.block_table[:2] == a_blocks[:2]
    assert b.num_computed_tokens == 13
    bm.check_invariants([b])

    # A prompt equal to a cached prefix still recomputes its last token: 8 tokens -> 4 cached.
    c = Sequence([1, 2, 3, 4, 5, 6, 7, 8])
    assert bm.get_computed_blocks(c) == 4
    compute(bm, c, 4, cached=4)
    assert c.block_table[0] == b.block_table[0] and bm.pools[0].ref[c.block_table[0]] == 2
    bm.check_invariants([b, c])

    # Different extra key (e.g. another LoRA) or different tokens: no hit.
    assert bm.get_computed_blocks(Sequence(range(1, 11), extra_key="lora-1")) == 0
    assert bm.get_computed_blocks(Sequence([1, 2, 3, 5, 5, 6, 7, 8, 9])) == 0
    with pytest.raises(ValueError, match="not a prefix-cache hit"):
        bm.allocate_slots(Sequence([7, 7, 7, 7, 7, 7]), 2, 4)

    bm.reset_prefix_cache()
    assert bm.get_computed_blocks(Sequence(range(1, 11))) == 0
    bm.check_invariants([b, c])


def test_prefix_caching_disabled():
    bm = BlockManager(8, block_size=4, enable_prefix_caching=False)
    a = Sequence(range(12))
    compute(bm, a, 12)
    bm.free(a)
    assert bm.get_computed_blocks(Sequence(range(12))) == 0
    bm.check_invariants()


def test_hit_requires_all_groups():
    bm = BlockManager([4, 8], block_size=4)
    a = Sequence(range(9))
    compute(bm, a, 9)  # registers 2 full blocks in both groups
    bm.free(a)
    assert bm.get_computed_blocks(Sequence(range(9))) == 8

    # 3 more blocks: in the small group this evicts a's second block, in the big one nothing.
    c = Sequence(range(100, 112))
    compute(bm, c, 12)
    bm.free(c)
    h1 = hash_block(hash_block(None, range(4)), range(4, 8))
    assert h1 not in bm.pools[0].cached and h1 in bm.pools[1].cached
    b = Sequence(range(9))
    assert bm.get_computed_blocks(b) == 4
    compute(bm, b, 1, cached=4)
    assert len(b.block_tables[0]) == len(b.block_tables[1]) == 2
    bm.check_invariants([b])


def test_eviction_is_lru_and_hits_revive():
    bm = BlockManager(8, block_size=2)
    seqs = [Sequence([k, k + 1, 0]) for k in (10, 20, 30)]
    for s in seqs:
        compute(bm, s, 3)  # 1 full (registered) + 1 partial block each
    for s in seqs:  # freed in order a, b, c: a's prefix is the least recently freed
        bm.free(s)
    d = Sequence(range(100, 112))
    compute(bm, d, 12)  # 6 blocks: 3 uncached partials, 2 never used, then evicts a's
    assert [bm.get_computed_blocks(Sequence([k, k + 1, 0])) for k in (10, 20, 30)] == [0, 2, 2]

    # The hit takes b's block off the queue (it was next in line); the new block evicts c's.
    b2 = Sequence([20, 21, 5])
    compute(bm, b2, 1, cached=2)
    assert [bm.get_computed_blocks(Sequence([k, k + 1, 0])) for k in (10, 20, 30)] == [0, 2, 0]
    assert bm.num_free_blocks() == 0
    bm.check_invariants([b2, d])


def test_free_releases_tail_first():
    bm = BlockManager(4, block_size=2)
    a = Sequence([1, 2, 3, 4, 5, 6, 7])
    compute(bm, a, 7)  # 3 full registered blocks + 1 partial
    bm.free(a)
    b = Sequence([50, 51, 52])
    compute(bm, b, 3)  # takes the partial block and then evicts a's tail (third) block
    assert bm.get_computed_blocks(Sequence([1, 2, 3, 4, 5, 6, 7])) == 4


@pytest.mark.parametrize("seed,num_blocks", [(0, 24), (1, [24, 40]), (2, [40, 17]), (3, 13), (4, [30, 30, 60])])
def test_fuzz_block_manager(seed, num_blocks):
    rng = random.Random(seed)
    bs = 4
    bm = BlockManager(num_blocks, block_size=bs)
    families = [[rng.randrange(1000) for _ in range(40)] for _ in range(3)]
    # Fake K/V: the value stored for position p names the whole prefix (as real K/V depends on it).
    kv = [dict() for _ in bm.pools]
    live: list[Sequence] = []
    stats = {"hits": 0, "shared": 0, "refused": 0}

    def kv_value(seq, p):
        return hash(tuple(seq.token_ids[:p + 1]))

    def run(seq, n, cached=0):
        before = snapshot(bm, live)
        if not bm.allocate_slots(seq, n, cached):
            stats["refused"] += 1
            assert snapshot(bm, live) == before
            return False
        if cached:
            stats["hits"] += 1
            for g in range(bm.num_groups):  # the reused blocks hold exactly this prefix
                for p, slot in enumerate(bm.slot_mapping(seq, 0, cached, g)):
                    assert kv[g][slot] == kv_value(seq, p)
        seq.num_computed_tokens += cached
        for g in range(bm.num_groups):
            for p, slot in zip(range(seq.num_computed_tokens, seq.num_computed_tokens + n),
                               bm.slot_mapping(seq, seq.num_computed_tokens, seq.num_computed_tokens + n, g)):
                kv[g][slot] = kv_value(seq, p)
        seq.num_computed_tokens += n
        bm.cache_full_blocks(seq)
        return True

    def release(seq):
        bm.free(seq)
        seq.num_computed_tokens = 0

    for _ in range(2500):
        op = rng.random()
        if op < 0.2 and len(live) < 12:  # new request, often sharing a family prefix
            fam = rng.choice(families)
            prompt = fam[:rng.randrange(1, 40)] + [rng.randrange(1000) for _ in range(rng.randrange(0, 6))]
            live.append(Sequence(prompt))
        elif op < 0.75 and live:  # a step for one sequence: admit / prefill chunk / decode
            seq = rng.choice(live)
            if not seq.block_table:
                cached = bm.get_computed_blocks(seq)
                assert cached % bs == 0 and cached < seq.num_tokens
                run(seq, rng.randint(1, seq.num_tokens - cached), cached)
            elif seq.num_uncomputed_tokens:
                run(seq, rng.randint(1, seq.num_uncomputed_tokens))
            elif seq.num_tokens < 60:
                seq.append_token(rng.randrange(1000))
                run(seq, 1)
        elif op < 0.85 and live:  # preempt: blocks go, the tokens stay
            release(rng.choice(live))
        elif op < 0.99 and live:  # finish or abort
            seq = live.pop(rng.randrange(len(live)))
            release(seq)
        else:
            bm.reset_prefix_cache()
        bm.check_invariants(live)
        stats["shared"] += any(r > 1 for p in bm.pools for r in p.ref)

    for seq in live:
        release(seq)
    bm.check_invariants(live)
    for p in bm.pools:
        assert len(p.free) == p.num_blocks and not any(p.ref)
    assert stats["hits"] > 20 and stats["shared"] > 20 and stats["refused"] > 0, stats
