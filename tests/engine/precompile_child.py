"""Run by tests/engine/test_precompile.py in a fresh interpreter (the test session imports the
kernels under triton's interpreter): real product launches on CPU tensors for a pretend H200
(bench/kernel_builds.py's fake_h200), bound for sm_90. Prints one JSON line per case.

* ``store``: two store launches of one build precompiled by a real pool into TRITON_CACHE_DIR,
  then captured again (all in the disk cache) and compiled by this process as the JIT would
  (every compile a disk-cache hit);
* ``warmup``: the engine's warm-up steps through a 2-layer model with Qwen3-4B's attention
  shape: every build pickles and keeps its cache key (nothing compiled);
* ``warmup-compile``: the same builds precompiled and checked as ``store`` (a minute on 2 cores;
  not in CI).

    TRITON_CACHE_DIR=$(mktemp -d) python tests/engine/precompile_child.py store warmup
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
from concurrent.futures import Future

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]
os.environ.pop("TRITON_INTERPRET", None)
os.environ["TQATTN_FORCE_TRITON"] = "1"   # CPU tensors take the Triton paths (not run: captured)

import torch  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from kernel_builds import capturing, compile_captured, fake_h200  # noqa: E402
from tqattn.engine.precompile import Capture, Precompiler  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


class NoPool:
    def submit(self, build):
        raise AssertionError(f"{build.qualname} is not in the disk cache")


def store_launches():
    from tqattn.kernels.store import store_kv_triton
    from tqattn.quant.codec import TQCodec
    from tqattn.quant.paged import kv_cache_shape

    codec = TQCodec("turboquant_k3v4_nc", 128)

    def store(n, hk=8):
        cache = torch.zeros(kv_cache_shape(n // 16 + 1, 16, hk, codec), dtype=torch.uint8)
        k = torch.zeros(n, hk, 128, dtype=torch.bfloat16)
        store_kv_triton(codec, k, k.clone(), cache, torch.arange(n))

    # 32 and 33 tokens: one build (the row count is no specialization key)
    return [lambda: store(32), lambda: store(33)]


def warmup_launches():
    """The engine's warm-up steps through a 2-layer Qwen3 with Qwen3-4B's attention shape."""
    from tqattn import LLM
    from tqattn.engine.warmup import backend_token_counts, run_warmup, warmup_steps

    config = dict(json.load(open(os.path.join(ROOT, "tqattn/configs/models/Qwen3-4B.json"))),
                  hidden_size=64, intermediate_size=64, num_hidden_layers=2, max_window_layers=2,
                  vocab_size=64, bos_token_id=1, eos_token_id=2)
    model_dir = os.path.join(os.environ["TRITON_CACHE_DIR"], "model")
    os.makedirs(model_dir, exist_ok=True)
    json.dump(config, open(os.path.join(model_dir, "config.json"), "w"))
    limits = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512, block_size=16)
    llm = LLM(model_dir, load_format="dummy", kv_cache_dtype="turboquant_k3v4_nc",
              kv_cache_boundary_layers=0, num_gpu_blocks_override=64,
              enable_prefix_caching=False, **{k: v for k, v in limits.items()})
    runner = llm.llm_engine.runner
    torch.set_num_threads(1)

    extra = backend_token_counts(llm.llm_engine.layers, 16, "cuda", 64)
    steps = warmup_steps(4, 64, 512, 16, extra)
    return [lambda s=s: run_warmup(runner, [s]) for s in steps]


class RecordingPool:
    def __init__(self):
        self.builds = []

    def submit(self, build):
        self.builds.append(build)
        fut = Future()
        fut.set_result((0.0, build.cache_key()))
        return fut


def round_trip(launches) -> dict:
    """Capture into a pool that keeps the builds: each pickles; in this process the unpickled
    build finds its kernel and has the same cache key."""
    pool = RecordingPool()
    capture = Capture(pool, TARGET)
    capture.run(launches)
    same = [pickle.loads(pickle.dumps(b)).cache_key() == b.cache_key() for b in pool.builds]
    return {"summary": capture.summary(), "kernels": sorted({b.name for b in pool.builds}),
            "same_key": same}


def main(case: str) -> None:
    run = {"store": store_launches, "warmup": warmup_launches,
           "warmup-compile": warmup_launches}[case]
    with fake_h200():
        launches = run()
        if case == "warmup":
            print(json.dumps(round_trip(launches)), flush=True)
            return
        t = time.perf_counter()
        pre = Precompiler(1, TARGET)
        summary = pre.run(launches)
        precompile_s = time.perf_counter() - t
        # again: every build is now in the disk cache, nothing goes to a pool
        again = Capture(NoPool(), TARGET)
        again.run(launches)
        # the parent's own compile of each launch, as the JIT would on the GPU: disk-cache hits
        hits = []
        knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
        with capturing() as got:
            for step in launches:
                step()
        t = time.perf_counter()
        for fn, args, kwargs in got:
            compile_captured(fn, args, kwargs)
        parent_s = time.perf_counter() - t
    print(json.dumps({"summary": summary, "precompile_s": precompile_s, "again": again.summary(),
                      "parent_hits": hits, "parent_s": parent_s, "launches": len(got)}), flush=True)


if __name__ == "__main__":
    for name in sys.argv[1:]:
        main(name)
