"""The serving path's own cost, without a GPU: how many output tokens per second the engine
loop, the server and the benchmark client can each carry when the model step is (nearly) free.

The engine is the real one (scheduler, block manager, input building on the CUDA-graph decode
path, LLMEngine.step bookkeeping; bench/host_step.py's stand-in) around a stand-in model: the
forward returns preallocated logits, the sampler returns the next token of a fixed text for each
sequence, and ``--step-ms`` emulates the device: with async scheduling a step's tokens become
readable ``step-ms`` after the step before them was done (the wait sleeps, without the GIL, as a
CUDA event wait does). Three measurements, each over ``--num-prompts`` requests sent at once:

* ``offline``: LLMEngine.step in a loop (what ``tqattn bench throughput`` drives);
* ``server``: ``tqattn serve``'s Server over that engine in a subprocess, driven by ``tqattn
  bench serve``'s client (``run_load``) from this process; also ``server-drain``, the same server
  read by a client that only counts events (the server's ceiling without the client's parsing);
* ``client``: ``run_load`` against a canned SSE server that sends pre-built chunks (the client's
  own ceiling).

    PYTHONPATH=. python bench/serve_overhead.py [--num-prompts 512 --input-len 1024
        --output-len 256 --max-num-seqs 256 --step-ms 0 --tokenizer none|smollm2]
        [--modes offline,server,server-drain,client] [--repeat N] [--label TREE] [--json out.json]
    python bench/serve_overhead.py --report out.json   # the markdown table of a --json file

Server runs also report CPU time per output token (Linux /proc): of the server's main process
(the engine's side) in all and in its engine thread, and of its HTTP front end's process (before
the front end had its own process: the HTTP thread of the one process); and the main process's
garbage-collection time: on a shared machine
these move less with the load than tokens per second. The H200 run's dummy Qwen3-4B has no
tokenizer (``--tokenizer none``, the default): its chunks carry token progress with empty text;
``--tokenizer smollm2`` detokenizes real text. Environment of the server subprocess, for
experiments: SWITCH_INTERVAL (sys.setswitchinterval), GC_FREEZE=1 (gc.freeze() after start-up).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from host_step import _install_graph_path  # noqa: E402

from tqattn.benchmarks.serve import run_load  # noqa: E402

TEXT = ("The engine schedules each step, runs the model and samples one token for every running "
        "request; the server turns those tokens into text and sends them to each client as a "
        "server-sent event. Überprüfung: naïve café, 東京 and emoji 🙂 stay whole across tokens. ")


# ---- the stand-in engine ------------------------------------------------------------------------

def _tiny_dir(tokenizer: str) -> str:
    """llama-tiny's shapes; with SmolLM2's tokenizer and vocabulary for --tokenizer smollm2."""
    cfg = json.loads((ROOT / "tqattn/configs/models/llama-tiny.json").read_text())
    d = tempfile.mkdtemp(prefix="serve-overhead-")
    if tokenizer == "smollm2":
        from tqattn.models import load_model

        load_model("default").tokenizer.save_pretrained(d)
        cfg.update(vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    else:  # room for the prompts' and the stand-in's token ids, [100, 1000)
        cfg.update(vocab_size=1024)
    (Path(d) / "config.json").write_text(json.dumps(cfg))
    return d


def make_engine(args):
    """The real LLMEngine on CPU with the stand-in model described in the module docstring."""
    from tqattn.engine.llm_engine import EngineArgs, LLMEngine

    torch.set_num_threads(1)
    max_model_len = args.input_len + args.output_len
    engine = LLMEngine(EngineArgs(
        model=_tiny_dir(args.tokenizer), load_format="dummy", device="cpu", dtype="bfloat16",
        max_model_len=max_model_len, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=8192,
        enable_prefix_caching=False, async_scheduling=args.step_ms > 0,
        num_gpu_blocks_override=args.max_num_seqs * -(-max_model_len // 16) + 16))
    runner = engine.runner
    logits = torch.zeros(max(args.max_num_seqs, 64), 8)
    runner.forward = lambda input_ids, positions, metadata, sample_idx: logits[:len(sample_idx)]
    _install_graph_path(runner, args.max_num_seqs, max_model_len, logits)

    if engine.tokenizer is not None:
        text_ids = engine.tokenizer.encode(TEXT * 4, add_special_tokens=False)
    else:
        text_ids = list(range(100, 1000))
    n = len(text_ids)
    state = {"seqs": [], "ready": 0.0}
    launch = runner.launch

    def stand_in_launch(scheduled, generators=None, pending=None):
        state["seqs"] = [s.seq for s in scheduled if s.samples]
        tokens = launch(scheduled, generators, pending)
        if args.step_ms > 0 and tokens.seq_ids:
            # the device runs one step at a time: this one starts when the one before is done
            ready = state["ready"] = max(time.perf_counter(), state["ready"]) + args.step_ms / 1e3
            host = tokens.host

            def wait_then_read():
                time.sleep(max(0.0, ready - time.perf_counter()))
                return host()
            tokens.host = wait_then_read
        return tokens

    def stand_in_sample(logits, params, generators):
        return torch.tensor([text_ids[(seq.arrival * 7 + seq.num_output_tokens) % n]
                             for seq in state["seqs"]], dtype=torch.int64)

    runner.launch = stand_in_launch
    runner.sampler.sample = stand_in_sample
    return engine


def prompts(args) -> list[list[int]]:
    return [[100 + (i * 31 + j) % 900 for j in range(args.input_len)] for i in range(args.num_prompts)]


# ---- (a) offline ----------------------------------------------------------------------------------

def run_offline(args) -> dict:
    from tqattn.engine.sampling import SamplingParams

    engine = make_engine(args)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    t0, cpu = time.perf_counter(), time.thread_time()
    for i, p in enumerate(prompts(args)):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    steps, out_tokens = 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            out_tokens += len(out.outputs[0].token_ids)
        steps += 1
    dt, cpu = time.perf_counter() - t0, time.thread_time() - cpu
    return {"mode": "offline", "output_tokens": out_tokens, "duration_s": dt, "output_tok_s": out_tokens / dt,
            "steps": steps, "ms_per_step": dt / steps * 1e3, "cpu_us_per_token_engine": cpu / out_tokens * 1e6}


# ---- (b) the server --------------------------------------------------------------------------------

def _cpu_seconds(tids: dict[str, int], frontend_pid: int | None = None) -> dict[str, float]:
    """CPU seconds (user + system) of this process, of the named threads and of the front end
    process (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")

    def stat(path):
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick
    out = {"process": stat("/proc/self/stat")}
    for name, tid in tids.items():
        out[name] = stat(f"/proc/self/task/{tid}/stat")
    if frontend_pid is not None:
        out["http"] = stat(f"/proc/{frontend_pid}/stat")
    return out


def serve_main(args) -> int:
    """The server subprocess: the stand-in engine behind tqattn's Server; prints its URL. SIGUSR1
    marks the start of the measured load; SIGTERM stops it and prints the engine thread's steps,
    the CPU seconds of the process (the engine's side), of its engine thread and of the HTTP
    front end's process, and the seconds spent in the engine side's garbage collector since the
    mark (GC_FREEZE=1: gc.freeze() after start-up)."""
    import threading

    from tqattn.serve.server import Server

    if os.environ.get("SWITCH_INTERVAL"):
        sys.setswitchinterval(float(os.environ["SWITCH_INTERVAL"]))
    engine = make_engine(args)
    server = Server(engine, port=0, served_model_name="stand-in", max_waiting_requests=4096,
                    log_level="warning")
    steps = {"n": 0, "s": 0.0}
    step = engine.step

    def timed_step():
        t = time.perf_counter()
        try:
            return step()
        finally:
            steps["n"] += 1
            steps["s"] += time.perf_counter() - t
    engine.step = timed_step
    stop, mark = [], {}
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    server.start()
    tids = {t.name.removeprefix("tqattn-"): t.native_id for t in threading.enumerate()
            if t.name == "tqattn-engine"}
    frontend = server._frontend.pid

    import gc
    gc_time = {"s": 0.0, "n": [0, 0, 0], "t0": 0.0}

    def on_gc(phase, info):
        if phase == "start":
            gc_time["t0"] = time.perf_counter()
        else:
            gc_time["s"] += time.perf_counter() - gc_time["t0"]
            gc_time["n"][info["generation"]] += 1
    gc.callbacks.append(on_gc)
    if os.environ.get("GC_FREEZE"):
        gc.collect()
        gc.freeze()

    def on_mark(*_):
        mark.update(_cpu_seconds(tids, frontend))
        steps.update(n=0, s=0.0)
        gc_time.update(s=0.0, n=[0, 0, 0])
    signal.signal(signal.SIGUSR1, on_mark)
    print(f"URL {server.url}", flush=True)
    while not stop:
        time.sleep(0.05)
    cpu = {k: v - mark.get(k, 0.0) for k, v in _cpu_seconds(tids, frontend).items()}
    server.stop()
    print("STEPS " + json.dumps({**steps, "cpu_s": cpu, "gc_s": gc_time["s"], "gc_collections": gc_time["n"]}),
          flush=True)
    return 0


def _child_args(args) -> list[str]:
    return [f"--num-prompts={args.num_prompts}", f"--input-len={args.input_len}",
            f"--output-len={args.output_len}", f"--max-num-seqs={args.max_num_seqs}",
            f"--step-ms={args.step_ms}", f"--tokenizer={args.tokenizer}"]


def _start(cmd: list[str]) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    for line in proc.stdout:
        if line.startswith("URL "):
            return proc, line.split()[1]
    raise RuntimeError(f"{cmd} did not start (exit {proc.wait()})")


def _stop(proc: subprocess.Popen) -> dict:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    for line in out.splitlines():
        if line.startswith("STEPS "):
            return json.loads(line[6:])
    return {}


async def drain_load(url: str, num_prompts: int, input_len: int, output_len: int) -> dict:
    """Every request at once; a client that only counts each stream's events and reads the
    token count from its usage chunk (a reader that keeps up gets a chunk per token; one that
    falls behind gets the tokens that piled up in one chunk)."""
    from urllib.parse import urlsplit

    u = urlsplit(url)
    ids = prompts(argparse.Namespace(num_prompts=num_prompts, input_len=input_len))

    async def one(p):
        body = json.dumps({"prompt": p, "max_tokens": output_len, "ignore_eos": True, "temperature": 0.0,
                           "stream": True, "stream_options": {"include_usage": True}}).encode()
        reader, writer = await asyncio.open_connection(u.hostname, u.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        events, tail = 0, b""
        while chunk := await reader.read(1 << 16):
            events += chunk.count(b"data: ")
            tail = (tail + chunk)[-4096:]
        writer.close()
        usage = tail[tail.rindex(b'"usage": ') + 9:]
        return events - 3, json.loads(usage[:usage.index(b"}") + 1])["completion_tokens"]

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in ids))
    dt = time.perf_counter() - t0
    tokens = sum(n for _, n in counts)
    return {"events": sum(e for e, _ in counts), "output_tokens": tokens, "duration_s": dt,
            "output_tok_s": tokens / dt}


def run_server(args, drain: bool = False) -> dict:
    proc, url = _start([sys.executable, __file__, "--serve", *_child_args(args)])
    try:
        asyncio.run(run_load(url, None, 4, args.input_len, 4, seed=-1))  # warm-up
        proc.send_signal(signal.SIGUSR1)
        time.sleep(0.1)
        if drain:
            m = asyncio.run(drain_load(url, args.num_prompts, args.input_len, args.output_len))
        else:
            m = asyncio.run(run_load(url, None, args.num_prompts, args.input_len, args.output_len))
    finally:
        steps = _stop(proc)
    tokens = m["output_tokens"]
    cpu = steps.get("cpu_s", {})
    return {"mode": "server-drain" if drain else "server", **_summary(m), "engine_steps": steps.get("n"),
            "engine_ms_per_step": steps["s"] / steps["n"] * 1e3 if steps.get("n") else None,
            **{f"cpu_us_per_token_{k}": v / tokens * 1e6 for k, v in cpu.items()},
            "gc_us_per_token": steps["gc_s"] / tokens * 1e6 if "gc_s" in steps else None}


def _summary(m: dict) -> dict:
    keys = ("completed", "output_tokens", "events", "duration_s", "output_tok_s")
    out = {k: m[k] for k in keys if k in m}
    for k in ("ttft_s", "tpot_s"):
        if m.get(k):
            out[k.replace("_s", "_ms") + "_p50"] = m[k]["p50"] * 1e3
    return out


# ---- (c) the client against canned chunks ----------------------------------------------------------

async def _canned_server(output_len: int) -> None:
    """An HTTP/1.1 SSE server that answers every POST with output_len pre-built completion chunks,
    interleaving the streams (one chunk each per round), then the finish, usage and [DONE]."""
    def event(obj) -> bytes:
        data = f"data: {json.dumps(obj)}\n\n".encode()
        return b"%x\r\n%s\r\n" % (len(data), data)

    base = {"id": "cmpl-" + "0" * 32, "object": "text_completion", "created": 0, "model": "stand-in"}
    token = event({**base, "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": None}]})
    tail = (event({**base, "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}]})
            + event({**base, "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": output_len,
                                                       "total_tokens": output_len + 1}})
            + b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")

    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(output_len):
            writer.write(token)
            await writer.drain()
            await asyncio.sleep(0)
        writer.write(tail)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=4096)
    print(f"URL http://127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
    loop = asyncio.get_running_loop()
    stop = loop.create_future()
    loop.add_signal_handler(signal.SIGTERM, stop.set_result, None)
    await stop


def run_client(args) -> dict:
    proc, url = _start([sys.executable, __file__, "--canned", *_child_args(args)])
    try:
        cpu = time.process_time()
        m = asyncio.run(run_load(url, None, args.num_prompts, args.input_len, args.output_len))
        cpu = time.process_time() - cpu
    finally:
        _stop(proc)
    return {"mode": "client", **_summary(m), "cpu_us_per_token_client": cpu / m["output_tokens"] * 1e6}


# ---- main --------------------------------------------------------------------------------------------

def report(path: str) -> str:
    """A markdown table of every result in a --json file."""
    rows = ["| tree | step ms | tokenizer | mode | output tok/s | chunks | engine ms/step | CPU µs/token: "
            "main process / engine thread / HTTP thread (label frontend-process: the front end's process) | load |", "|---|---|---|---|---|---|---|---|---|"]
    for run in json.loads(Path(path).read_text())["runs"]:
        c = run["config"]
        for r in run["results"]:
            if r["mode"].startswith("server"):
                cpu = " / ".join(f"{r[k]:.1f}" for k in ("cpu_us_per_token_process", "cpu_us_per_token_engine",
                                                          "cpu_us_per_token_http"))
            else:
                k = {"client": "cpu_us_per_token_client", "offline": "cpu_us_per_token_engine"}[r["mode"]]
                cpu = f"{r['mode']} {r[k]:.1f}" if k in r else "—"
            ms = r.get("engine_ms_per_step", r.get("ms_per_step"))
            rows.append(f"| {run['label']} | {c['step_ms']:g} | {c['tokenizer']} | {r['mode']} | "
                        f"{r['output_tok_s']:,.0f} | {r.get('events', '—')} | "
                        f"{'—' if ms is None else f'{ms:.2f}'} | {cpu} | {r['load_before']:.1f} |")
    return "\n".join(rows)


MODES = {"offline": run_offline, "server": run_server,
         "server-drain": lambda a: run_server(a, drain=True), "client": run_client}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--step-ms", type=float, default=0.0, help="emulated device time of a step (0: free)")
    ap.add_argument("--tokenizer", choices=["none", "smollm2"], default="none")
    ap.add_argument("--modes", default="offline,server,server-drain,client",
                    help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--repeat", type=int, default=1, help="run each mode this many times")
    ap.add_argument("--label", default="", help="recorded with the results (e.g. which tree ran)")
    ap.add_argument("--json", help="append the results to this JSON file")
    ap.add_argument("--report", metavar="JSON", help="print a markdown table of a --json file and exit")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--canned", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.report:
        print(report(args.report))
        return 0
    if args.serve:
        return serve_main(args)
    if args.canned:
        asyncio.run(_canned_server(args.output_len))
        return 0
    results = []
    for mode in args.modes.split(","):
        for _ in range(args.repeat):
            load = os.getloadavg()[0]
            r = {**MODES[mode](args), "load_before": load}
            results.append(r)
            print(json.dumps(r), flush=True)
    if args.json:
        path = Path(args.json)
        doc = json.loads(path.read_text()) if path.exists() else {"runs": []}
        doc["runs"].append({
            "command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpu": platform.processor() or platform.machine(),
            "num_cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "label": args.label, "switch_interval": sys.getswitchinterval(),
            "config": {k: v for k, v in vars(args).items() if k not in ("serve", "canned", "json", "label")},
            "results": results})
        path.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
