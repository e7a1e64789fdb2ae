"""Bad input, disconnects, back-pressure and load against a real server: every bad request is a 4xx
in OpenAI's error body, the server stays up, and no cache block leaks."""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import threading
import time

import openai
import pytest

from .conftest import make_engine, wait_idle


def _post(server, path: str, body, raw: bool = False, method: str = "POST"):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    data = body if raw else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    out = r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    conn.close()
    return out


def _error(status_body):
    status, _, body = status_body
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return status, err


M = "tiny-smol"  # placeholder, replaced by the served name
C, CH = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
# (path, body, status, words the message must contain)
BAD = [
    (C, b"{not json", 400, ["not valid JSON"]),
    (C, b"[1, 2]", 400, ["JSON object"]),
    (C, {"prompt": "x", "max_tokens": "5"}, 400, ["max_tokens", "'5'"]),
    (C, {"prompt": "x", "temperature": "hot"}, 400, ["temperature"]),
    (C, {"prompt": 5}, 400, ["prompt"]),
    (C, {"max_tokens": 4}, 400, ["prompt", "Field required"]),
    (C, {"prompt": "x", "model": "gpt-4"}, 404, ["'gpt-4' does not exist"]),
    (C, {"prompt": ""}, 400, ["prompt is empty"]),
    (C, {"prompt": []}, 400, ["prompt is empty"]),
    (C, {"prompt": "x", "max_tokens": 0}, 400, ["max_tokens must be an integer >= 1, got 0"]),
    (C, {"prompt": "x", "max_tokens": 10_000}, 400, ["max_model_len=256"]),
    (C, {"prompt": [5] * 300, "max_tokens": 1}, 400, ["exceeds max_model_len=256"]),
    (C, {"prompt": [5, -1, 7]}, 400, ["[-1]", "[0, 49152)"]),
    (C, {"prompt": [5, 49152]}, 400, ["[49152]"]),
    (C, {"prompt": [5, 1.5]}, 400, ["prompt"]),
    (C, {"prompt": ["a", "b"]}, 400, ["batch of 2 prompts"]),
    (C, {"prompt": "x", "n": 2}, 400, ["n=2 is not supported"]),
    (C, {"prompt": "x", "logprobs": 1}, 400, ["logprobs=1 is not supported"]),
    (C, {"prompt": "x", "frequency_penalty": 0.5}, 400, ["frequency_penalty=0.5"]),
    (C, {"prompt": "x", "echo": True}, 400, ["echo=true"]),
    (C, {"prompt": "x", "foo": 1}, 400, ["unknown parameter 'foo'"]),
    (C, {"prompt": "x", "temperature": -1}, 400, ["temperature must be a finite number >= 0"]),
    (C, b'{"prompt": "x", "temperature": 1e400}', 400, ["temperature must be a finite number", "inf"]),
    (C, {"prompt": "x", "seed": 2**64}, 400, ["seed must be an integer in [", "18446744073709551616"]),
    (C, {"prompt": "x", "top_p": 0}, 400, ["top_p must be in (0, 1]"]),
    (C, {"prompt": "x", "stop": [""]}, 400, ["stop must be a non-empty string"]),
    (C, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, ["only allowed with stream=true"]),
    (C, {"prompt": "x", "min_tokens": 20, "max_tokens": 4}, 400, ["min_tokens (20) must be <= max_tokens (4)"]),
    (CH, {"messages": []}, 400, ["messages"]),
    (CH, {"messages": [{"role": "tool", "content": "x"}]}, 400, ["role"]),
    (CH, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]}, 400,
     ["messages"]),
    (CH, {"messages": MSG, "max_completion_tokens": 0}, 400, ["max_completion_tokens must be an integer >= 1"]),
    (CH, {"messages": MSG, "logprobs": True}, 400, ["logprobs=true is not supported"]),
    (CH, {"messages": MSG, "tools": [{"type": "function"}]}, 400, ["tools="]),
    (CH, {"messages": MSG, "max_tokens": 300}, 400, ["max_model_len=256"]),
    ("/v1/embeddings", {"input": "x"}, 404, ["no route POST /v1/embeddings"]),
]


@pytest.fixture(scope="module")
def small_cache_server(tiny_model_dir):
    # the smallest cache the engine accepts: one max_model_len sequence (a request can never be
    # too long for the cache and fit max_model_len: start-up refuses such a cache)
    from tqattn.serve.server import Server

    with Server(make_engine(tiny_model_dir, num_gpu_blocks_override=16, max_num_seqs=1), port=0,
                log_level="error", max_waiting_requests=1) as server:
        yield server


@pytest.mark.parametrize("path,body,status,words", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_input_is_4xx_with_openai_error(small_cache_server, path, body, status, words):
    raw = isinstance(body, bytes)
    got, err = _error(_post(small_cache_server, path, body, raw=raw))
    assert got == status, err
    for w in words:
        assert w in err["message"], err
    assert _post(small_cache_server, "/health", None, method="GET")[0] == 200


# (path, body, the error's param, its code): the field the client must change
PARAMS = [
    (C, {"prompt": "x", "seed": -2**63 - 1}, "seed", None),
    (C, {"prompt": "x", "stop_token_ids": [-3]}, "stop_token_ids", None),
    (C, {"prompt": "x", "max_tokens": 10_000}, "max_tokens", "context_length_exceeded"),
    (C, {"prompt": [5] * 300}, "prompt", "context_length_exceeded"),
    (CH, {"messages": MSG, "max_completion_tokens": 10_000}, "max_completion_tokens", "context_length_exceeded"),
    (CH, {"messages": [{"role": "user", "content": " x" * 300}]}, "messages", "context_length_exceeded"),
    (CH, {"messages": [{"role": "user", "content": [5]}]}, "messages.0.content", None),
    (C, {"prompt": "a\ud800b"}, "prompt", None),   # a lone surrogate: not text the tokenizer takes
    (CH, {"messages": [{"role": "user", "content": "\udfff"}]}, "messages.0.content", None),
]


@pytest.mark.parametrize("path,body,param,code", PARAMS, ids=[f"{i}" for i in range(len(PARAMS))])
def test_errors_name_the_field(small_cache_server, path, body, param, code):
    status, err = _error(_post(small_cache_server, path, body))
    assert (status, err["param"], err["code"]) == (400, param, code), err
    assert "request '" not in err["message"], err   # the engine's id means nothing to the client


def test_out_of_range_sampling_values_touch_no_other_request(small_cache_server):
    # a seed torch cannot take is refused before the engine holds the request, and a top_k
    # beyond the vocabulary is the whole vocabulary: both leave the engine serving
    assert _post(small_cache_server, C, {"prompt": "x", "seed": 2**70})[0] == 400
    status, _, body = _post(small_cache_server, C, {"prompt": "x", "max_tokens": 3, "top_k": 2**70,
                                                   "seed": 2**64 - 1, "ignore_eos": True})
    assert status == 200, body
    assert json.loads(body)["usage"]["completion_tokens"] == 3
    status, _, body = _post(small_cache_server, C, {"prompt": "x", "max_tokens": 2})
    assert status == 200, body


def test_neutral_values_of_unsupported_fields_are_accepted(small_cache_server):
    status, _, body = _post(small_cache_server, C, {"prompt": "x", "max_tokens": 2, "n": 1,
                                                    "frequency_penalty": 0, "presence_penalty": 0.0,
                                                    "logprobs": None, "echo": False, "user": "me"})
    assert status == 200, body
    assert _post(small_cache_server, C, {"prompt": "x"}, method="GET")[0] == 405


def test_fuzzed_bodies_never_500(small_cache_server):
    rng = random.Random(0)
    keys = ["prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "n",
            "stream", "model", "stream_options", "logprobs", "ignore_eos", "max_completion_tokens", "zzz"]

    def value(depth=0):
        kind = rng.randrange(9 if depth < 2 else 6)
        if kind < 6:
            return [None, True, rng.randint(-3, 300), rng.uniform(-2, 3),
                    rng.choice(["", "a", "x" * 50, "\u00e9\ud7ff"]),
                    [rng.randint(-2, 50000) for _ in range(rng.randint(0, 4))]][kind]
        if kind == 6:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        if kind == 7:
            return {rng.choice(keys): value(depth + 1) for _ in range(rng.randint(0, 3))}
        return [{"role": rng.choice(["user", "system", "bot"]), "content": value(depth + 1)}]

    statuses = []
    for i in range(120):
        path = rng.choice([C, CH])
        # a valid body with 0-2 fields replaced or added at random, or a random body
        body = ({"prompt": "x"} if path == C else {"messages": MSG}) if rng.random() < 0.7 else {}
        body["max_tokens"] = rng.randint(1, 3)
        for _ in range(rng.randint(0, 2) if body else rng.randint(1, 5)):
            body[rng.choice(keys)] = value()
        status, _, out = _post(small_cache_server, path, body)
        assert status < 500, (body, out)
        if status != 200 and not (b'"stream"' in out):  # every error is OpenAI's body
            _error((status, None, out))
        statuses.append(status)
    assert 400 in statuses and 200 in statuses
    wait_idle(small_cache_server)


def test_request_timeout_aborts(tiny_model_dir):
    from tqattn.serve.server import Server

    with Server(make_engine(tiny_model_dir, max_num_seqs=4), port=0, log_level="error",
                request_timeout=0.3) as server:
        body = {"prompt": "x", "max_tokens": 240, "ignore_eos": True}
        status, err = _error(_post(server, C, body))
        assert status == 408 and "timeout" in err["message"]
        status, _, raw = _post(server, C, {**body, "stream": True})
        events = [e for e in raw.decode().split("\n\n") if e]
        assert status == 200 and events[-1] == "data: [DONE]" and '"timeout_error"' in events[-2]
        wait_idle(server)


def _read_some_and_close(server, path, body, n_events: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    seen = 0
    while seen < n_events:
        line = r.fp.readline()
        seen += line.startswith(b"data: ")
    conn.sock.shutdown(2)
    conn.close()


def test_disconnect_mid_stream_aborts_and_frees_blocks(tiny_server):
    engine = tiny_server.engine
    free0 = engine.block_manager.num_free_blocks()
    before = tiny_server.engine_loop.num_aborted
    _read_some_and_close(tiny_server, C, {"prompt": "Hello", "max_tokens": 240, "ignore_eos": True,
                                          "stream": True}, 3)
    _read_some_and_close(tiny_server, CH, {"messages": MSG, "max_tokens": 200, "ignore_eos": True,
                                           "stream": True}, 3)
    # a non-streamed request whose client leaves
    conn = http.client.HTTPConnection("127.0.0.1", tiny_server.port, timeout=30)
    conn.request("POST", C, body=json.dumps({"prompt": "Hi", "max_tokens": 240, "ignore_eos": True}).encode(),
                 headers={"Content-Type": "application/json"})
    time.sleep(0.3)
    conn.sock.shutdown(2)
    conn.close()
    wait_idle(tiny_server)
    assert engine.block_manager.num_free_blocks() == free0
    assert tiny_server.engine_loop.num_aborted == before + 3


def _metric(server, name: str) -> float:
    text = _post(server, "/metrics", None, method="GET")[2].decode()
    return float(next(ln.split()[-1] for ln in text.splitlines() if ln.startswith(f"tqattn:{name}{{")))


def test_aborting_every_request_leaves_fresh_counts(small_cache_server):
    """max_num_seqs=1, max_waiting_requests=1: one request running, one waiting, both clients
    gone — the idle engine still reports the new counts, so /metrics is right and the next
    request is admitted (a stale waiting count would refuse every request from then on)."""
    aborted = _metric(small_cache_server, "request_aborted_total")
    body = json.dumps({"prompt": "x", "max_tokens": 240, "ignore_eos": True, "stream": True}).encode()
    conns = [http.client.HTTPConnection("127.0.0.1", small_cache_server.port, timeout=30) for _ in range(2)]
    conns[0].request("POST", C, body=body, headers={"Content-Type": "application/json"})
    first = conns[0].getresponse()
    while not first.fp.readline().startswith(b"data: "):   # it runs
        pass
    conns[1].request("POST", C, body=body, headers={"Content-Type": "application/json"})
    assert conns[1].getresponse().status == 200            # accepted: it waits behind the first
    waiting = _metric(small_cache_server, "num_requests_waiting")
    for c in conns[::-1]:
        c.sock.shutdown(2)
        c.close()
    wait_idle(small_cache_server)
    end = time.monotonic() + 5
    while _metric(small_cache_server, "num_requests_running") and time.monotonic() < end:
        time.sleep(0.05)
    assert _metric(small_cache_server, "num_requests_running") == 0
    assert _metric(small_cache_server, "num_requests_waiting") == 0
    assert _metric(small_cache_server, "kv_cache_usage_perc") == 0
    assert _metric(small_cache_server, "request_aborted_total") == aborted + 2
    status, _, out = _post(small_cache_server, C, {"prompt": "x", "max_tokens": 2})
    assert status == 200, out
    assert waiting == 1   # (read while both ran: the second request did wait)


def test_back_pressure_503_with_retry_after(small_cache_server):
    # max_num_seqs=1, max_waiting_requests=1: at most one request waits (accepted, not yet
    # running); the rest get 503 at once, and every accepted one completes
    results = []

    def one():
        results.append(_post(small_cache_server, C, {"prompt": "x", "max_tokens": 60, "ignore_eos": True}))

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = [r for r in results if r[0] == 200]
    busy = [r for r in results if r[0] == 503]
    assert len(ok) + len(busy) == 6 and ok and busy
    for status, headers, body in busy:
        assert headers.get("retry-after") == "1"
        assert "retry after" in json.loads(body)["error"]["message"]
    for _, _, body in ok:
        assert json.loads(body)["usage"]["completion_tokens"] == 60
    wait_idle(small_cache_server)


def test_load_with_disconnects(tiny_server):
    """64 concurrent streaming clients, 96 requests, a seeded third disconnecting mid-stream."""
    engine = tiny_server.engine
    rng = random.Random(1)
    n_requests, max_tokens = 96, 16
    leave = set(rng.sample(range(n_requests), n_requests // 3))
    client = openai.AsyncOpenAI(base_url=tiny_server.url + "/v1", api_key="none", max_retries=0)
    health_codes = []

    async def health(stop):
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            health_codes.append(await loop.run_in_executor(
                None, lambda: _post(tiny_server, "/health", None, method="GET")[0]))
            await asyncio.sleep(0.05)

    async def one(i, sem):
        async with sem:
            chunks = await client.completions.create(
                model=tiny_server.model_name, prompt=f"request {i}", max_tokens=max_tokens, temperature=0.8,
                seed=i, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            n = 0
            async for c in chunks:
                if c.choices and c.choices[0].text:
                    n += 1
                if i in leave and n == 2:
                    await chunks.close()
                    return None
                if c.usage is not None:
                    return c.usage.completion_tokens
            return -1

    async def main():
        stop = asyncio.Event()
        h = asyncio.ensure_future(health(stop))
        sem = asyncio.Semaphore(64)
        try:
            return await asyncio.gather(*(one(i, sem) for i in range(n_requests)))
        finally:
            stop.set()
            await h
            await client.close()

    t = time.monotonic()
    got = asyncio.run(main())
    elapsed = time.monotonic() - t
    assert [g for i, g in enumerate(got) if i not in leave] == [max_tokens] * (n_requests - len(leave))
    assert all(got[i] is None for i in leave)
    wait_idle(tiny_server)
    assert health_codes and set(health_codes) == {200}, health_codes
    assert elapsed < 60


def test_stop_ends_running_streams_and_the_front_end_process(tiny_model_dir):
    """Stopping the server mid-stream: the client's stream ends with an error event and [DONE],
    the front end process exits, every block is free; a taken port fails at construction."""
    from tqattn.serve.server import Server

    engine = make_engine(tiny_model_dir, max_num_seqs=4)
    server = Server(engine, port=0, log_level="error").start()
    try:
        with pytest.raises(OSError):
            Server(engine, port=server.port, log_level="error")
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request("POST", C, body=json.dumps({"prompt": "Hello", "max_tokens": 240, "ignore_eos": True,
                                                 "stream": True}).encode(),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200
        while not r.fp.readline().startswith(b"data: "):  # the first event (chunked encoding)
            pass
    finally:
        server.stop()
    rest = r.fp.read().decode()  # to the end, chunk sizes included
    conn.close()
    # the error event, then [DONE], then the chunked body's end
    error = rest.rfind('data: {"error": {"message": "the server is shutting down"')
    assert 0 <= error < rest.rfind("data: [DONE]\n\n") and rest.endswith("0\r\n\r\n"), rest[-300:]
    assert server._frontend.poll() is not None
    assert engine.block_manager.usage == 0 and not engine.has_unfinished_requests()


def test_the_server_stops_when_its_front_end_dies(tiny_model_dir):
    from tqattn.serve.server import Server

    engine = make_engine(tiny_model_dir, max_num_seqs=4)
    with Server(engine, port=0, log_level="error") as server:
        assert _post(server, "/health", None, method="GET")[0] == 200
        server._frontend.kill()
        t = time.monotonic()
        server.wait()  # returns: `tqattn serve` exits instead of serving nothing
        assert time.monotonic() - t < 5


def test_a_frozen_front_end_is_killed_on_stop(tiny_model_dir):
    """A front end that stops reading (SIGSTOP) while streams run: the engine may block on the
    full pipe, stop() still returns in bounded time, kills it, and frees every block."""
    import os
    import signal

    from tqattn.serve.server import Server

    engine = make_engine(tiny_model_dir, max_num_seqs=8)
    server = Server(engine, port=0, log_level="error").start()
    body = json.dumps({"prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}).encode()
    conns = []
    for _ in range(4):
        c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        c.request("POST", C, body=body, headers={"Content-Type": "application/json"})
        conns.append(c)
    assert all(c.getresponse().status == 200 for c in conns)
    os.kill(server._frontend.pid, signal.SIGSTOP)
    time.sleep(1.0)
    t = time.monotonic()
    server.stop(timeout=1.0)
    assert time.monotonic() - t < 10
    assert server._frontend.poll() is not None and not server.engine_loop.is_alive
    assert engine.block_manager.usage == 0 and not engine.has_unfinished_requests()
    for c in conns:
        c.close()
