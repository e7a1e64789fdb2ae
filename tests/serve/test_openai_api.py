"""The official openai client against a real uvicorn server: completions and chat, streamed and not,
against the offline LLM's greedy outputs; usage, finish reasons, stop strings, seeds, concurrency."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import openai
import pytest

from tqattn import LLM, SamplingParams

from .conftest import TINY_ARGS, wait_idle

PROMPTS = ["Hello there", "The capital of France is", "1, 2, 3,", "Once upon a time", "def f(x):",
           "Paris Rome Berlin", "a b c d e", "The quick brown fox"]


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    return LLM(tiny_model_dir, **TINY_ARGS)


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="none", max_retries=0)


def _stream_completion(client, model, **kw):
    chunks = list(client.completions.create(model=model, stream=True,
                                            stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert not chunks[-1].choices and chunks[-1].usage is not None  # the usage chunk comes last
    return text, reasons, chunks[-1].usage


def test_models_health_metrics(tiny_server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [tiny_server.model_name]
    with urllib.request.urlopen(tiny_server.url + "/health") as r:
        assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}
    client.completions.create(model=tiny_server.model_name, prompt="Hi", max_tokens=3, temperature=0)
    with urllib.request.urlopen(tiny_server.url + "/metrics") as r:
        text = r.read().decode()
    samples = {line.split("{")[0]: line for line in text.splitlines() if line and not line.startswith("#")}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "num_preemptions_total", "time_to_first_token_seconds_bucket",
                 "time_per_output_token_seconds_count", "engine_step_seconds_count",
                 "engine_cudagraph_steps_total", "compilations_after_startup"):
        assert f"tqattn:{name}" in samples, name
    assert float(samples["tqattn:generation_tokens_total"].split()[-1]) >= 3
    assert float(samples["tqattn:engine_step_seconds_count"].split()[-1]) >= 3  # prefill + 2 decodes
    assert "# TYPE tqattn:time_to_first_token_seconds histogram" in text


def test_completions_match_offline_greedy(tiny_server, client, offline):
    sp = SamplingParams(temperature=0, max_tokens=12)
    expected = offline.generate(PROMPTS[:3], sp, use_tqdm=False)
    for prompt, exp in zip(PROMPTS[:3], expected):
        r = client.completions.create(model=tiny_server.model_name, prompt=prompt, max_tokens=12, temperature=0)
        c = exp.outputs[0]
        assert r.choices[0].text == c.text and r.choices[0].finish_reason == c.finish_reason
        assert r.usage.prompt_tokens == len(exp.prompt_token_ids)
        assert r.usage.completion_tokens == len(c.token_ids) and r.usage.total_tokens == \
            len(exp.prompt_token_ids) + len(c.token_ids)
        text, reasons, use = _stream_completion(client, tiny_server.model_name, prompt=prompt, max_tokens=12,
                                                temperature=0)
        assert text == c.text and reasons == [c.finish_reason] and use == r.usage
    # token-id prompts are the same request
    ids = expected[0].prompt_token_ids
    r = client.completions.create(model=tiny_server.model_name, prompt=ids, max_tokens=12, temperature=0)
    assert r.choices[0].text == expected[0].outputs[0].text
    wait_idle(tiny_server)


def test_chat_matches_offline_greedy(tiny_server, client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    exp = offline.chat(messages, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    r = client.chat.completions.create(model=tiny_server.model_name, messages=messages, max_tokens=10,
                                       temperature=0)
    assert r.choices[0].message.content == exp.outputs[0].text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(exp.prompt_token_ids) and r.usage.completion_tokens == 10
    assert r.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(
        model=tiny_server.model_name, messages=messages, max_completion_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == exp.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices
    # without include_usage no usage chunk
    chunks = list(client.chat.completions.create(model=tiny_server.model_name, messages=messages,
                                                 max_tokens=4, temperature=0, stream=True))
    assert all(c.choices and c.usage is None for c in chunks)


def test_stop_strings_and_stop_tokens(tiny_server, client, offline):
    model = tiny_server.model_name
    full = offline.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    text, ids = full.outputs[0].text, full.outputs[0].token_ids
    stop = text[len(text) // 2:len(text) // 2 + 3]  # three characters from the middle of the reply
    assert len(stop) == 3
    r = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[:text.index(stop)]
    streamed, reasons, _ = _stream_completion(client, model, prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                              stop=stop)
    assert streamed == r.choices[0].text and reasons == ["stop"]
    # a stop token (vLLM's extension): the reply ends with it
    r = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                  extra_body={"stop_token_ids": [ids[3]]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == ids.index(ids[3]) + 1
    wait_idle(tiny_server)


def test_seed_reproducible(tiny_server, client):
    kw = dict(model=tiny_server.model_name, prompt="Once", max_tokens=12, temperature=1.0)
    a = client.completions.create(seed=7, **kw).choices[0].text
    b = client.completions.create(seed=7, **kw).choices[0].text
    c = client.completions.create(seed=8, **kw).choices[0].text
    streamed, _, _ = _stream_completion(client, seed=7, **kw)
    assert a == b == streamed and c != a
    greedy = client.completions.create(**{**kw, "temperature": 0}).choices[0].text
    k1 = client.completions.create(seed=3, extra_body={"top_k": 1}, **kw).choices[0].text
    assert k1 == greedy  # top_k=1 samples the argmax


def test_concurrent_requests_each_get_their_own_output(tiny_server, offline):
    sp = SamplingParams(temperature=0, max_tokens=10)
    expected = {p: o.outputs[0].text for p, o in zip(PROMPTS, offline.generate(PROMPTS, sp, use_tqdm=False))}
    client = openai.AsyncOpenAI(base_url=tiny_server.url + "/v1", api_key="none", max_retries=0)

    async def one(prompt, stream):
        kw = dict(model=tiny_server.model_name, prompt=prompt, max_tokens=10, temperature=0)
        if not stream:
            return (await client.completions.create(**kw)).choices[0].text
        chunks = await client.completions.create(stream=True, **kw)
        return "".join([c.choices[0].text async for c in chunks if c.choices])

    async def main():
        try:
            return await asyncio.gather(*(one(p, i % 2 == 1) for i, p in enumerate(PROMPTS * 2)))
        finally:
            await client.close()

    got = asyncio.run(main())
    assert got == [expected[p] for p in PROMPTS * 2]
    wait_idle(tiny_server)
