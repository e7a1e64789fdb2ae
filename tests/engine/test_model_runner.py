"""The model runner's step inputs (metadata per KV-cache group), the attention hook, the sampler."""

from __future__ import annotations

import pytest
import torch

from tqattn.attention.forward_context import ForwardContext, get_forward_context, set_forward_context
from tqattn.engine.kv_cache import kv_cache_groups
from tqattn.engine.model_runner import ModelRunner
from tqattn.engine.sampling import Sampler, SamplingParams, make_generator
from tqattn.engine.scheduler import ScheduledSeq
from tqattn.engine.sequence import Sequence

from .test_kv_cache import _layers


class _Recorder:
    def build(self, common):
        return common


def _seq(n_tokens, tables, n_prompt=None):
    seq = Sequence(list(range(100, 100 + (n_prompt or n_tokens))), SamplingParams(temperature=0))
    seq.token_ids += list(range(200, 200 + n_tokens - len(seq.token_ids)))
    seq.block_tables = [list(t) for t in tables]
    return seq


def test_prepare_flattens_the_step_per_group():
    layers = _layers()  # group 0: FLASH_ATTN layers 0-2, group 1: TURBOQUANT layer 3
    runner = ModelRunner(None, layers, kv_cache_groups(layers, 16), 16, torch.device("cpu"))
    runner.builders = [_Recorder(), _Recorder()]
    decode = _seq(21, [[7, 2], [4, 9]], n_prompt=18)          # 20 computed, token 20 to run
    chunk = _seq(40, [[1, 5, 3], [0, 6, 8]])                   # prompt tokens 16..35 this step
    fresh = _seq(3, [[0], [5]])                                # a whole 3-token prompt
    scheduled = [ScheduledSeq(decode, 1, True, 20), ScheduledSeq(chunk, 20, False, 16),
                 ScheduledSeq(fresh, 3, False, 0)]
    ids, pos, md, sample_idx = runner._prepare(scheduled)
    assert ids.tolist() == [decode.token_ids[20], *chunk.token_ids[16:36], *fresh.token_ids]
    assert pos.tolist() == [20, *range(16, 36), 0, 1, 2]
    assert sample_idx == [0, 23]  # the mid-prompt chunk samples nothing
    for g, common in enumerate(md):
        assert common.query_start_loc.tolist() == [0, 1, 21, 24]
        assert common.seq_lens.tolist() == [21, 36, 3]
        assert common.num_computed_tokens.tolist() == [20, 16, 0]
        assert common.query_start_loc.dtype == common.seq_lens.dtype == torch.int32
        assert (common.num_reqs, common.num_actual_tokens, common.max_query_len, common.max_seq_len) == (3, 24, 20, 36)
        assert common.num_decodes == 1 and common.block_size == 16
        tables = [s.seq.block_tables[g] for s in scheduled]
        assert common.block_table.tolist() == [t + [0] * (3 - len(t)) for t in tables]
        expected = [tables[0][1] * 16 + 4] + [tables[1][p // 16] * 16 + p % 16 for p in range(16, 36)] \
            + [tables[2][0] * 16 + p for p in range(3)]
        assert common.slot_mapping.tolist() == expected
        assert torch.equal(common.seq_lens_cpu, common.seq_lens)


def test_hook_needs_a_forward_context():
    with pytest.raises(RuntimeError, match="outside a forward context"):
        get_forward_context()
    ctx = ForwardContext({}, {}, [])
    with set_forward_context(ctx):
        assert get_forward_context() is ctx
    with pytest.raises(RuntimeError):
        get_forward_context()


def test_sampler():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    greedy, hot = SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3)
    sampler = Sampler(seed=0)
    out = sampler(logits, [greedy, hot, greedy, SamplingParams(temperature=1.0)],
                  [None, make_generator(3, torch.device("cpu")), None, None])
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())
    again = sampler(logits[1:2], [hot], [make_generator(3, torch.device("cpu"))])
    assert again == [out[1]]
    # a sample follows the distribution: the frequency of each token is close to its probability
    p = torch.softmax(torch.tensor([1.0, 0.0, -1.0, 2.0]), -1)
    draws = Sampler(seed=1)(p.log().expand(4000, 4), [SamplingParams(temperature=1.0)] * 4000, [None] * 4000)
    freq = torch.bincount(torch.tensor(draws), minlength=4).float() / 4000
    assert torch.allclose(freq, p, atol=0.03)
