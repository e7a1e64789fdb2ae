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
import threading
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit


async def _stream_request(host: str, port: int, body: dict) -> dict:
    """POST one streaming completion; the arrival time of every event and the usage.

    The response is read in large blocks and de-chunked here (events read together get the time
    of their read): per event only the JSON parse remains, so one client process keeps up with
    a server streaming tens of thousands of events per second."""
    data = json.dumps(body).encode()
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
    writer.write((f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data)
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    times, usage, error = [], None, None
    try:
        if status != 200:
            return {"status": status, "error": (await reader.read()).decode(errors="replace")[-500:]}
        body = _Dechunk() if headers.get("transfer-encoding", "").lower() == "chunked" else None
        events = b""
        while block := await reader.read(1 << 16):
            now = time.perf_counter()
            events += body.feed(block) if body is not None else block
            *complete, events = events.split(b"\n\n")
            for event in complete:
                payload = event.removeprefix(b"data: ")
                if payload == b"[DONE]":
                    continue
                obj = json.loads(payload.decode())
                if "error" in obj:
                    error = obj["error"]["message"]
                elif obj.get("choices"):
                    if obj["choices"][0]["finish_reason"] is None:
                        times.append(now)
                elif obj.get("usage"):
                    usage = obj["usage"]
            if body is not None and body.done:
                break
    finally:
        writer.close()
    end = time.perf_counter()
    return {"status": status, "start": start, "end": end, "chunks": times, "usage": usage, "error": error}


class _Dechunk:
    """HTTP/1.1 chunked transfer coding, decoded block by block."""

    def __init__(self):
        self.raw = b""
        self.done = False

    def feed(self, block: bytes) -> bytes:
        raw, pos, out = self.raw + block, 0, []
        while not self.done:
            eol = raw.find(b"\r\n", pos)
            if eol < 0:
                break
            size = int(raw[pos:eol].split(b";")[0], 16)
            if len(raw) < eol + 2 + size + 2:
                break
            out.append(raw[eol + 2:eol + 2 + size])
            pos = eol + 2 + size + 2
            self.done = size == 0
        self.raw = raw[pos:]
        return b"".join(out)


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


class ServerProcess:
    """`tqattn serve ... --port 0` in a subprocess, started by the constructor (returns once it
    listens). Its stdout and stderr are kept in ``log`` (read by a thread, so the pipe never
    fills); :meth:`stop` ends it."""

    def __init__(self, server_args: list[str], kv_cache_dtype: str | None, timeout: float = 1800):
        cmd = [sys.executable, "-m", "tqattn", "serve", *server_args, "--port", "0"]
        if kv_cache_dtype is not None:
            cmd += ["--kv-cache-dtype", kv_cache_dtype]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.url: str | None = None
        listening = threading.Event()
        threading.Thread(target=self._read, args=(listening,), daemon=True).start()
        if not listening.wait(timeout) or self.url is None:
            self.proc.kill()
            raise RuntimeError(f"`{shlex.join(cmd)}` did not start (exit {self.proc.wait()}):\n{self.log[-3000:]}")

    def _read(self, listening: threading.Event) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if self.url is None and line.startswith("serving ") and " at http" in line:
                self.url = line.rsplit(" at ", 1)[1].strip().removesuffix("/v1")
                listening.set()
        listening.set()  # it exited

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# /metrics samples that say what the server's engine did (tqattn/serve/metrics.py)
_SERVER_SAMPLES = {"tqattn:engine_step_seconds_count": "steps", "tqattn:engine_step_seconds_sum": "step_s",
                   "tqattn:engine_cudagraph_steps_total": "cudagraph_steps",
                   "tqattn:compilations_after_startup": "compilations_after_startup",
                   "tqattn:num_preemptions_total": "preemptions",
                   "tqattn:generation_tokens_total": "generation_tokens"}


def scrape(url: str) -> dict:
    """The server's engine counters from its /metrics (empty for a server without them)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition("{")
        if name in _SERVER_SAMPLES:
            out[_SERVER_SAMPLES[name]] = float(value.rsplit(" ", 1)[1])
    return out


def gpu_snapshot() -> dict | None:
    """The GPUs as NVML sees them (no CUDA context here): each one's compute processes (another
    one shares the GPU with the server under test), SM clock and throttle reasons. None without
    NVML (nvidia-ml-py) or a GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # not installed, or no driver
        return None
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            gpus.append({
                "processes": [{"pid": p.pid, "memory_mib": (p.usedGpuMemory or 0) >> 20}
                              for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)],
                "sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                "utilization_pct": pynvml.nvmlDeviceGetUtilizationRates(h).gpu,
                "throttle_reasons": pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h)})
        return {"gpus": gpus}
    except Exception as e:  # an NVML call this driver lacks
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        pynvml.nvmlShutdown()


def server_stats(before: dict, after: dict) -> dict:
    """What the engine did between two scrapes: steps, mean step ms, steps replaying a CUDA
    graph, compilations after start-up (a total, not a difference), preemptions."""
    if not after:
        return {}
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    steps = d.get("steps", 0)
    return {"steps": int(steps), "mean_step_ms": d["step_s"] / steps * 1e3 if steps else None,
            "cudagraph_steps": int(d.get("cudagraph_steps", 0)),
            "compilations_after_startup": int(after.get("compilations_after_startup", 0)),
            "preemptions": int(d.get("preemptions", 0)), "generation_tokens": int(d.get("generation_tokens", 0))}


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


def format_server_table(runs: list[dict]) -> str:
    """What each server's engine did during the measured run (from its /metrics)."""
    from tqattn.text_table import format_table as table

    rows = []
    for r in runs:
        st = r["metrics"].get("server") or {}
        if not st:
            continue
        mean = st["mean_step_ms"]
        rows.append([r["kv_cache_dtype"] or "(running server)", str(st["steps"]),
                     "n/a" if mean is None else f"{mean:.2f}",
                     f"{st['cudagraph_steps']} ({st['cudagraph_steps'] / max(st['steps'], 1):.0%})",
                     str(st["compilations_after_startup"]), str(st["preemptions"]),
                     "/".join(_gpu_processes(r["metrics"].get("gpu", {}).get(k)) for k in ("before", "after"))])
    return table(["kv-cache dtype", "engine steps", "mean step ms", "CUDA-graph steps",
                  "compilations after start-up", "preemptions", "GPU processes before/after"],
                 rows) if rows else ""


def _gpu_processes(snapshot: dict | None) -> str:
    """Compute processes on the busiest GPU (the server's own included), "n/a" without NVML."""
    if not snapshot or "gpus" not in snapshot:
        return "n/a"
    return str(max((len(g["processes"]) for g in snapshot["gpus"]), default=0))


def server_engine_args(server_args: list[str], kv_cache_dtype: str | None) -> dict:
    """The engine arguments `tqattn serve` builds from these flags (what the throughput
    benchmark records as its engine arguments, for comparing the two item by item)."""
    from tqattn.cli import build_parser
    from tqattn.engine.arg_utils import engine_kwargs_from_args

    extra = [] if kv_cache_dtype is None else ["--kv-cache-dtype", kv_cache_dtype]
    return engine_kwargs_from_args(build_parser().parse_args(["serve", *server_args, *extra]))


def run_bench(args, command: str) -> int:
    """`tqattn bench serve`: for each kv-cache dtype a server (or the one at --url), a warm-up,
    the measured load, the server's engine counters around it. JSON and markdown in --out-dir
    (rewritten after each dtype, so a run cut short keeps what it measured), and each server's
    log."""
    server_args = shlex.split(args.server_args)
    if not args.url:  # the servers this command starts need the extra; say so before starting one
        from tqattn.serve.frontend import uvicorn_module

        uvicorn_module()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = _collect_env()
    runs = []
    for dtype in ([None] if args.url else args.kv_cache_dtypes):
        engine_args = None if args.url else server_engine_args(server_args, dtype)  # bad flags fail here
        server = None if args.url else ServerProcess(server_args, dtype)
        url = args.url or server.url
        try:
            if args.warmup_prompts:
                asyncio.run(run_load(url, args.served_model, args.warmup_prompts, args.input_len, 4, seed=-1))
            before, gpu_before = scrape(url), gpu_snapshot()
            m = asyncio.run(run_load(url, args.served_model, args.num_prompts, args.input_len, args.output_len,
                                     args.request_rate, args.max_concurrency, args.seed))
            m["server"] = server_stats(before, scrape(url))
            m["gpu"] = {"before": gpu_before, "after": gpu_snapshot()}  # e.g. another process on it
            if not m["completed"]:
                raise ValueError(f"no request completed; the server answered: {m['failed'][0]}")
        finally:
            if server is not None:
                server.stop()
                (out / f"{args.tag}_{dtype}.log").write_text(server.log)
        runs.append({"kv_cache_dtype": dtype, "url": url, "engine_args": engine_args,
                     "server_log": server.log if server else "", "metrics": m})
        _write(out, args.tag, {"command": command, "server_args": server_args, "runs": runs, "env": env})
        print(format_table(runs[-1:]), flush=True)
    if len(runs) > 1:  # one run's table is printed above
        print(format_table(runs))
    print(format_server_table(runs))
    print(f"wrote {out / args.tag}.json, .md" + ("" if args.url else ", the servers' logs"))
    return 0


def _collect_env() -> dict:
    """collect_env() in a child process: here it would open a CUDA context, which the servers'
    KV-cache sizing would then see as memory in use."""
    code = "import json; from tqattn.attention.env_report import collect_env; print(json.dumps(collect_env()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _write(out: Path, tag: str, result: dict) -> None:
    from .report import provenance

    runs = result["runs"]
    (out / f"{tag}.json").write_text(json.dumps(result, indent=1))
    md = [f"# {tag}", "", *provenance(result["env"], result["command"]), "", "```", format_table(runs), "```", ""]
    server_table = format_server_table(runs)
    if server_table:
        md += ["What each server's engine did in the measured run (its /metrics):", "", "```", server_table,
               "```", ""]
    if any(r["engine_args"] for r in runs):
        md += ["Engine arguments of each server (`tqattn serve`'s, from --server-args):", ""]
        md += [f"- `{r['kv_cache_dtype']}`: `{r['engine_args']}`" for r in runs if r["engine_args"]]
        md.append("")
    (out / f"{tag}.md").write_text("\n".join(md))
