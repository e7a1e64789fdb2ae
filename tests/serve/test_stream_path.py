"""The serving hot path: incremental detokenization equals the full decode, a reader that falls
behind gets the piled-up pieces as one (errors after them, in order), the engine thread hands the
loop one batch per step, and `tqattn bench serve`'s client, its server counters and its engine
arguments (the same as the offline chat workload's)."""

from __future__ import annotations

import asyncio
import multiprocessing
import random
import shlex
import sys
import types

import pytest

from tqattn.engine.outputs import CompletionOutput, RequestOutput
from tqattn.engine.sampling import SamplingParams
from tqattn.engine.streaming import Detokenizer, IncrementalOutput, StreamOutput
from tqattn.serve.async_engine import AsyncEngine, EngineError, EngineStopped, RequestStream
from tqattn.serve.engine_loop import EngineLoop

from .conftest import make_engine

TEXT = ("Streaming text: naïve café, Überprüfung, 東京タワー, emoji 🙂👍🏽 and\tnew\nlines; "
        "code: def f(x): return x ** 2  # done.")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


class _SlowTokenizer:
    """A tokenizer without a tokenizers backend: the detokenizer decodes everything each time."""

    def __init__(self, tok):
        self.tok = tok

    def decode(self, ids, skip_special_tokens=True):
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("backend", [True, False])
def test_incremental_detokenization_equals_the_full_decode(tokenizer, skip_special_tokens, backend):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    eos = tokenizer.eos_token_id
    k = next(k for k in range(9, len(ids)) if not tokenizer.decode(ids[:k]).endswith("\ufffd"))
    ids = ids[:k] + [eos] + ids[k:] + [eos]  # special tokens inside (between characters) and at the end
    full = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    tok = tokenizer if backend else _SlowTokenizer(tokenizer)
    assert (Detokenizer(tok)._stream is not None) == backend  # the path under test
    rng = random.Random(0)
    inc = IncrementalOutput("r", tokenizer=tok, skip_special_tokens=skip_special_tokens)
    streamed, sent, i = "", [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        piece = inc.add_tokens(ids[i:i + n])
        i += n
        if piece is not None:
            streamed += piece.text
            sent += piece.token_ids
            assert full.startswith(streamed) and "\ufffd" not in piece.text
    assert sent == ids
    last = inc.finish(RequestOutput("r", None, [1], [CompletionOutput(0, full, ids, "length")], True))
    assert last.text == "" and streamed == full  # everything was sent before the end


def _stream(pieces_then_error=()):
    aborted = []
    engine = types.SimpleNamespace(tokenizer=None, abort=aborted.append)
    loop = asyncio.get_running_loop()
    stream = RequestStream(engine, "r", SamplingParams(), loop)
    for item in pieces_then_error:
        stream.put(item)
    return stream, aborted


def test_a_reader_behind_gets_the_pieces_merged_and_errors_after_them():
    out = RequestOutput("r", None, [1], [CompletionOutput(0, "abcd", [1, 2, 3, 4], "length")], True)

    async def main():
        stream, _ = _stream([StreamOutput("r", "a", [1]), StreamOutput("r", "bc", [2, 3]),
                             EngineError("boom"), StreamOutput("r", "never", [9])])
        p = await anext(stream)
        assert (p.text, p.token_ids, p.finished) == ("abc", [1, 2, 3], False)
        with pytest.raises(EngineError, match="boom"):
            await anext(stream)
        assert stream.finished
        with pytest.raises(StopAsyncIteration):
            await anext(stream)

        stream, aborted = _stream([StreamOutput("r", "ab", [1, 2])])
        waiter = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        p = await waiter  # was there before the reader asked
        assert p.text == "ab"
        waiter = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        assert not waiter.done()  # nothing pending: the reader waits
        stream.put(StreamOutput("r", "c", [3]))
        stream.put(StreamOutput("r", "d", [4], finished=True, finish_reason="length", output=out))
        p = await waiter
        assert (p.text, p.token_ids, p.finished, p.finish_reason, p.output) == ("cd", [3, 4], True, "length", out)
        stream.abort()  # finished: nothing to abort
        assert aborted == []
        async for _ in stream:
            raise AssertionError("a finished stream yields nothing more")

    asyncio.run(main())


def _both_ends(engine):
    """The server's engine loop and its AsyncEngine over the two pipes, both in this process,
    started; and the function that stops them."""
    commands_in, commands_out = multiprocessing.Pipe(duplex=False)
    events_in, events_out = multiprocessing.Pipe(duplex=False)
    engine_loop = EngineLoop(engine, events_out, commands_in)
    async_engine = AsyncEngine(commands_out, events_in, engine.tokenizer, 256)
    engine_loop.start()
    async_engine.start()

    def close():
        engine_loop.shutdown()
        commands_out.close()
        engine_loop.close()
    return engine_loop, async_engine, close


def test_the_engine_thread_hands_the_loop_one_batch_per_step(tiny_model_dir):
    """8 concurrent requests of 12 tokens, both ends of the server's pipes in this process: the
    loop is called at most once per engine step (and once per accepted request), not once per
    token; each stream gets its request's tokens."""
    engine = make_engine(tiny_model_dir)
    engine_loop, async_engine, close = _both_ends(engine)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    calls = []

    async def main():
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a, **k: calls.append(a[0]) or real(*a, **k)

        async def one(i):
            stream = await async_engine.add_request({"prompt_token_ids": [5 + i, 6, 7]}, params)
            tokens, last = [], None
            async for piece in stream:
                tokens += piece.token_ids
                last = piece
            return tokens, last.output.outputs[0].token_ids

        out = await asyncio.gather(*(one(i) for i in range(8)))
        return out, len(calls)

    try:
        results, num_calls = asyncio.run(main())
    finally:
        close()
    for tokens, final in results:
        assert len(tokens) == 12 and tokens == final
    assert num_calls <= 8 + engine_loop.num_steps < 8 * 12, (num_calls, engine_loop.num_steps)
    assert async_engine.num_steps == engine_loop.num_steps
    assert engine.block_manager.usage == 0


def test_waiting_count_leaves_free_slots_to_unanswered_adds():
    # the adds the engine has not answered yet take its free slots before they count as waiting
    eng = AsyncEngine(None, None, None, 256, max_waiting_requests=2, max_num_seqs=4)
    for running, waiting, pending, expect in [(0, 0, 5, 1), (3, 0, 2, 1), (4, 0, 1, 1), (0, 0, 4, 0),
                                              (2, 3, 1, 4)]:   # some wait already: no slot is free
        eng.num_running, eng.num_waiting, eng._pending = running, waiting, pending
        assert eng.num_waiting_for_slot() == expect, (running, waiting, pending)
    eng.max_num_seqs = None
    assert eng.num_waiting_for_slot() == 4


def test_a_failed_step_fails_what_runs_and_the_engine_serves_on(tiny_model_dir):
    """A step that raises, leaving a sequence the engine has no request for (what an add that
    failed halfway once left): the running request fails with the error, nothing stays in the
    engine, the next request completes; on shutdown a running request fails as EngineStopped."""
    engine = make_engine(tiny_model_dir)
    real_step, steps = engine.step, []

    def step():
        steps.append(1)
        if len(steps) == 3:
            engine.requests.clear()
            raise RuntimeError("boom")
        return real_step()

    engine.step = step
    engine_loop, async_engine, close = _both_ends(engine)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def run(prompt, p=params):
        stream = await async_engine.add_request({"prompt_token_ids": prompt}, p)
        tokens = []
        async for piece in stream:
            tokens += piece.token_ids
        return tokens

    async def main():
        with pytest.raises(EngineError, match="the engine failed: RuntimeError: boom") as failed:
            await run([5, 6, 7])
        assert not isinstance(failed.value, EngineStopped)
        assert len(await run([8, 9])) == 8
        long = asyncio.ensure_future(run([5, 6], SamplingParams(max_tokens=200, ignore_eos=True)))
        while not async_engine.num_running:
            await asyncio.sleep(0.01)
        await asyncio.get_running_loop().run_in_executor(None, engine_loop.shutdown)
        with pytest.raises(EngineStopped, match="shutting down"):
            await long

    try:
        asyncio.run(main())
    finally:
        close()
    assert not engine.has_unfinished_requests() and engine.block_manager.usage == 0


def test_bench_serve_client_and_server_counters(tiny_server):
    from tqattn.benchmarks.serve import format_server_table, run_load, scrape, server_stats

    before = scrape(tiny_server.url)
    m = asyncio.run(run_load(tiny_server.url, None, 8, 24, 6))
    st = server_stats(before, scrape(tiny_server.url))
    assert m["completed"] == 8 and m["output_tokens"] == 48 and not m["failed"]
    assert m["ttft_s"]["p50"] > 0 and m["tpot_s"]["p50"] > 0
    assert st["generation_tokens"] == 48 and 6 <= st["steps"] <= 60 and st["mean_step_ms"] > 0
    assert st["compilations_after_startup"] == 0 and st["cudagraph_steps"] == 0  # CPU: eager, no graphs
    m["server"], m["gpu"] = st, {"before": {"gpus": [{"processes": [{"pid": 1}, {"pid": 2}]}]}, "after": None}
    table = format_server_table([{"kv_cache_dtype": "auto", "metrics": m}]).splitlines()
    assert table[2].split()[:2] == ["auto", str(st["steps"])] and table[2].endswith(" 2/n/a")


def test_dechunk_at_every_split():
    from tqattn.benchmarks.serve import _Dechunk

    events = [b"data: {\"a\": 1}\n\n", b"data: " + b"x" * 300 + b"\n\n", b"data: [DONE]\n\n"]
    wire = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(e), e) if i == 1 else b"%x\r\n%s\r\n" % (len(e), e)
                    for i, e in enumerate(events)) + b"0\r\n\r\n"
    for cut in range(len(wire) + 1):
        d = _Dechunk()
        assert d.feed(wire[:cut]) + d.feed(wire[cut:]) == b"".join(events) and d.done


# the documented H200 commands (README, Serving): bench serve's --server-args and the offline run
H200_SERVER_ARGS = ("--model Qwen3-4B --load-format dummy --max-model-len 1280 --max-num-batched-tokens 8192 "
                    "--no-enable-prefix-caching --kv-cache-boundary-layers 0 --max-waiting-requests 1024")


def test_bench_serve_servers_get_the_offline_chat_engine_args(monkeypatch):
    from tqattn.benchmarks.cli import engine_kwargs_from_args
    from tqattn.benchmarks.serve import server_engine_args
    from tqattn.benchmarks.throughput import WORKLOADS
    from tqattn.cli import build_parser

    monkeypatch.setattr(sys, "argv", ["tqattn"])
    offline = engine_kwargs_from_args(build_parser().parse_args(
        ["bench", "throughput", "--workload", "chat", "--model", "Qwen3-4B"]), WORKLOADS["chat"])
    served = server_engine_args(shlex.split(H200_SERVER_ARGS), "turboquant_k3v4_nc")
    assert served.pop("model") == "Qwen3-4B" and served.pop("kv_cache_dtype") == "turboquant_k3v4_nc"
    assert served == offline
