"""Async scheduling (step N+1 launched before step N's tokens are read) changes no output: the
same tokens, finish reasons and stop reasons as the synchronous engine, under chunked prefill,
preemption, prefix caching, stop tokens, min_tokens, stop strings and aborts; no block leaks."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tqattn import LLM, SamplingParams  # noqa: E402
from tqattn.engine.sampled import PLACEHOLDER  # noqa: E402
from tqattn.engine.scheduler import Scheduler  # noqa: E402

from .test_llm_reference import _one_thread, random_prompts  # noqa: E402,F401

SMALL = dict(load_format="dummy", max_model_len=128, max_num_seqs=4)


def _ids(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def _summary(outputs):
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
            for o in outputs]


def _all_blocks_free(llm):
    bm = llm.llm_engine.block_manager
    bm.check_invariants([])
    return all(bm.num_free_blocks(g) == n for g, n in enumerate(bm.num_blocks))


def _both(name, prompts, params, **kwargs):
    out = {}
    for mode in (False, True):
        llm = LLM(name, **{**SMALL, **kwargs}, async_scheduling=mode)
        assert llm.llm_engine.async_scheduling is mode
        out[mode] = llm.generate(_ids(prompts), params, use_tqdm=False)
        assert _all_blocks_free(llm) and not llm.llm_engine.has_unfinished_requests()
    return out[False], out[True]


@pytest.mark.parametrize("name,config", [
    ("llama-tiny", dict(max_num_batched_tokens=16)),                # chunked prompts
    ("qwen3-tiny", dict(kv_cache_dtype="turboquant_k3v4_nc")),
    ("gemma3-tiny", dict(num_gpu_blocks_override=8)),               # preemption, prefix cache
    ("gemma3-tiny", dict(num_gpu_blocks_override=8, enable_prefix_caching=False)),
])
def test_same_outputs_as_sync(name, config, monkeypatch):
    if "num_gpu_blocks_override" in config:  # admission without a reserve: preemptions happen
        monkeypatch.setattr(Scheduler, "_fits_with_reserve", lambda *a: True)
    prompts = random_prompts([40, 7, 19, 3, 25, 33], seed=5)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (30, 1, 30, 25, 2, 30)]
    sync, async_ = _both(name, prompts, params, **config)
    assert _summary(async_) == _summary(sync)
    if "num_gpu_blocks_override" in config:
        assert sum(o.metrics.num_preemptions for o in async_) > 0


def test_stop_tokens_and_min_tokens_apply_when_the_value_arrives():
    prompts = random_prompts([12, 30, 5], seed=2)
    free = LLM("llama-tiny", **SMALL).generate(
        _ids(prompts), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    # stop each request on a token it produces mid-way; one has min_tokens past the first hit
    stops = [o.outputs[0].token_ids[i] for o, i in zip(free, (3, 0, 7))]
    params = [SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stops[0]]),
              SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stops[1]], min_tokens=4),
              SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stops[2]])]  # stop = last
    sync, async_ = _both("llama-tiny", prompts, params)
    assert _summary(async_) == _summary(sync)
    reasons = [(o.outputs[0].finish_reason, len(o.outputs[0].token_ids)) for o in async_]
    assert reasons[0] == ("stop", 4) and reasons[2] == ("stop", 8)  # stop beats length
    assert reasons[1][0] in ("stop", "length") and reasons[1][1] >= 4


def test_seeded_sampling_is_unchanged():
    prompts = random_prompts([10, 20, 6], seed=8)
    params = [SamplingParams(temperature=0.9, top_k=20, max_tokens=10, seed=s, ignore_eos=True)
              for s in (1, 2, 3)]
    sync, async_ = _both("qwen3-tiny", prompts, params)
    assert _summary(async_) == _summary(sync)


def test_stop_strings():
    params = SamplingParams(temperature=0, max_tokens=24, stop=["Paris"])
    msgs = [[{"role": "user", "content": "What is the capital of France?"}]]
    out = {}
    for mode in (False, True):
        llm = LLM(async_scheduling=mode, max_model_len=256)
        out[mode] = llm.chat(msgs, params, use_tqdm=False)
        assert _all_blocks_free(llm)
    assert [(o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
            for o in out[True]] == [(o.outputs[0].text, o.outputs[0].finish_reason,
                                     o.outputs[0].stop_reason) for o in out[False]]
    assert out[True][0].outputs[0].stop_reason == "Paris"


def test_placeholders_fed_from_the_step_before_and_aborts_in_flight():
    llm = LLM("llama-tiny", **SMALL, async_scheduling=True)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for rid, p in zip("abc", random_prompts([9, 17, 4], seed=3)):
        engine.add_request(rid, {"prompt_token_ids": p}, params)
    engine.step()
    # after the call, each sampled sequence ends with a placeholder until the next call
    assert all(r.seq.token_ids[-1] == PLACEHOLDER for r in engine.requests.values())
    engine.step()
    assert engine.abort_request("b")  # its token of the step in flight is dropped
    done = []
    while engine.has_unfinished_requests():
        done += engine.step()
    assert sorted(o.request_id for o in done) == ["a", "c"]
    assert all(PLACEHOLDER not in o.outputs[0].token_ids and len(o.outputs[0].token_ids) == 30
               for o in done)
    ref = LLM("llama-tiny", **SMALL, async_scheduling=False).generate(
        _ids(random_prompts([9, 17, 4], seed=3)), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in done] == [ref[0].outputs[0].token_ids,
                                                       ref[2].outputs[0].token_ids]
    assert _all_blocks_free(llm)


GREEDY3 = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def _a_finished_in_flight():
    """An async engine whose request "a" finished by length in the step still in flight (its
    output comes from the next step)."""
    llm = LLM("llama-tiny", **SMALL, async_scheduling=True)
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, GREEDY3)
    while not engine.requests["a"].seq.is_finished:
        engine.step()
    return llm, engine


def test_an_aborted_id_can_run_again_while_its_last_step_is_in_flight():
    # "a" finished by length in the step in flight; aborted, then added again: the old output
    # is dropped and the new "a" runs to its own end (it once came back with a placeholder and
    # left the engine raising KeyError on every step)
    llm, engine = _a_finished_in_flight()
    assert engine.abort_request("a")
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": [9, 9, 9, 9]}, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.prompt_token_ids for o in outputs] == [[9, 9, 9, 9]]
    alone = LLM("llama-tiny", **SMALL).generate({"prompt_token_ids": [9, 9, 9, 9]}, params, use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert _all_blocks_free(llm)


def test_streams_end_with_the_engine_idle():
    # a stream stopped early, or ended by its stop token while its next decode was in flight,
    # leaves no request behind: the next stream, score() and generate() run
    llm = LLM("llama-tiny", **SMALL, async_scheduling=True)
    p = {"prompt_token_ids": list(range(1, 10))}
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=20, ignore_eos=True)
    full = llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids
    for i, _ in enumerate(llm.stream(p, params)):
        if i == 2:
            break
    k = next(i for i, t in enumerate(full) if i >= 3 and t not in full[:i])
    stop = SamplingParams(temperature=1.0, seed=1, max_tokens=20, stop_token_ids=[full[k]])
    pieces = list(llm.stream(p, stop))
    assert pieces[-1].finished and pieces[-1].output.outputs[0].token_ids == full[:k + 1]
    assert sum((x.token_ids for x in pieces), []) == full[:k + 1]
    assert llm.score([1, 2, 3]).shape[0] == 3
    assert llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids == full
    assert _all_blocks_free(llm) and not llm.llm_engine.has_unfinished_requests()


def test_a_stream_whose_request_is_taken_away_raises_and_generate_waits_for_idle():
    llm = LLM("llama-tiny", **SMALL, async_scheduling=False)
    stream = llm.stream({"prompt_token_ids": [5, 6, 7]}, GREEDY3)
    next(stream)
    with pytest.raises(RuntimeError, match="generate\\(\\) runs on an idle engine"):
        llm.generate({"prompt_token_ids": [8, 9]}, GREEDY3, use_tqdm=False)
    rid = next(iter(llm.llm_engine.requests))
    llm.llm_engine.abort_request(rid)
    with pytest.raises(RuntimeError, match="finished or aborted outside the stream"):
        next(stream)
    assert llm.generate({"prompt_token_ids": [8, 9]}, GREEDY3, use_tqdm=False)[0].outputs[0].token_ids
    assert _all_blocks_free(llm)


def test_a_launch_that_raises_keeps_the_step_in_flight():
    # the step launched before keeps its tokens: "a"'s output still comes
    llm, engine = _a_finished_in_flight()
    engine.add_request("b", {"prompt_token_ids": [8, 9]}, GREEDY3)
    launch = engine.runner.launch

    def boom(*a, **k):
        raise KeyboardInterrupt

    engine.runner.launch = boom
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    engine.runner.launch = launch
    engine.abort_request("b")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.request_id for o in outputs] == ["a"] and not engine.requests
    assert len(outputs[0].outputs[0].token_ids) == 3
