"""Host (CPU) time of one engine step at a large decode batch, without a GPU.

Runs the real engine — scheduler, input building (InputBatch + the backends' metadata
builders), sampler, bookkeeping in LLMEngine.step — around a stand-in model: forward returns
preallocated CPU logits, and decode steps take the CUDA-graph path with CPU static buffers and
a no-op replay (the inputs are written into the static buffers exactly as on the GPU). What is
left is the host work the GPU would wait on. Reported per decode step at the batch size, broken
down by part; the per-part times wrap the engine's own methods.

    python bench/host_step.py --num-seqs 256 --context 1024 [--kv-cache-dtype turboquant_k3v4_nc]
        [--json bench/results/host_step_cpu.json]

The tiny config's layer count does not matter (builders run once per KV-cache group, not per
layer); its vocabulary (256) keeps the CPU argmax small, as the GPU's would be.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqattn import LLM, SamplingParams  # noqa: E402


class _NoGraph:
    def replay(self):
        pass


# the input batch's step halves: host buffers filled, then moved to the device or the graph's
# static buffers
INPUT_BATCH_METHODS = ("fill", "fill_decode", "upload", "to_static")


def _timed(obj, name, acc, label=None):
    """Replace obj.name by a wrapper adding its seconds to acc[label or name]."""
    fn, key = getattr(obj, name), label or name

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[key] += time.perf_counter() - t
    setattr(obj, name, wrapper)


def _install_graph_path(runner, max_bs, max_model_len, logits):
    """The runner's CUDA-graph decode path with CPU buffers (what capture_cudagraphs allocates)."""
    max_blocks = -(-max_model_len // runner.block_size)
    runner.static = {
        "input_ids": torch.zeros(max_bs, dtype=torch.int64), "positions": torch.zeros(max_bs, dtype=torch.int64),
        "query_start_loc": torch.arange(max_bs + 1, dtype=torch.int32),
        "seq_lens": torch.zeros(max_bs, dtype=torch.int32),
        "num_computed_tokens": torch.zeros(max_bs, dtype=torch.int32),
        "block_tables": [torch.zeros(max_bs, max_blocks, dtype=torch.int32) for _ in runner.groups],
        "slot_mappings": [torch.full((max_bs,), -1, dtype=torch.int64) for _ in runner.groups]}
    buckets = [b for b in (1, 2, 4, 8, *range(16, 513, 16)) if b < max_bs] + [max_bs]
    runner.graphs = {b: (_NoGraph(), logits[:b]) for b in buckets}


def run(args) -> dict:
    torch.set_num_threads(1)
    max_model_len = args.context + args.decode_steps + 64
    llm = LLM(args.model, load_format="dummy", kv_cache_dtype=args.kv_cache_dtype,
              kv_cache_boundary_layers=args.boundary_layers, max_model_len=max_model_len,
              max_num_seqs=args.num_seqs, max_num_batched_tokens=max(args.num_seqs, 8192),
              enable_prefix_caching=False, device="cpu")
    engine = llm.llm_engine
    runner = engine.runner
    vocab = engine.model_info.vocab_size
    logits = torch.randn(max(args.num_seqs, 64), vocab)
    runner.forward = lambda input_ids, positions, metadata, sample_idx: logits[:len(sample_idx)]
    if args.graphs:
        _install_graph_path(runner, args.num_seqs, max_model_len, logits)

    acc = defaultdict(float)
    _timed(engine.scheduler, "schedule", acc)
    _timed(engine.scheduler, "update_from_output", acc)
    # inputs: host buffers filled, moved to the device (or the graph's static buffers), metadata built
    for name in INPUT_BATCH_METHODS:
        _timed(runner.input_batch, name, acc, "inputs")
    _timed(runner, "_metadata", acc, "inputs")
    _timed(runner.sampler, "sample", acc)

    params = SamplingParams(temperature=args.temperature, max_tokens=args.decode_steps + 8, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    for i in range(args.num_seqs):
        ids = torch.randint(0, vocab, (args.context,), generator=gen).tolist()
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    while any(r.seq.num_output_tokens == 0 for r in engine.requests.values()):  # prefill everything
        engine.step()
    per_step = []
    for i in range(args.warmup + args.decode_steps):
        acc.clear()
        t = time.perf_counter()
        engine.step()
        total = time.perf_counter() - t
        if i >= args.warmup:
            parts = {"schedule": acc["schedule"], "inputs": acc["inputs"],
                     "sampling": acc["sample"], "update": acc["update_from_output"]}
            parts["engine (rest)"] = total - sum(parts.values())
            parts["total"] = total
            per_step.append(parts)
    assert all(len(r.seq.block_table) for r in engine.requests.values())
    med = {k: statistics.median(p[k] for p in per_step) * 1e3 for k in per_step[0]}
    return {"num_seqs": args.num_seqs, "context": args.context, "kv_cache_dtype": args.kv_cache_dtype,
            "groups": [g.backend.name for g in runner.groups], "graph_path": args.graphs,
            "temperature": args.temperature, "median_ms": med,
            "mean_total_ms": statistics.fmean(p["total"] for p in per_step) * 1e3,
            "steps": len(per_step)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--decode-steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--kv-cache-dtype", action="append", help="repeatable (default: auto, turboquant_k3v4_nc)")
    ap.add_argument("--boundary-layers", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--eager", dest="graphs", action="store_false", help="decode without the graph path (upload + metadata + forward)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    results = []
    for dtype in args.kv_cache_dtype or ["auto", "turboquant_k3v4_nc"]:
        args.kv_cache_dtype = dtype
        r = run(args)
        results.append(r)
        parts = "  ".join(f"{k} {v:.3f}" for k, v in r["median_ms"].items())
        print(f"{dtype:>20} {r['num_seqs']} seqs x {r['context']} ctx ({'graph' if r['graph_path'] else 'eager'} "
              f"path, groups {r['groups']}): median ms/step: {parts}")
    if args.json:
        meta = {"command": "python " + " ".join(sys.argv), "cpu": platform.processor() or platform.machine(),
                "python": platform.python_version(), "torch": torch.__version__,
                "num_cpus": __import__("os").cpu_count()}
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
