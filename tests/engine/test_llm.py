"""The offline API on tiny random models (fp32, CPU): equality with transformers, scheduling
invariance, sampling, stop conditions, abort, and the errors that say what to change."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from tqattn import LLM, SamplingParams  # noqa: E402
from tqattn.engine.scheduler import Scheduler  # noqa: E402
from tqattn.models import load_model  # noqa: E402

from .test_llm_reference import _one_thread, hf_greedy, random_prompts  # noqa: E402,F401

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SMALL = dict(load_format="dummy", max_model_len=128, max_num_seqs=4)


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _ids(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def _all_blocks_free(llm):
    bm = llm.llm_engine.block_manager
    bm.check_invariants([])
    return all(bm.num_free_blocks(g) == n for g, n in enumerate(bm.num_blocks))


@pytest.mark.parametrize("name", ["llama-tiny", "qwen2-tiny", "qwen3-tiny", "gemma3-tiny"])
def test_greedy_equals_transformers_generate(name):
    llm = LLM(name, **SMALL)
    prompts = random_prompts([3, 16, 17, 40])  # block-boundary lengths; gemma3's window is 8
    outputs = llm.generate(_ids(prompts), GREEDY, use_tqdm=False)
    hf = load_model(name, load_format="dummy")
    assert _tokens(outputs) == [hf_greedy(hf, p, 12) for p in prompts]
    for o, p in zip(outputs, prompts):
        assert o.prompt_token_ids == p and o.prompt is None and o.finished
        assert o.outputs[0].finish_reason == "length" and o.outputs[0].text == ""
    assert _all_blocks_free(llm)


SHARED = random_prompts([40], seed=7)[0]
PROMPTS = [SHARED[:35] + p for p in random_prompts([6, 19], seed=3)] + random_prompts([50, 5], seed=4)


@pytest.mark.parametrize("config", [
    dict(enable_chunked_prefill=True, max_num_batched_tokens=16),  # prompts in several chunks
    dict(enable_prefix_caching=False),
    dict(max_num_seqs=1),  # one request at a time
    dict(num_gpu_blocks_override=8),  # 128 tokens for 4 requests of up to 62: preemption
    dict(num_gpu_blocks_override=8, enable_prefix_caching=False),  # ... recomputed from scratch
])
def test_auto_outputs_do_not_depend_on_scheduling(config, monkeypatch):
    if "num_gpu_blocks_override" in config:  # admission without a reserve for growth: preemptions
        monkeypatch.setattr(Scheduler, "_fits_with_reserve", lambda *a: True)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    base = LLM("gemma3-tiny", **SMALL)
    expected = _tokens(base.generate(_ids(PROMPTS), params, use_tqdm=False))
    # again: every prompt now continues from its cached full blocks
    out = base.generate(_ids(PROMPTS), params, use_tqdm=False)
    assert _tokens(out) == expected
    assert [o.num_cached_tokens for o in out] == [32, 48, 48, 0]

    llm = LLM("gemma3-tiny", **{**SMALL, **config})
    outputs = llm.generate(_ids(PROMPTS), params, use_tqdm=False)
    assert _tokens(outputs) == expected
    if "num_gpu_blocks_override" in config:
        assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert _all_blocks_free(llm)


def test_abort_frees_blocks():
    llm = LLM("llama-tiny", **SMALL)
    engine = llm.llm_engine
    for rid, p in zip("abc", random_prompts([30, 20, 10])):
        engine.add_request(rid, {"prompt_token_ids": p}, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    bm = engine.block_manager
    free_before = bm.num_free_blocks()
    assert engine.abort_request("b")
    assert bm.num_free_blocks() == free_before + 2  # 20 + 1 tokens = 2 blocks
    assert not engine.abort_request("b")
    assert engine.abort_request("a") and engine.abort_request("c")
    assert not engine.has_unfinished_requests()
    assert _all_blocks_free(llm)


def test_prompt_forms_and_order():
    llm = LLM("qwen3-tiny", **SMALL)
    prompts = random_prompts([9, 4, 12])
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 7, 1)]
    outputs = llm.generate(_ids(prompts), params, use_tqdm=True)
    assert [len(t) for t in _tokens(outputs)] == [3, 7, 1]
    single = llm.generate({"prompt_token_ids": prompts[1]}, params[1])
    assert _tokens(single) == [_tokens(outputs)[1]]
    m = outputs[1].metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate(_ids(prompts), params[:2])
    assert not llm.llm_engine.has_unfinished_requests()


def test_sampling():
    llm = LLM("llama-tiny", **SMALL)
    prompts = _ids(random_prompts([10, 10, 7], seed=5))
    greedy = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    top1 = SamplingParams(temperature=0.8, top_k=1, max_tokens=12, ignore_eos=True)
    assert _tokens(llm.generate(prompts, top1, use_tqdm=False)) == greedy
    tiny_p = SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=12, ignore_eos=True)
    assert _tokens(llm.generate(prompts, tiny_p, use_tqdm=False)) == greedy
    # a temperature too small to scale logits by in fp32 is its limit, the argmax; a top_k past
    # the vocabulary (even past int64) is the whole vocabulary
    cold = SamplingParams(temperature=1e-300, seed=0, max_tokens=12, ignore_eos=True)
    assert _tokens(llm.generate(prompts, cold, use_tqdm=False)) == greedy
    wide = [SamplingParams(temperature=1.0, top_k=k, seed=3, max_tokens=12, ignore_eos=True)
            for k in (0, 2**70)]
    assert _tokens(llm.generate(prompts[:1] * 2, wide, use_tqdm=False)) == \
        _tokens(llm.generate(prompts[:1], wide[0], use_tqdm=False)) * 2

    seeded = [SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True) for s in (1, 1, 2)]
    a = _tokens(llm.generate(prompts, seeded, use_tqdm=False))
    # a seeded request gives the same tokens whatever it is batched with
    b = _tokens(llm.generate(prompts[2:] + prompts[:1], [seeded[2], seeded[0]], use_tqdm=False))
    assert b == [a[2], a[0]]
    # equal seeds on one prompt in one batch: the same draws
    twin = _tokens(llm.generate(prompts[:1] * 2, seeded[:2], use_tqdm=False))
    assert twin == [a[0], a[0]]
    assert a[0] != greedy[0] and a[0] != a[2]
    # unseeded sampling uses the engine's generator: different draws each time
    free = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    assert _tokens(llm.generate(prompts[:1], free, use_tqdm=False)) != \
        _tokens(llm.generate(prompts[:1], free, use_tqdm=False))


def test_top_k_top_p_mask():
    from tqattn.engine.sampling import _top_k_top_p

    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0], [0.0, 0.0, 10.0, 0.0]])
    masked = _top_k_top_p(logits, [2, 0], [1.0, 0.5])
    assert torch.isinf(masked[0, 2:]).all() and torch.equal(masked[0, :2], logits[0, :2])
    assert torch.isfinite(masked[1]).tolist() == [False, False, True, False]
    p = torch.softmax(torch.tensor([2.0, 1.0, 0.5, 0.0]), -1)
    # top_p = 0.7 keeps the tokens until the kept mass reaches 0.7
    kept = torch.isfinite(_top_k_top_p(p.log()[None], [0], [0.7])[0])
    assert kept.tolist() == [True, True, False, False] and p[0] < 0.7 <= p[:2].sum()


class _CharTokenizer:
    """A stand-in tokenizer: token t is the letter 'a' + t % 26, token 2 is the eos."""
    eos_token_id = 2
    chat_template = None

    def encode(self, text, add_special_tokens=True):
        return [3 + (ord(c) - 97) % 26 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + t % 26) for t in ids if not (skip_special_tokens and t == 2))


def test_stop_conditions():
    llm = LLM("llama-tiny", **SMALL)
    llm.llm_engine.tokenizer = _CharTokenizer()
    prompt = {"prompt_token_ids": random_prompts([8], seed=11)[0]}
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    assert len(full.text) == 20 and full.finish_reason == "length"

    stop = full.text[5:7]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, stop=[stop, "#"]))[0].outputs[0]
    cut = full.text.index(stop)
    assert out.text == full.text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == full.token_ids[:cut + 2]  # generation stopped where the stop string ended

    tok = full.token_ids[4]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[tok]))[0].outputs[0]
    i = full.token_ids.index(tok)
    assert out.token_ids == full.token_ids[:i + 1] and out.stop_reason == tok and out.finish_reason == "stop"
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[tok],
                                              min_tokens=i + 2))[0].outputs[0]
    assert out.token_ids[:i + 1] == full.token_ids[:i + 1] and len(out.token_ids) > i + 1

    text = llm.generate("hello", SamplingParams(temperature=0, max_tokens=3))[0]
    assert text.prompt == "hello" and text.prompt_token_ids == _CharTokenizer().encode("hello")


def test_sampling_params_validation():
    for kwargs, match in [(dict(temperature=-1), "temperature.*-1"), (dict(top_p=0), "top_p.*0"),
                          (dict(top_k=-3), "top_k.*-3"), (dict(max_tokens=0), "max_tokens.*0"),
                          (dict(min_tokens=5, max_tokens=2), "min_tokens \\(5\\)"),
                          (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids.*-1"),
                          (dict(seed="x"), "seed.*'x'"), (dict(seed=2**64), "seed.*18446744073709551616"),
                          (dict(seed=-2**63 - 1), "seed.*-9223372036854775809"),
                          (dict(temperature=float("inf")), "finite.*inf"),
                          (dict(temperature=float("nan")), "finite.*nan"),
                          (dict(ignore_eos="false"), "ignore_eos must be True or False, got 'false'"),
                          (dict(skip_special_tokens=None), "skip_special_tokens.*None"),
                          (dict(stop_token_ids="5"), "stop_token_ids.*'5'"),
                          (dict(stop_token_ids=5.0), "stop_token_ids.*5.0")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kwargs)
    assert SamplingParams(stop="x", top_k=-1).stop == ["x"]
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1 and SamplingParams(seed=-2**63).seed == -2**63
    assert SamplingParams(stop_token_ids=5).stop_token_ids == [5]
    # vLLM's options this sampler lacks: accepted at their neutral values, refused otherwise
    neutral = SamplingParams(n=1, best_of=None, presence_penalty=0.0, repetition_penalty=1.0, logprobs=None)
    assert neutral == SamplingParams()
    for kwargs, match in [(dict(n=2), "n=2 is not supported.*only 1"),
                          (dict(presence_penalty=0.5), "presence_penalty=0.5"),
                          (dict(logprobs=5), "logprobs=5.*LLM.score"), (dict(min_p=0.1), "min_p=0.1")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kwargs)
    assert SamplingParams(stop_token_ids=iter((3, 4))).stop_token_ids == [3, 4]


def test_a_request_refused_leaves_nothing_behind(monkeypatch):
    # whatever fails while a request is added (here its generator), the engine holds no trace of
    # it: the next steps run the other requests, and abort_all clears even a stray sequence
    import tqattn.engine.llm_engine as llm_engine

    llm = LLM("llama-tiny", **SMALL)
    engine = llm.llm_engine

    def broken(seed, device):
        raise RuntimeError("no generator")

    monkeypatch.setattr(llm_engine, "make_generator", broken)
    with pytest.raises(RuntimeError, match="no generator"):
        engine.add_request("bad", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(seed=1))
    monkeypatch.undo()
    assert not engine.has_unfinished_requests()
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 12
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, GREEDY)
    engine.step()
    engine.requests.pop("a")   # the state a failed step could leave: a sequence without a request
    assert engine.abort_all() == 1 and not engine.has_unfinished_requests()
    assert _all_blocks_free(llm)


def test_errors_say_what_to_change(tmp_path):
    llm = LLM("llama-tiny", **SMALL)
    with pytest.raises(ValueError, match="no tokenizer.*prompt_token_ids"):
        llm.generate("hello")
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="prompt \\(130 tokens\\).*max_model_len=128"):
        llm.generate({"prompt_token_ids": [5] * 130}, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="\\[300\\] are not ints in \\[0, 256\\)$"):
        llm.generate({"prompt_token_ids": [5, 300]})
    with pytest.raises(ValueError, match="are not ints in \\[0, 256\\) \\(text where token ids go"):
        llm.score(["The capital of France"])
    # in a batch the error names the prompt by its place in the list, not by an engine id
    with pytest.raises(ValueError, match="^prompts\\[1\\]: prompt \\(130 tokens\\)"):
        llm.generate([{"prompt_token_ids": [5]}, {"prompt_token_ids": [5] * 130}], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="a list of token ids is one prompt"):
        llm.generate([5, 6, 7])
    with pytest.raises(ValueError, match="^prompts: .*got 123$"):
        llm.generate(123)
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in \\(0, 1\\], got '0.9'"):
        LLM("llama-tiny", **SMALL, gpu_memory_utilization="0.9")

    with pytest.raises(ValueError, match="max_model_len=128 tokens needs 8 blocks.*raise num_gpu_blocks_override"):
        LLM("llama-tiny", **SMALL, num_gpu_blocks_override=4)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes=1000 holds 0 blocks.*raise kv_cache_memory_bytes"):
        LLM("llama-tiny", **SMALL, kv_cache_memory_bytes=1000)
    with pytest.raises(ValueError, match="kv_cache_dtype='int3'.*turboquant_k3v4_nc"):
        LLM("llama-tiny", **SMALL, kv_cache_dtype="int3")
    with pytest.raises(FileNotFoundError, match="no such file or directory: /nope"):
        LLM("/nope", **SMALL)
    with pytest.raises(ValueError, match="dtype='fp8'"):
        LLM("llama-tiny", **SMALL, dtype="fp8")

    cfg = json.loads(open(load_model.__globals__["model_config_path"]("llama-tiny")).read())
    cfg.update(head_dim=6, hidden_size=24)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="head size 6.*kv_cache_dtype='turboquant_k3v4_nc'.*pick another preset"):
        LLM(str(tmp_path), **{**SMALL, "kv_cache_dtype": "turboquant_k3v4_nc"})
