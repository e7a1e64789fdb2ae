"""The command line: `tqattn serve` in a subprocess, `tqattn chat` through a pseudo-terminal,
`tqattn generate --stream`, and the embedded SmolLM2 behind the server."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from tqattn import LLM, SamplingParams
from tqattn.cli import chat_loop, main

from .conftest import needs_default_model

ROOT = Path(__file__).resolve().parents[2]


def _env():
    return dict(os.environ, PYTHONPATH=str(ROOT))


def test_serve_command_starts_logs_url_and_stops(tiny_model_dir):
    proc = subprocess.Popen(
        [sys.executable, "-m", "tqattn", "serve", "--model", tiny_model_dir, "--load-format", "dummy",
         "--max-model-len", "128", "--kv-cache-dtype", "tq_k4v3", "--port", "0",
         "--served-model-name", "tiny"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
    try:
        lines = []
        end = time.monotonic() + 120
        while time.monotonic() < end:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("serving "):
                break
        out = "".join(lines)
        assert "KV-cache plan:" in out and "tq_k4v3" in out, (out, proc.stderr.read() if proc.poll() else "")
        url = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", out).group(1)
        with urllib.request.urlopen(url + "/health") as r:
            assert r.status == 200
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = client.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0)
        assert r.usage.completion_tokens == 3
        proc.terminate()  # SIGTERM: a clean stop
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_command_bad_flag_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--port", "70000"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "expected a TCP port in [0, 65535], got '70000'" in err and err.count("\n") == 1


@pytest.mark.parametrize("value", ["nan", "inf", "0", "-1", "soon"])
def test_serve_command_bad_request_timeout_is_one_line(value, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--request-timeout", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"expected a finite number of seconds > 0, got {value!r}" in err and err.count("\n") == 1


def test_serve_command_binds_before_the_model_loads(monkeypatch, capsys):
    import tqattn.engine.llm_engine as llm_engine

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the port was bound")

    monkeypatch.setattr(llm_engine, "LLMEngine", refuse)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port), "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert f"could not serve on 127.0.0.1:{port}" in err and "Traceback" not in err, err


def test_generate_stream_prints_the_generate_text(tiny_model_dir, capsys):
    args = ["generate", "--model", tiny_model_dir, "--load-format", "dummy", "--max-model-len", "128",
            "--max-tokens", "8", "--no-chat", "Hello there"]
    assert main(args) == 0
    plain = capsys.readouterr().out.split(">>> Hello there\n", 1)[1].strip("\n")
    assert main([*args, "--stream"]) == 0
    streamed = capsys.readouterr().out.split(">>> Hello there\n", 1)[1].strip("\n")
    assert streamed == plain and plain
    with pytest.raises(SystemExit) as e:
        main([*args, "--stream", "--json"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_chat_loop_keeps_history(tiny_model_dir):
    from .conftest import TINY_ARGS

    llm = LLM(tiny_model_dir, **{**TINY_ARGS, "max_model_len": 256})
    sp = SamplingParams(temperature=0, max_tokens=6)
    lines = iter(["hello", "and again", "/reset", "hello"])
    written = []

    def read():
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    assert chat_loop(llm, sp, "Be brief.", read, written.append) == 0
    text = "".join(written)
    replies = [r.split("\n")[0] for r in text.split("assistant> ")[1:]]
    assert len(replies) == 3 and "(conversation cleared)" in text
    first = llm.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}], sp,
                     use_tqdm=False)[0].outputs[0].text
    second = llm.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"},
                       {"role": "assistant", "content": first}, {"role": "user", "content": "and again"}], sp,
                      use_tqdm=False)[0].outputs[0].text
    assert replies == [first, second, first]  # the second turn saw the first; /reset forgot it


@needs_default_model
@pytest.mark.slow
def test_chat_command_two_turns_in_a_terminal():
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(sys.executable, ["-m", "tqattn", "chat", "--max-tokens", "24", "--max-model-len", "512"],
                          env=_env(), cwd=str(ROOT), encoding="utf-8", timeout=180)
    try:
        child.expect("you> ")
        assert "KV-cache plan:" in child.before
        child.sendline("What is the capital of France?")
        child.expect("you> ")
        assert "Paris" in child.before.split("assistant> ", 1)[1]
        child.sendline("And of Italy?")
        child.expect("you> ")
        assert child.before.split("assistant> ", 1)[1].strip()
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


@needs_default_model
@pytest.mark.slow
def test_embedded_smollm2_behind_the_server():
    from tqattn.serve.server import Server

    kw = dict(kv_cache_dtype="tq_k4v3", max_model_len=512, enable_prefix_caching=False, device="cpu")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    sp = SamplingParams(temperature=0, max_tokens=24)
    llm = LLM("default", **kw)
    expected = llm.chat(messages, sp, use_tqdm=False)[0].outputs[0].text
    assert "Paris" in expected
    with Server(llm.llm_engine, port=0, log_level="warning") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        r = client.chat.completions.create(model=server.model_name, messages=messages, max_tokens=24, temperature=0)
        assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
        chunks = client.chat.completions.create(model=server.model_name, messages=messages, max_tokens=24,
                                                temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
