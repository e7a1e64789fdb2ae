"""`tqattn bench serve`: streaming requests against an OpenAI-compatible server, vLLM's
``bench serve`` in spirit: N requests sent all at once or at a fixed Poisson rate, each streamed;
TTFT, TPOT and end-to-end percentiles, output and request throughput.

The client speaks HTTP/1.1 over asyncio streams itself (one connection per request, chunked
server-sent events), so it needs nothing beyond the standard library. Prompts are random token
ids in [100, 1000), which every vocabulary holds, sent as ``prompt: [ids]`` with ``ignore_eos``
so each request generates exactly ``output_len`` tokens.
"""

from __future__ import annotations

import asyncio
import json
import random
import shlex
import subprocess
import sys
import time
from urllib.parse import urlsplit


async def _stream_request(host: str, port: int, body: dict) -> dict:
    """POST one streaming completion; the arrival time of every event and the usage."""
    data = json.dumps(body).encode()
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write((f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data)
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    times, usage, error, buf = [], None, None, b""
    try:
        if status != 200:
            return {"status": status, "error": (await reader.read()).decode(errors="replace")[-500:]}
        while True:
            size = int((await reader.readline()).strip() or b"0", 16)
            if size == 0:
                break
            buf += (await reader.readexactly(size + 2))[:-2]
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                payload = event.removeprefix(b"data: ")
                if payload == b"[DONE]":
                    continue
                obj = json.loads(payload)
                if "error" in obj:
                    error = obj["error"]["message"]
                elif obj.get("choices"):
                    if obj["choices"][0]["finish_reason"] is None:
                        times.append(time.perf_counter())
                elif obj.get("usage"):
                    usage = obj["usage"]
    finally:
        writer.close()
    end = time.perf_counter()
    return {"status": status, "start": start, "end": end, "chunks": times, "usage": usage, "error": error}


def _percentiles(xs: list[float]) -> dict:
    if not xs:
        return {}
    s = sorted(xs)

    def q(p):
        return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]
    return {"mean": sum(s) / len(s), "p50": q(50), "p90": q(90), "p99": q(99), "max": s[-1]}


async def run_load(url: str, model: str | None, num_prompts: int, input_len: int, output_len: int,
                   request_rate: float = float("inf"), max_concurrency: int | None = None,
                   seed: int = 0) -> dict:
    u = urlsplit(url)
    host, port = u.hostname, u.port or 80
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 1000) for _ in range(input_len)] for _ in range(num_prompts)]
    sem = asyncio.Semaphore(max_concurrency or num_prompts)

    async def one(i):
        body = {"prompt": prompts[i], "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        if model:
            body["model"] = model
        async with sem:
            return await _stream_request(host, port, body)

    tasks, t0 = [], time.perf_counter()
    for i in range(num_prompts):
        tasks.append(asyncio.ensure_future(one(i)))
        if request_rate != float("inf") and i < num_prompts - 1:
            await asyncio.sleep(rng.expovariate(request_rate))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    ok = [r for r in results if r["status"] == 200 and not r["error"] and r["usage"]]
    ttft = [r["chunks"][0] - r["start"] for r in ok if r["chunks"]]
    tpot = [(r["end"] - r["chunks"][0]) / (r["usage"]["completion_tokens"] - 1)
            for r in ok if r["chunks"] and r["usage"]["completion_tokens"] > 1]
    e2e = [r["end"] - r["start"] for r in ok]
    out_tokens = sum(r["usage"]["completion_tokens"] for r in ok)
    return {"num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
            "request_rate": request_rate, "max_concurrency": max_concurrency, "completed": len(ok),
            "failed": [{"status": r["status"], "error": r["error"]} for r in results if r not in ok][:10],
            "duration_s": duration, "output_tokens": out_tokens,
            "output_tok_s": out_tokens / duration, "request_s": len(ok) / duration,
            "total_tok_s": (out_tokens + len(ok) * input_len) / duration,
            "ttft_s": _percentiles(ttft), "tpot_s": _percentiles(tpot), "e2e_s": _percentiles(e2e)}


def start_server(server_args: list[str], kv_cache_dtype: str | None, timeout: float = 1800) -> tuple:
    """`tqattn serve ... --port 0` in a subprocess; returns (process, url) once it listens."""
    cmd = [sys.executable, "-m", "tqattn", "serve", *server_args, "--port", "0"]
    if kv_cache_dtype is not None:
        cmd += ["--kv-cache-dtype", kv_cache_dtype]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    end, lines = time.monotonic() + timeout, []
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("serving ") and " at http" in line:
            return proc, line.rsplit(" at ", 1)[1].strip().removesuffix("/v1"), "".join(lines)
    proc.kill()
    raise RuntimeError(f"`{shlex.join(cmd)}` did not start (exit {proc.poll()}):\n{''.join(lines)[-2000:]}")


def format_table(runs: list[dict]) -> str:
    from tqattn.text_table import format_table as table

    rows = []
    for r in runs:
        m = r["metrics"]
        rows.append([r["kv_cache_dtype"] or "(running server)", f"{m['completed']}/{m['num_prompts']}",
                     f"{m['output_tok_s']:.1f}", f"{m['request_s']:.2f}",
                     *(f"{m[k].get(p, float('nan')) * 1e3:.1f}" for k in ("ttft_s", "tpot_s")
                       for p in ("p50", "p99"))])
    return table(["kv-cache dtype", "completed", "output tok/s", "req/s", "TTFT p50 ms", "TTFT p99 ms",
                  "TPOT p50 ms", "TPOT p99 ms"], rows)
