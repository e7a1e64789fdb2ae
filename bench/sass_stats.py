"""Static SASS statistics of the decode kernels' main loop, compiled offline for sm_90 (no GPU).

The decode kernels are bound by instruction issue, not HBM (bench/results/decode_notes.md), so
the loop's instruction count per token is a useful proxy between GPU sessions: compile with
triton's bundled ptxas for sm_90 as the product launches the kernel (bench/kernel_builds.py:
the entry point runs on CPU tensors with a pretend H200 and its launch is captured), disassemble
with nvdisasm, take the largest loop (a backward branch) and count its instructions by opcode.
Warp instructions per token = loop instructions × warps / BLOCK_N. At the H200's copy rate,
turboquant_k3v4_nc (118 B/token/head) leaves about 28 warp instructions per token (4
schedulers/SM, 132 SMs, ~1.9 GHz). ``--set K=V`` overrides constexprs of the captured launch
(a build the product does not launch, for static comparison only).

    PYTHONPATH=. python3 bench/sass_stats.py --presets turboquant_k3v4_nc,tq_k4v3 [--set K=V ...]
    PYTHONPATH=. python3 bench/sass_stats.py --mma [--store] [--splits N]  # tensor-core kernel
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.kernel_builds import _tool, capturing, compile_captured, fake_h200, resources  # noqa: E402
from tqattn.kernels.decode import decode_attention_triton  # noqa: E402
from tqattn.quant.codec import TQCodec  # noqa: E402
from tqattn.quant.paged import kv_cache_shape  # noqa: E402


def compile_decode(preset: str, d: int = 128, group: int = 4, block_size: int = 16,
                   splits: int | None = None, store: bool = False, **overrides):
    """The decode kernel the product launches for a plain decode of 32 sequences of 16K tokens
    (8 KV heads; the tensor-core kernel where it serves the call), compiled for sm_90:
    (compiled kernel, its launch keyword arguments)."""
    codec = TQCodec(preset, d)
    b, hk, l = 32, 8, 16384
    cache = torch.zeros(kv_cache_shape(64, block_size, hk, codec), dtype=torch.uint8)
    bt = torch.zeros(b, l // block_size, dtype=torch.int32)
    lens = torch.full((b,), l, dtype=torch.int32)
    q = torch.zeros(b, hk * group, d, dtype=torch.bfloat16)
    new_kv = None
    if store:
        kn = torch.zeros(b, hk, d, dtype=torch.bfloat16)
        new_kv = (kn, kn.clone(), torch.arange(b))
    with fake_h200(), capturing() as got:
        decode_attention_triton(codec, q, cache, bt, lens, out=torch.empty_like(q),
                                num_splits=splits, new_kv=new_kv)
    fn, args, kw = next(x for x in got if x[0].__name__ in ("_decode_split_kernel",
                                                           "_decode_mma_kernel"))
    unknown = set(overrides) - set(kw)
    if unknown:
        raise ValueError(f"--set {sorted(unknown)}: not launch arguments of {fn.__name__}")
    kw.update(overrides)
    kernel, _ = compile_captured(fn, args, kw)
    kw.setdefault("BLOCK_N", 64)          # the tensor-core kernel's tile
    return kernel, kw


def disassemble(cubin: bytes) -> tuple[list[tuple[int, str]], dict[str, int]]:
    """(address, instruction) pairs and label → address."""
    nvdisasm = _tool("nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    out, labels, pending = [], {}, []
    for line in text.splitlines():
        lab = re.match(r"^(\.L_x_\d+):", line.strip())
        if lab:
            pending.append(lab.group(1))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            addr = int(m.group(1), 16)
            for name in pending:
                labels[name] = addr
            pending = []
            out.append((addr, m.group(2).strip()))
    return out, labels


def occupancy(res: dict[str, int], warps: int, shared: int) -> int:
    """Programs resident per sm_90 SM: four 16K-register banks (one per scheduler) holding
    whole warps, 228 KB shared (of which the driver reserves 1 KB per program), 64 warps."""
    per_bank = 16384 // max(32 * (-(-res["reg"] // 8) * 8), 1)
    return min(4 * per_bank // warps, 233472 // (shared + 1024), 64 // warps)


def opcode(ins: str) -> str:
    ins = re.sub(r"^@!?U?P\w+\s+", "", ins)  # predicate
    return ins.split()[0].split(".")[0]


def loop_stats(instrs: list[tuple[int, str]], labels: dict[str, int]) -> dict:
    """Opcode counts of the largest loop (backward branch) and of the whole kernel."""
    best = None
    for addr, ins in instrs:
        m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", ins)
        target = labels.get(m.group(1)) if m else None
        if target is not None and target < addr and (best is None or addr - target > best[1] - best[0]):
            best = (target, addr)
    body = [ins for a, ins in instrs if best and best[0] <= a <= best[1]]
    count = collections.Counter(opcode(i) for i in body)
    return {"loop_instructions": len(body), "kernel_instructions": len(instrs),
            "loop_opcodes": dict(count.most_common()),
            "spill_ops": sum(1 for _, i in instrs if opcode(i) in ("STL", "LDL"))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="turboquant_k3v4_nc")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--set", nargs="*", default=[],
                    help="constexpr / option overrides of the captured launch, e.g. BLOCK_N=64")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--mma", action="store_true",
                    help="the tensor-core kernel of each preset (--head-dim 64, 128 or 256)")
    ap.add_argument("--store", action="store_true", help="with a decode step's new K/V")
    ap.add_argument("--splits", type=int, default=None, help="split count (default: auto)")
    args = ap.parse_args()
    overrides = {k: (v == "True" if v in ("True", "False") else int(v))
                 for k, v in (s.split("=") for s in args.set)}
    presets = args.presets.split(",")
    d = args.head_dim
    results = []
    for preset in presets:
        kernel, kw = compile_decode(preset, d, args.group, splits=args.splits, store=args.store,
                                    **overrides)
        st = loop_stats(*disassemble(kernel.asm["cubin"]))
        res = resources(kernel.asm["cubin"])
        warps = kw["num_warps"]
        st.update(resources=res, programs_per_sm=occupancy(res, warps, kernel.metadata.shared))
        st.update(preset=preset, kernel=kernel.name, block_n=kw["BLOCK_N"], warps=warps,
                  warp_instr_per_token=st["loop_instructions"] * warps / kw["BLOCK_N"])
        results.append(st)
        if not args.json:
            top = ", ".join(f"{k} {v}" for k, v in list(st["loop_opcodes"].items())[:args.top])
            print(f"{preset:22s} {kernel.name} BLOCK_N={kw['BLOCK_N']:3d} "
                  f"loop={st['loop_instructions']:5d} -> {st['warp_instr_per_token']:.1f} warp "
                  f"instr/token, spill ops {st['spill_ops']}, {res['reg']} regs, "
                  f"{kernel.metadata.shared} B shared -> {st['programs_per_sm']} programs/SM\n"
                  f"    {top}")
    if args.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
