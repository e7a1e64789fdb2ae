import random
from dataclasses import dataclass

import pytest

from tqattn.engine.block_manager import BlockManager
from tqattn.engine.config import SchedulerConfig
from tqattn.engine.scheduler import Scheduler
from tqattn.engine.sequence import Sequence, SequenceStatus

VOCAB = 1000


@dataclass
class SP:
    max_tokens: int | None = 16
    ignore_eos: bool = False
    stop_token_ids: tuple = ()
    min_tokens: int = 0


def make(num_blocks=64, block_size=4, eos=(), **cfg):
    cfg.setdefault("max_model_len", 256)
    cfg.setdefault("max_num_seqs", 8)
    config = SchedulerConfig(block_size=block_size, **cfg)
    bm = BlockManager(num_blocks, block_size, config.enable_prefix_caching)
    return Scheduler(config, bm, eos_token_ids=eos)


class FakeModel:
    """Deterministic stand-in for the model that works through the paged cache.

    The 'K/V' written for position p is a hash of the K/V at p-1 (read back from the cache) and
    token p, per group, so it depends on the whole prefix like real K/V; the sampled token is a
    function of the last position's K/V in every group. Wrong block tables, slot mappings or
    prefix-cache reuse change the outputs.
    """

    def __init__(self, bm):
        self.bm = bm
        self.cache = [dict() for _ in bm.pools]

    def step(self, out):
        sampled = {}
        for s in out.scheduled:
            seq, start, end = s.seq, s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens
            last = []
            for g, cache in enumerate(self.cache):
                slots = self.bm.slot_mapping(seq, 0, end, g)
                for p in range(start, end):
                    prev = cache[slots[p - 1]] if p else None
                    cache[slots[p]] = hash((prev, seq.token_ids[p], g))
                last.append(cache[slots[end - 1]])
            if s.samples:
                sampled[seq.seq_id] = hash(tuple(last)) % VOCAB
        return sampled


def run_all(sched, prompts, params=None, check=None, max_steps=10_000):
    """Add prompts and step until every request finished; return {seq_id: output tokens}."""
    model = FakeModel(sched.block_manager)
    seqs = [Sequence(p, params or SP(), seq_id=i) for i, p in enumerate(prompts)]
    for s in seqs:
        sched.add(s)
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        assert not out.is_empty
        if check:
            check(sched, out)
        sched.update_from_output(out, model.step(out))
        sched.block_manager.check_invariants(list(sched.seqs.values()))
    assert not sched.has_unfinished()
    for p in sched.block_manager.pools:
        assert len(p.free) == p.num_blocks
    return {s.seq_id: s.output_token_ids for s in seqs}, seqs


def check_step(sched, out):
    cfg = sched.config
    assert 0 < out.num_batched_tokens <= cfg.max_num_batched_tokens
    assert len(sched.running) <= cfg.max_num_seqs
    flags = [s.is_decode for s in out.scheduled]
    assert flags == sorted(flags, reverse=True), "decodes must come first"
    assert len({id(s.seq) for s in out.scheduled}) == len(out.scheduled)
    for s in out.scheduled:
        assert s.seq.status is SequenceStatus.RUNNING and s.num_scheduled_tokens >= 1
        assert not s.is_decode or s.num_scheduled_tokens == 1


def random_prompts(rng, n, lo=3, hi=40, shared=None):
    prompts = []
    for _ in range(n):
        p = [rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))]
        if shared and rng.random() < 0.5:
            p = shared[:rng.randint(4, len(shared))] + p
        prompts.append(p)
    return prompts


def test_decodes_first_and_budget():
    sched = make(max_num_batched_tokens=32)
    model = FakeModel(sched.block_manager)
    a = Sequence(range(10), SP(max_tokens=5))
    sched.add(a)
    out = sched.schedule()
    assert [(s.seq, s.num_scheduled_tokens, s.is_decode) for s in out.scheduled] == [(a, 10, False)]
    sched.update_from_output(out, model.step(out))
    assert a.num_output_tokens == 1

    b = Sequence(range(100, 200), SP())
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq, s.num_scheduled_tokens, s.is_decode) for s in out.scheduled] == [(a, 1, True), (b, 31, False)]
    assert out.num_batched_tokens == 32 and out.num_decodes == 1
    sched.update_from_output(out, model.step(out))
    assert b.num_output_tokens == 0 and b.num_computed_tokens == 31  # mid-prompt chunk samples nothing


def test_chunked_prefill_of_long_prompt():
    sched = make(max_num_batched_tokens=32)
    model = FakeModel(sched.block_manager)
    seq = Sequence(range(100), SP(max_tokens=3))
    sched.add(seq)
    chunks = []
    while sched.has_unfinished():
        out = sched.schedule()
        (s,) = out.scheduled
        chunks.append((s.num_scheduled_tokens, s.samples, s.is_decode))
        sched.update_from_output(out, model.step(out))
    assert chunks == [(32, False, False)] * 3 + [(4, True, False), (1, True, True), (1, True, True)]
    assert seq.status is SequenceStatus.FINISHED_LENGTH and seq.num_output_tokens == 3


def test_chunked_prefill_disabled():
    sched = make(max_num_batched_tokens=32, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match=r"chunked prefill disabled.*max_num_batched_tokens=32"):
        sched.add(Sequence(range(40), SP(max_tokens=4)))
    with pytest.raises(ValueError, match=r"= 34 must fit"):  # prompt fits, but a recompute after preemption would not
        sched.add(Sequence(range(20), SP(max_tokens=15)))
    rng = random.Random(0)
    prompts = random_prompts(rng, 12, 5, 20)
    outs, seqs = run_all(sched, prompts, SP(max_tokens=8), check=check_step)
    assert all(len(o) == 8 for o in outs.values())


@pytest.fixture(params=["reserve", "greedy"])
def admission(request, monkeypatch):
    """The scheduler's admission, or greedy admission (no reserve for growth), which preempts
    far more: the preemption paths run in both."""
    if request.param == "greedy":
        monkeypatch.setattr(Scheduler, "_fits_with_reserve", lambda *a: True)
    return request.param


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("num_blocks", [14, [14, 23]])
def test_preemption_matches_huge_pool(prefix_caching, chunked, num_blocks, admission):
    rng = random.Random(1)
    shared = [rng.randrange(VOCAB) for _ in range(24)]
    prompts = random_prompts(rng, 20, 3, 20, shared=shared)
    params = SP(max_tokens=12, ignore_eos=True)
    kw = dict(max_num_batched_tokens=16 if chunked else 64, max_num_seqs=8, enable_chunked_prefill=chunked,
              enable_prefix_caching=prefix_caching)
    huge = 4096 if isinstance(num_blocks, int) else [4096] * len(num_blocks)  # same groups: same fake K/V
    ref, _ = run_all(make(num_blocks=huge, **kw), prompts, params, check=check_step)
    sched = make(num_blocks=num_blocks, eos=(1, 2, 3), **kw)
    outs, seqs = run_all(sched, prompts, params, check=check_step)
    if admission == "greedy":
        assert sum(s.num_preemptions for s in seqs) > 0
    assert sched.stats.num_preemptions == sum(s.num_preemptions for s in seqs)
    assert outs == ref
    assert all(len(o) == 12 for o in outs.values())
    assert all(s.status is SequenceStatus.FINISHED_LENGTH for s in seqs)


def test_random_workload_invariants():
    rng = random.Random(2)
    shared = [rng.randrange(VOCAB) for _ in range(40)]
    prompts = random_prompts(rng, 60, 1, 80, shared=shared)
    sched = make(num_blocks=[40, 90], max_num_batched_tokens=48, max_num_seqs=6)
    outs, seqs = run_all(sched, prompts, SP(max_tokens=10, ignore_eos=True), check=check_step)
    ref, _ = run_all(make(num_blocks=[4096, 4096], enable_prefix_caching=False), prompts, SP(max_tokens=10, ignore_eos=True))
    assert outs == ref
    assert any(s.num_cached_tokens for s in seqs)


def test_prefix_cache_hit_on_admission():
    sched = make(max_num_batched_tokens=64)
    model = FakeModel(sched.block_manager)
    prompt = list(range(50, 60))  # 10 tokens, block_size 4: 2 full blocks

    def finish_one(seq):
        sched.add(seq)
        first = None
        while not seq.is_finished:
            out = sched.schedule()
            first = first or out.scheduled[0]
            sched.update_from_output(out, model.step(out))
        return first

    a = Sequence(prompt, SP(max_tokens=2))
    assert finish_one(a).num_scheduled_tokens == 10
    b = Sequence(prompt, SP(max_tokens=2))
    first = finish_one(b)
    assert b.num_cached_tokens == 8 and first.num_computed_tokens == 8 and first.num_scheduled_tokens == 2
    assert b.output_token_ids == a.output_token_ids
    c = Sequence(prompt[:8], SP(max_tokens=2))  # whole prompt cached: the last block is recomputed
    first = finish_one(c)
    assert c.num_cached_tokens == 4 and first.num_scheduled_tokens == 4


def test_stop_conditions_and_finish():
    sched = make(eos=7)
    sched.add(a := Sequence([1, 2, 3], SP(max_tokens=10)))
    sched.add(b := Sequence([1, 2, 4], SP(max_tokens=10, ignore_eos=True)))
    sched.add(c := Sequence([1, 2, 5], SP(max_tokens=10, stop_token_ids=(9,))))
    sched.add(d := Sequence([1, 2, 6], SP(max_tokens=10, min_tokens=2)))
    sched.add(e := Sequence([1, 2, 8], SP(max_tokens=10)))
    out = sched.schedule()
    finished = sched.update_from_output(out, {a.seq_id: 7, b.seq_id: 7, c.seq_id: 9, d.seq_id: 7, e.seq_id: 5})
    assert finished == [a, c]
    assert a.status is SequenceStatus.FINISHED_STOPPED and a.stop_reason == 7
    assert c.stop_reason == 9 and b.status is d.status is SequenceStatus.RUNNING
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [b, d, e] and all(s.is_decode for s in out.scheduled)
    assert sched.finish(e.seq_id)  # e.g. a stop string seen by the detokenizer
    assert e.status is SequenceStatus.FINISHED_STOPPED and not sched.finish(e.seq_id)
    finished = sched.update_from_output(out, {b.seq_id: 7, d.seq_id: 7})  # e is skipped
    assert finished == [d] and e.num_output_tokens == 1
    with pytest.raises(ValueError, match="no sampled token"):
        sched.update_from_output(sched.schedule(), {})


def test_abort_frees_blocks():
    sched = make(num_blocks=16, max_num_batched_tokens=16, max_num_seqs=2)
    model = FakeModel(sched.block_manager)
    seqs = [Sequence(range(i * 100, i * 100 + 10), SP(), seq_id=f"r{i}") for i in range(3)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()  # r0 whole, r1 first chunk; r2 waits
    sched.update_from_output(out, model.step(out))
    assert sched.block_manager.num_free_blocks() < 16
    assert sched.abort("r2") and sched.abort("r0") and sched.abort("r1")
    assert not sched.abort("r1") and not sched.abort("nope")
    assert all(s.status is SequenceStatus.FINISHED_ABORTED for s in seqs)
    assert sched.block_manager.num_free_blocks() == 16 and not sched.has_unfinished()
    assert sched.schedule().is_empty
    sched.block_manager.check_invariants(seqs)


def test_add_errors():
    sched = make(num_blocks=8, max_model_len=64)
    with pytest.raises(ValueError, match=r"prompt \(60 tokens\) \+ max_tokens \(10\) = 70 exceeds max_model_len=64"):
        sched.add(Sequence(range(60), SP(max_tokens=10)))
    with pytest.raises(ValueError, match="prompt has 64 tokens, max_model_len is 64"):
        sched.add(Sequence(range(64), SP(max_tokens=None)))
    with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
        sched.add(Sequence(range(4), SP(max_tokens=0)))
    with pytest.raises(ValueError, match="needs 9 KV blocks of 4 tokens, but KV-cache group 0 has only 8"):
        sched.add(Sequence(range(30), SP(max_tokens=6)))
    sched.add(Sequence(range(30), SP(max_tokens=3), seq_id="x"))  # 32 KV tokens: exactly 8 blocks
    with pytest.raises(ValueError, match="already queued"):
        sched.add(Sequence([1], SP(), seq_id="x"))
    with pytest.raises(ValueError, match="empty"):
        Sequence([])
    s = Sequence(range(10), SP(max_tokens=None))
    make(num_blocks=16, max_model_len=64).add(s)
    assert s.max_tokens == 54


def test_config_validation():
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        SchedulerConfig(max_model_len=100, block_size=12)
    with pytest.raises(ValueError, match="max_num_seqs must be a positive integer, got 0"):
        SchedulerConfig(max_model_len=100, max_num_seqs=0)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(64\) must be >= max_num_seqs \(128\)"):
        SchedulerConfig(max_model_len=100, max_num_seqs=128, max_num_batched_tokens=64)
    with pytest.raises(TypeError):
        SchedulerConfig()  # max_model_len is required
    with pytest.raises(ValueError, match="block_size"):
        Scheduler(SchedulerConfig(max_model_len=10), BlockManager(10, 8))
    assert SchedulerConfig(max_model_len=8192).max_num_batched_tokens >= 2048


def test_preempted_victim_already_scheduled_this_step(monkeypatch):
    # Greedy admission, so that both run. a has less computed work than b, so a is the one
    # preempted, even though a's decode was already scheduled in this step (its budget and
    # blocks are handed back).
    monkeypatch.setattr(Scheduler, "_fits_with_reserve", lambda *a: True)
    b = Sequence(range(8), SP(max_tokens=4), seq_id="b")
    a = Sequence(range(100, 106), SP(max_tokens=4), seq_id="a")
    sched = make(num_blocks=4)
    model = FakeModel(sched.block_manager)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.update_from_output(out, model.step(out))  # 2 blocks each, none free
    out = sched.schedule()  # a's 7th token fits its block; b's 9th needs a new one
    assert [s.seq for s in out.scheduled] == [b] and out.preempted == [a] and out.num_batched_tokens == 1
    assert a.status is SequenceStatus.PREEMPTED and sched.waiting[0] is a and a.num_computed_tokens == 0
    sched.block_manager.check_invariants([a, b])
    sched.update_from_output(out, model.step(out))
    while sched.has_unfinished():
        out = sched.schedule()
        check_step(sched, out)
        sched.update_from_output(out, model.step(out))
    ref, _ = run_all(make(num_blocks=64), [list(range(100, 106)), list(range(8))], SP(max_tokens=4))
    assert [a.output_token_ids, b.output_token_ids] == [ref[0], ref[1]]


def run_fake(sched, seqs, eos_rng=None, max_steps=100_000):
    """Step a workload without a model: every chunk that reaches its end samples token 0 (or,
    with eos_rng, an eos token now and then); return the number of steps."""
    for s in seqs:
        sched.add(s)
    steps = 0
    while sched.has_unfinished():
        steps += 1
        assert steps <= max_steps, "no progress"
        out = sched.schedule()
        assert not out.is_empty, "an idle step with work left: deadlock"
        check_step(sched, out)
        sampled = {s.seq.seq_id: (1 if eos_rng and eos_rng.random() < 0.02 else 0)
                   for s in out.scheduled if s.samples}
        sched.update_from_output(out, sampled)
    bm = sched.block_manager
    bm.check_invariants([])
    assert all(bm.num_free_blocks(g) == n for g, n in enumerate(bm.num_blocks)), "leaked blocks"
    assert all(s.is_finished for s in seqs)
    return steps


# Qwen3-4B's 8 GiB cache holds 58K bf16 tokens and 4.34x that with turboquant_k3v4_nc: this
# many 9K-token sequences.
@pytest.mark.parametrize("seqs_in_cache", [27.4, 6.47])
def test_cache_bound_workload_recomputes_little(seqs_in_cache):
    """64 x 8K in / 1K out with a cache of ~27 (or ~6) such sequences and 8K-token steps,
    scaled down 8x (block size 16): all finish, and at most 10 % of the prompt tokens are
    computed twice. Greedy admission recomputes more than that on the same workload."""
    prompt_len, out_len, block_size = 1024, 128, 16
    num_blocks = int(seqs_in_cache * (prompt_len + out_len) / block_size)
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB) for _ in range(prompt_len)] for _ in range(64)]

    def run():
        sched = make(num_blocks=num_blocks, block_size=block_size, max_model_len=prompt_len + out_len,
                     max_num_seqs=64, max_num_batched_tokens=prompt_len, enable_prefix_caching=False)
        run_fake(sched, [Sequence(p, SP(max_tokens=out_len, ignore_eos=True)) for p in prompts])
        return sched.stats

    stats = run()
    assert stats.num_recomputed_tokens <= 0.10 * 64 * prompt_len
    assert stats.num_computed_tokens == 64 * (prompt_len + out_len - 1) + stats.num_recomputed_tokens
    assert stats.max_num_running >= int(seqs_in_cache)  # the reserve still fills the cache
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Scheduler, "_fits_with_reserve", lambda *a: True)
        greedy = run()
    assert greedy.num_recomputed_tokens > 0.10 * 64 * prompt_len
    assert greedy.num_preemptions > stats.num_preemptions


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_random_pressure_finishes_everything(prefix_caching, seed):
    """Random prompt and output lengths, early eos stops, a cache of a few sequences, one or
    two groups: nothing deadlocks, every request finishes, every block comes back, and the
    stats add up (without prefix caching every token is computed once plus the recomputed)."""
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(30)]
    prompts = random_prompts(rng, 40, 1, 90, shared=shared if prefix_caching else None)
    seqs = [Sequence(p, SP(max_tokens=rng.randint(1, 40))) for p in prompts]
    sched = make(num_blocks=rng.choice([40, [40, 55]]), block_size=4, eos=(1,), max_model_len=160,
                 max_num_seqs=rng.choice([4, 16]), max_num_batched_tokens=rng.choice([16, 64]),
                 enable_prefix_caching=prefix_caching)
    run_fake(sched, seqs, eos_rng=rng)
    stats = sched.stats
    assert sum(s.num_preemptions for s in seqs) == stats.num_preemptions
    kv_tokens = sum(s.num_tokens - 1 for s in seqs)
    if prefix_caching:
        assert stats.num_computed_tokens <= kv_tokens + stats.num_recomputed_tokens
    else:
        assert stats.num_computed_tokens == kv_tokens + stats.num_recomputed_tokens
    assert 1 <= stats.max_num_running <= sched.config.max_num_seqs


def test_reserve_is_exact_for_length_bound_requests_and_capped_otherwise():
    """A request that only the length can end reserves its whole max_tokens; one that may stop
    early reserves at most half the cache in all, so long max_tokens do not serialize the batch."""
    def peak(params, eos_rng=None):
        sched = make(num_blocks=40, block_size=4, eos=(1,), max_model_len=160, max_num_seqs=16,
                     max_num_batched_tokens=64, enable_prefix_caching=False)
        run_fake(sched, [Sequence([5] * 10, params) for _ in range(12)], eos_rng=eos_rng)
        return sched.stats

    sure = peak(SP(max_tokens=140, ignore_eos=True))  # 38 of the 40 blocks each
    assert sure.max_num_running == 1 and sure.num_preemptions == 0
    may_stop = peak(SP(max_tokens=140), eos_rng=random.Random(0))
    assert may_stop.max_num_running >= 4
