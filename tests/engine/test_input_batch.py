"""InputBatch against the per-sequence tensor code it replaced, on randomized step sequences:
sequences joining, growing blocks, finishing, preempted; stand-alone steps in between (profile /
warm-up / score style sequences that never run through the scheduler)."""

from __future__ import annotations

import pickle
import random

import pytest
import torch

from tqattn.engine.block_manager import BlockManager
from tqattn.engine.config import SchedulerConfig
from tqattn.engine.input_batch import InputBatch
from tqattn.engine.scheduler import ScheduledSeq, Scheduler
from tqattn.engine.sequence import Sequence

from .test_scheduler import SP, VOCAB, random_prompts


def reference_prepare(scheduled, num_groups, bs):
    """The model runner's step inputs as they were built before InputBatch (CPU tensors)."""
    q_lens = torch.tensor([s.num_scheduled_tokens for s in scheduled], dtype=torch.int64)
    computed = torch.tensor([s.num_computed_tokens for s in scheduled], dtype=torch.int64)
    seq_lens = computed + q_lens
    num_reqs, num_tokens = len(scheduled), int(q_lens.sum())
    input_ids = torch.tensor([t for s in scheduled for t in s.token_ids], dtype=torch.int64)
    req = torch.repeat_interleave(torch.arange(num_reqs), q_lens)
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int64)
    qsl[1:] = torch.cumsum(q_lens, 0)
    positions = computed[req] + torch.arange(num_tokens) - qsl[:-1][req]
    num_decodes = 0
    while num_decodes < num_reqs and q_lens[num_decodes] == 1:
        num_decodes += 1
    max_blocks = -(-int(seq_lens.max()) // bs)
    tables, slot_mappings = [], []
    for g in range(num_groups):
        table = torch.zeros(num_reqs, max_blocks, dtype=torch.int32)
        for i, s in enumerate(scheduled):
            blocks = s.seq.block_tables[g][:max_blocks]
            table[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        tables.append(table)
        slot_mappings.append(table[req, positions // bs].long() * bs + positions % bs)
    return dict(input_ids=input_ids, positions=positions, query_start_loc=qsl.to(torch.int32),
                seq_lens=seq_lens.to(torch.int32), num_computed_tokens=computed.to(torch.int32),
                block_tables=tables, slot_mappings=slot_mappings, num_reqs=num_reqs, num_tokens=num_tokens,
                max_query_len=int(q_lens.max()), max_seq_len=int(seq_lens.max()), num_decodes=num_decodes,
                sample_idx=[int(qsl[i + 1]) - 1 for i, s in enumerate(scheduled) if s.samples])


def reference_replay_inputs(scheduled, bucket, static, num_groups, bs):
    """What the graph replay wrote into the static buffers before InputBatch."""
    n, st = len(scheduled), static
    pos = [s.num_computed_tokens for s in scheduled]
    ids = torch.tensor([s.seq.token_ids[p] for s, p in zip(scheduled, pos)], dtype=torch.int64)
    positions = torch.tensor(pos, dtype=torch.int64)
    seq_lens = torch.zeros(bucket, dtype=torch.int32)
    seq_lens[:n] = positions.to(torch.int32) + 1
    st["input_ids"][:n].copy_(ids)
    st["positions"][:n].copy_(positions)
    st["seq_lens"][:bucket].copy_(seq_lens)
    st["num_computed_tokens"][:bucket].copy_((seq_lens - 1).clamp_min(0))
    for g in range(num_groups):
        width = max(len(s.seq.block_tables[g]) for s in scheduled)
        table = torch.zeros(bucket, width, dtype=torch.int32)
        for i, s in enumerate(scheduled):
            table[i, :len(s.seq.block_tables[g])] = torch.tensor(s.seq.block_tables[g], dtype=torch.int32)
        slots = torch.full((bucket,), -1, dtype=torch.int64)
        slots[:n] = table[torch.arange(n), positions // bs].long() * bs + positions % bs
        st["block_tables"][g][:bucket, :width].copy_(table)
        st["slot_mappings"][g][:bucket].copy_(slots)


def static_buffers(max_bs, max_blocks, num_groups, seed):
    """Graph input buffers, filled with the same garbage for both sides (stale regions must match)."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape, dtype: torch.randint(0, 1000, shape, generator=g).to(dtype)  # noqa: E731
    return {"input_ids": rand(max_bs, dtype=torch.int64), "positions": rand(max_bs, dtype=torch.int64),
            "seq_lens": rand(max_bs, dtype=torch.int32), "num_computed_tokens": rand(max_bs, dtype=torch.int32),
            "block_tables": [rand(max_bs, max_blocks, dtype=torch.int32) for _ in range(num_groups)],
            "slot_mappings": [rand(max_bs, dtype=torch.int64) for _ in range(num_groups)]}


def assert_same_inputs(x, ref):
    for name in ("input_ids", "positions", "query_start_loc", "seq_lens", "num_computed_tokens"):
        assert torch.equal(getattr(x, name), ref[name]), name
        assert getattr(x, name).dtype == ref[name].dtype, name
    for g, (t, s) in enumerate(zip(x.block_tables, x.slot_mappings)):
        assert torch.equal(t, ref["block_tables"][g]), g
        assert torch.equal(s, ref["slot_mappings"][g]), g
        assert t.is_contiguous()
    assert torch.equal(x.query_start_loc_cpu, ref["query_start_loc"])
    assert torch.equal(x.seq_lens_cpu, ref["seq_lens"])
    assert torch.equal(x.num_computed_tokens_cpu, ref["num_computed_tokens"])
    for name in ("num_reqs", "num_tokens", "max_query_len", "max_seq_len", "num_decodes", "sample_idx"):
        assert getattr(x, name) == ref[name], name


def standalone_step(rng, bs, num_groups, reuse=None):
    """A step the scheduler never saw: a fresh (or reused, with new block-table lists) sequence."""
    seq = reuse or Sequence([rng.randrange(VOCAB) for _ in range(rng.randint(1, 60))], SP())
    n = seq.num_tokens
    seq.block_tables = [[rng.randrange(50) for _ in range(-(-n // bs))] for _ in range(num_groups)]
    return seq, [ScheduledSeq(seq, n, False, 0)]


@pytest.mark.parametrize("seed", range(4))
def test_matches_the_per_sequence_tensors(seed, monkeypatch):
    rng = random.Random(seed)
    bs = rng.choice([4, 16])
    num_blocks = rng.choice([[30], [30, 45], [200, 200]])
    if rng.random() < 0.5:  # no growth reserve: many preemptions
        monkeypatch.setattr(Scheduler, "_fits_with_reserve", lambda *a: True)
    config = SchedulerConfig(max_model_len=256, max_num_seqs=rng.choice([4, 12]), block_size=bs,
                             max_num_batched_tokens=rng.choice([12, 40]),
                             enable_prefix_caching=rng.random() < 0.5)
    bm = BlockManager(num_blocks, bs, config.enable_prefix_caching)
    sched = Scheduler(config, bm)
    groups = len(num_blocks)
    shared = [rng.randrange(VOCAB) for _ in range(20)]
    for i, p in enumerate(random_prompts(rng, 40, 1, 60, shared=shared)):
        sched.add(Sequence(p, SP(max_tokens=rng.randint(1, 30), ignore_eos=True)))
    batch = InputBatch(groups, bs, torch.device("cpu"))
    other = InputBatch(groups, bs, torch.device("cpu"))  # a rank that only loads what batch fills
    max_blocks = -(-256 // bs)
    new_static, ref_static = (static_buffers(16, max_blocks, groups, seed) for _ in range(2))
    fake, decode_steps, preempted = None, 0, 0
    while sched.has_unfinished():
        out = sched.schedule()
        preempted += len(out.preempted)
        scheduled = out.scheduled
        if rng.random() < 0.5:
            assert_same_inputs(batch.prepare(scheduled), reference_prepare(scheduled, groups, bs))
        elif rng.random() < 0.5:  # another tensor-parallel rank: the host arrays sent, loaded, uploaded
            sent = pickle.loads(pickle.dumps(batch.fill(scheduled)))
            assert_same_inputs(other.upload(other.load(sent)), reference_prepare(scheduled, groups, bs))
        if all(s.is_decode for s in scheduled):
            decode_steps += 1
            bucket = rng.choice([b for b in (1, 2, 4, 8, 16) if b >= len(scheduled)])
            if rng.random() < 0.5:
                batch.to_static(batch.fill_decode(scheduled, bucket), new_static)
            else:
                other.to_static(other.load(pickle.loads(pickle.dumps(batch.fill_decode(scheduled, bucket)))),
                                new_static)
            reference_replay_inputs(scheduled, bucket, ref_static, groups, bs)
            for k, v in ref_static.items():
                assert all(torch.equal(a, b) for a, b in zip(new_static[k], v)) if isinstance(v, list) \
                    else torch.equal(new_static[k], v), k
        sched.update_from_output(out, {s.seq.seq_id: 0 for s in scheduled if s.samples})
        if rng.random() < 0.1:  # a profile / warm-up style step, sometimes reusing its sequence
            fake, steps = standalone_step(rng, bs, groups, reuse=fake if rng.random() < 0.5 else None)
            assert_same_inputs(batch.prepare(steps), reference_prepare(steps, groups, bs))
    assert decode_steps > 5
    assert len(batch.owner) <= 64  # rows of finished sequences were reassigned


def test_rows_are_written_incrementally():
    """A running sequence's row is written once per new block, not rewritten every step."""
    bs = 4
    batch = InputBatch(1, bs, torch.device("cpu"))
    seq = Sequence(range(6), SP())
    seq.block_tables = [[7, 3]]
    seq.status = seq.status.RUNNING
    writes = []

    class Spy:
        def __init__(self, a):
            self.a = a

        def __getitem__(self, k):
            return self.a[k]

        def __setitem__(self, k, v):
            writes.append(k)
            self.a[k] = v

        def __getattr__(self, name):
            return getattr(self.a, name)

    batch.prepare([ScheduledSeq(seq, 6, False, 0)])
    batch.rows = [Spy(batch.rows[0])]
    seq.token_ids.append(1)
    batch.rows_for([ScheduledSeq(seq, 1, True, 6)])  # still 2 blocks: nothing written
    assert writes == []
    seq.block_tables[0].append(9)
    r = int(batch.rows_for([ScheduledSeq(seq, 1, True, 8)])[0])
    assert writes == [(r, slice(2, 3))]
    assert batch.rows[0].a[r, :3].tolist() == [7, 3, 9]
    seq.num_preemptions += 1  # preempted and readmitted: the row is rebuilt
    seq.block_tables[0][:] = [5]
    writes.clear()
    batch.rows_for([ScheduledSeq(seq, 3, False, 0)])
    assert writes == [r, (r, slice(0, 1))] and batch.rows[0].a[r, :3].tolist() == [5, 0, 0]
