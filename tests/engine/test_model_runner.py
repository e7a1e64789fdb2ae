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


def test_sampler_half_precision_logits_match_fp32():
    # bf16 logits with ties: greedy rows (argmax in bf16) and seeded rows (sampled in fp32)
    # give the tokens that the same logits cast to fp32 give
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 8, (6, 300), generator=gen).to(torch.bfloat16)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, seed=5, top_k=20)] * 3
    gens = lambda: [None if p.greedy else make_generator(5, torch.device("cpu")) for p in params]  # noqa: E731
    got = Sampler(seed=0)(logits, params, gens())
    want = Sampler(seed=0)(logits.float(), params, gens())
    assert got == want
    assert got[0] == int(logits[0].float().argmax())  # the first of tied maxima, as in fp32


def test_graph_capture_follows_the_backends_cudagraph_decode(monkeypatch, caplog):
    from tqattn.attention.flash_attn import FlashAttentionBackend
    from tqattn.attention.turboquant import TurboQuantBackend

    assert FlashAttentionBackend.cudagraph_decode and TurboQuantBackend.cudagraph_decode
    layers = _layers()  # FLASH_ATTN and TURBOQUANT groups
    runner = ModelRunner(None, layers, kv_cache_groups(layers, 16), 16, torch.device("cpu"))
    monkeypatch.setattr(TurboQuantBackend, "cudagraph_decode", False)
    with caplog.at_level("INFO", logger="tqattn.engine.model_runner"):
        runner.capture_cudagraphs(4, 64)
    assert not runner.graphs and "the TURBOQUANT backend's decode is not graph-safe" in caplog.text


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on CPU: 'capture' records the model call made inside
    it (its inputs and forward context, i.e. the static buffers and the metadata built for the
    bucket); replay repeats that call and writes into the captured output, as a graph would."""
    capturing = None

    def __init__(self):
        self.call = None

    def pool(self):
        return None

    def replay(self):
        model, kwargs, ctx, out = self.call
        with set_forward_context(ctx):
            out.logits.copy_(model(**kwargs).logits)


class _RecordingModel:
    def __init__(self, model):
        self.model = model

    def __call__(self, **kwargs):
        out = self.model(**kwargs)
        if _FakeGraph.capturing is not None:
            _FakeGraph.capturing.call = (self.model, kwargs, get_forward_context(), out)
        return out


class _fake_capture:
    def __init__(self, graph, pool=None):
        self.graph = graph

    def __enter__(self):
        _FakeGraph.capturing = self.graph

    def __exit__(self, *exc):
        _FakeGraph.capturing = None


@pytest.fixture
def one_thread():
    # Tiny models: one thread is faster, and much faster when other jobs share the cores.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("name,kwargs", [
    ("llama-tiny", {}),                                                  # FLASH_ATTN only
    ("gemma3-tiny", dict(kv_cache_dtype="tq_k3v4", kv_cache_dtype_skip_layers=["sliding_window"])),
])
def test_decode_graph_replay_equals_eager(monkeypatch, one_thread, name, kwargs):
    """The runner's graph flow on CPU with a stand-in graph: metadata built once per bucket at
    capture over static buffers, each decode step only rewriting them, equals eager decode."""
    pytest.importorskip("transformers")
    from tqattn import LLM

    from .test_llm_reference import random_prompts

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", _fake_capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    common = dict(load_format="dummy", max_model_len=64, max_num_seqs=4, **kwargs)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([3, 17, 9, 30, 5], seed=5)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 4, 9, 6, 7)]

    def run(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    graphs = LLM(name, **common)
    runner = graphs.llm_engine.runner
    assert {g.backend.name for g in runner.groups} == (
        {"FLASH_ATTN"} if not kwargs else {"FLASH_ATTN", "TURBOQUANT"})
    runner.model = _RecordingModel(runner.model)
    runner.capture_cudagraphs(4, 64)
    assert sorted(runner.graphs) == [1, 2, 4]
    replays = []
    step = runner.run_step
    monkeypatch.setattr(runner, "run_step", lambda host, *a: (
        host.bucket is not None and replays.append(host.num_reqs)) or step(host, *a))
    assert run(graphs) == run(LLM(name, **common))
    assert {1, 3, 4} <= set(replays)  # padded buckets too (3 requests in the 4-bucket)
