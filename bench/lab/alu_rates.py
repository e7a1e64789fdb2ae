"""Issue rates of the decode loop's instruction kinds on the GPU at hand (issue 27).

At 4/1/256 the tensor-core decode's head-256 loop computes at ~0.3 warp instructions a cycle
per SM scheduler whether one or two one-warp programs share the scheduler
(bench/results/decode256_4_1_256_probes_h100_s42.md): a limit on throughput, not on latency.
Its instructions are 54 % ``PRMT``, 14 % ``LOP3``, 8 % ``SHF``, 6 % ``HMMA``. This times each
kind alone: one-warp programs, W of them per SM, each running 8 independent chains of the
instruction (so that one warp is not latency-bound), the cycles read from ``%clock64`` around
the loop. Rates: warp instructions a cycle per SM (4 schedulers: FP32 ``FFMA`` issues up to 4).

    PYTHONPATH=. python3 bench/lab/alu_rates.py --out $OUT/alu_rates.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.common import environment  # noqa: E402

CHAINS = 8                   # independent chains a warp runs
UNROLL = tl.constexpr(4)     # chain steps a loop iteration
# (PTX of one chain step on b32 registers x (the chain), y, s (loop-invariant), SASS opcode)
OPS = {
    "prmt": ("prmt.b32 $0, $1, $2, $3;", "PRMT"),
    "lop3": ("lop3.b32 $0, $1, $2, $3, 0x96;", "LOP3"),
    "shf": ("shf.r.wrap.b32 $0, $1, $2, $3;", "SHF"),
    "imad": ("mad.lo.u32 $0, $1, $2, $3;", "IMAD"),
    "ffma": ("fma.rn.f32 $0, $1, $2, $3;", "FFMA"),
    "hfma2": ("fma.rn.f16x2 $0, $1, $2, $3;", "HFMA2"),
}


@triton.jit
def _clock():
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _step(x, y, s, ASM: tl.constexpr):
    return tl.inline_asm_elementwise(ASM, "=r,r,r,r", [x, y, s], dtype=tl.int32, is_pure=True,
                                     pack=1)


@triton.jit
def _rate_kernel(out_ptr, cyc_ptr, iters, ASM: tl.constexpr):
    lane = tl.arange(0, 32)
    seed = tl.program_id(0) * 32 + lane
    y = seed * 0x1E3779B1 + 0x3C003C00
    s = (seed * 0x05EBCA6B) & 0x77777777
    x0 = seed
    x1 = seed + 1
    x2 = seed + 2
    x3 = seed + 3
    x4 = seed + 4
    x5 = seed + 5
    x6 = seed + 6
    x7 = seed + 7
    t0 = _clock()
    for _ in range(iters):
        for _u in tl.static_range(UNROLL):
            x0 = _step(x0, y, s, ASM)
            x1 = _step(x1, y, s, ASM)
            x2 = _step(x2, y, s, ASM)
            x3 = _step(x3, y, s, ASM)
            x4 = _step(x4, y, s, ASM)
            x5 = _step(x5, y, s, ASM)
            x6 = _step(x6, y, s, ASM)
            x7 = _step(x7, y, s, ASM)
    t1 = _clock()
    tl.store(out_ptr + seed, x0 ^ x1 ^ x2 ^ x3 ^ x4 ^ x5 ^ x6 ^ x7)
    tl.store(cyc_ptr + tl.program_id(0), t1 - t0)


def measure(op: str, per_sm: int, sms: int, iters: int) -> dict:
    """Runs `op` with per_sm one-warp programs on each SM; the median program's rate."""
    asm = OPS[op][0]
    n = per_sm * sms
    out = torch.empty(n * 32, dtype=torch.int32, device="cuda")
    cyc = torch.empty(n, dtype=torch.int64, device="cuda")
    for _ in range(2):  # the first run compiles
        _rate_kernel[(n,)](out, cyc, iters, ASM=asm, num_warps=1)
    torch.cuda.synchronize()
    cycles = cyc.double().median().item()
    per_warp = iters * UNROLL.value * CHAINS / cycles
    return {"op": op, "programs_per_sm": per_sm, "iters": iters, "cycles": cycles,
            "per_warp_per_cycle": per_warp, "per_sm_per_cycle": per_warp * per_sm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--per-sm", default="1,2,4,8,16")
    ap.add_argument("--iters", type=int, default=4096)
    ap.add_argument("--out", default="alu_rates.json")
    args = ap.parse_args()
    env = {**environment(), "command": "python3 " + " ".join(sys.argv)}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for op in args.ops.split(","):
        for w in (int(x) for x in args.per_sm.split(",")):
            r = measure(op, w, sms, args.iters)
            rows.append(r)
            print(json.dumps(r), flush=True)
    with open(args.out, "w") as f:
        json.dump({"env": env, "sms": sms, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
