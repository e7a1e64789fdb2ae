"""Static SASS statistics of the decode kernel's main loop, compiled offline for sm_90 (no GPU).

The decode kernel is bound by instruction issue, not HBM (bench/results/decode_notes.md), so the
loop's instruction count per token is a useful proxy between GPU sessions: compile with
triton's bundled ptxas for sm_90, disassemble with nvdisasm, take the largest loop (a backward
branch) and count its instructions by opcode. Warp instructions per token = loop instructions ×
warps / BLOCK_N. At the H200's copy rate, turboquant_k3v4_nc (118 B/token/head) leaves about
28 warp instructions per token (4 schedulers/SM, 132 SMs, ~1.9 GHz).

    PYTHONPATH=. python3 bench/sass_stats.py --presets turboquant_k3v4_nc,tq_k4v3 [--set K=V ...]
    PYTHONPATH=. python3 bench/sass_stats.py --mma [--prefetch]   # the Gluon tensor-core kernel
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tqattn.kernels import decode  # noqa: E402
from tqattn.kernels._spec import kernel_spec  # noqa: E402
from tqattn.quant.codec import TQCodec  # noqa: E402

PTRS = {"q_ptr": "*fp32", "qo_ptr": "*bf16", "cache_ptr": "*u8", "bt_ptr": "*i32",
        "seqlen_ptr": "*i32",
        "qsl_ptr": "*i32", "qpos_ptr": "*i32", "lut_ptr": "*fp32", "po_ptr": "*fp32",
        "plse_ptr": "*fp32"}
FLOATS = {"scale", "softcap", "kfac", "vfac", "qscale"}
ALIGNED_INTS = {"sq_r", "sq_h", "sqo_r", "sqo_h", "sc_b", "sc_h", "sbt", "spo_r", "spo_h", "spo_s",
                "spl_r", "spl_h"}


def _signature(params, cex: dict, ptrs: dict, aligned: set) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) for triton.compile: constexprs from cex, pointers from
    ptrs, other arguments fp32 (FLOATS) or i32; pointers and the aligned ints get the 16-byte
    divisibility the launcher sees at real shapes."""
    sig, consts, attrs = {}, {}, {}
    for i, p in enumerate(params):
        if p in cex:
            sig[p] = "constexpr"
            consts[(i,)] = cex[p]
        else:
            sig[p] = ptrs.get(p, "fp32" if p in FLOATS else "i32")
            if p in ptrs or p in aligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs


def compile_decode(preset: str, d: int = 128, group: int = 4, block_size: int = 16,
                   num_warps: int | None = None, maxnreg: int | None = None, **overrides):
    """Compile _decode_split_kernel for sm_90 as the dispatch would launch it (one row/seq)."""
    spec = kernel_spec(TQCodec(preset, d), block_size)
    fn = decode._decode_split_kernel
    params = list(inspect.signature(fn.fn).parameters)
    tune = {k: overrides.pop(k) for k in list(overrides) if k in decode.DEFAULTS}
    if num_warps is not None:
        tune["num_warps"] = num_warps
    cfg, asm = decode.launch_config(spec, tune, interp=False)
    num_warps = cfg["num_warps"]
    maxnreg = maxnreg or cfg["maxnreg"]
    cex = {k: v for k, v in cfg.items() if k in params}
    cex.update(HAS_QSL=False, HAS_QPOS=False, HAS_WINDOW=False, HAS_SOFTCAP=False, GROUP=group,
               HK=8, BLOCK_M=16, FP8_NATIVE=True, **spec.meta, **asm)
    cex.update(overrides)
    sig, consts, attrs = _signature(params, cex, PTRS, ALIGNED_INTS)
    kernel = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": 1,
                                     **({"maxnreg": maxnreg} if maxnreg else {})})
    return kernel, {**cex, "num_warps": num_warps}


def compile_mma(prefetch: bool, group: int = 4, block_size: int = 16,
                reload_last: bool = False, qrot: bool = False, store: bool = False,
                assign: bool = False):
    """Compile kernels/decode_mma.py's kernel for sm_90 (turboquant_k3v4_nc, head size 128) as
    the dispatch launches it (1 warp, the register cap of its prefetch mode)."""
    from triton.experimental.gluon._runtime import GluonASTSource
    from tqattn.kernels import decode_mma

    spec = kernel_spec(TQCodec("turboquant_k3v4_nc", 128), block_size)
    m, kf = spec.meta, spec.key_fields[0]
    fn = decode_mma._decode_mma_kernel
    cex = dict(GROUP=group, HK=8, BS=block_size, K_OFF=kf.off, KN_OFF=m["KN_OFF"],
               V_OFF=spec.value_fields[0].off, VS_OFF=m["VS_OFF"], VZ_OFF=m["VZ_OFF"],
               PREFETCH=prefetch, WRITE_LSE=False, PDL=not store, RELOAD_LAST=reload_last,
               QROT=qrot or store, STORE=store, K_LUT=kf.lut, K_BND=kf.bnd, TIMELINE=False,
               L2_AHEAD=decode_mma.L2_AHEAD, ASSIGN=assign)
    ptrs = {"q_ptr": "*bf16" if qrot or store else "*fp16", "sgn_ptr": "*fp32",
            "kn_ptr": "*bf16", "vn_ptr": "*bf16", "slot_ptr": "*i64", "ftab_ptr": "*fp32",
            "ksgn_ptr": "*fp32", "cache_ptr": "*u8", "bt_ptr": "*i32", "seqlen_ptr": "*i32",
            "po_ptr": "*fp32", "plse_ptr": "*fp32", "tab_ptr": "*i32", "out_ptr": "*bf16",
            "lse_ptr": "*fp32", "count_ptr": "*i32", "tl_ptr": "*i64"}
    sig, consts, attrs = _signature(list(inspect.signature(fn.fn).parameters), cex, ptrs,
                                    {"sq_r", "sq_h", "sc_b", "sc_h", "sbt"})
    kernel = triton.compile(GluonASTSource(fn, sig, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 1, "maxnreg": decode_mma.MAXNREG[prefetch],
                                     "launch_pdl": True})
    return kernel, {"num_warps": 1, "BLOCK_N": decode_mma.TILE.value}


def disassemble(cubin: bytes) -> tuple[list[tuple[int, str]], dict[str, int]]:
    """(address, instruction) pairs and label → address."""
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                            "nvdisasm")
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


def resources(cubin: bytes) -> dict[str, int]:
    """Registers per thread, shared memory and stack per program (cuobjdump -res-usage)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    return {k.lower(): int(v) for k, v in re.findall(r"(REG|SHARED|STACK):(\d+)", text)}


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
    ap.add_argument("--warps", type=int, default=None, help="default: the dispatch's choice")
    ap.add_argument("--maxnreg", type=int, default=None, help="register cap per thread")
    ap.add_argument("--set", nargs="*", default=[], help="constexpr overrides, e.g. BLOCK_N=64")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--mma", action="store_true",
                    help="the Gluon tensor-core kernel (turboquant_k3v4_nc) instead")
    ap.add_argument("--prefetch", action="store_true", help="--mma: the prefetching variant")
    ap.add_argument("--qrot", action="store_true",
                    help="--mma: the variant that rotates the raw query itself")
    ap.add_argument("--store", action="store_true",
                    help="--mma: the variant that also stores the step's new token")
    ap.add_argument("--reload-last", action="store_true",
                    help="--mma: the variant of decode steps that store new K/V")
    ap.add_argument("--assign", action="store_true",
                    help="--mma: the variant of several splits per group (positions by arrival)")
    args = ap.parse_args()
    if args.mma:
        kernel, cex = compile_mma(args.prefetch, args.group, reload_last=args.reload_last,
                                  qrot=args.qrot, store=args.store, assign=args.assign)
        st = loop_stats(*disassemble(kernel.asm["cubin"]))
        res = resources(kernel.asm["cubin"])
        st.update(resources=res, programs_per_sm=occupancy(res, 1, kernel.metadata.shared),
                  warp_instr_per_token=st["loop_instructions"] / cex["BLOCK_N"])
        top = ", ".join(f"{k} {v}" for k, v in list(st["loop_opcodes"].items())[:args.top])
        print(json.dumps(st, indent=1) if args.json else
              f"decode_mma prefetch={args.prefetch}: loop={st['loop_instructions']} per 64 tokens "
              f"-> {st['warp_instr_per_token']:.1f} warp instr/token, spill ops "
              f"{st['spill_ops']}, {res['reg']} regs -> {st['programs_per_sm']} programs/SM\n"
              f"    {top}")
        return
    overrides = {k: (v == "True" if v in ("True", "False") else int(v))
                 for k, v in (s.split("=") for s in args.set)}
    results = []
    for preset in args.presets.split(","):
        kernel, cex = compile_decode(preset, args.head_dim, args.group, num_warps=args.warps,
                                     maxnreg=args.maxnreg, **overrides)
        st = loop_stats(*disassemble(kernel.asm["cubin"]))
        res = resources(kernel.asm["cubin"])
        st.update(resources=res, programs_per_sm=occupancy(res, cex["num_warps"],
                                                             kernel.metadata.shared))
        st.update(preset=preset, block_n=cex["BLOCK_N"], warps=cex["num_warps"],
                  warp_instr_per_token=st["loop_instructions"] * cex["num_warps"] / cex["BLOCK_N"])
        results.append(st)
        if not args.json:
            top = ", ".join(f"{k} {v}" for k, v in list(st["loop_opcodes"].items())[:args.top])
            print(f"{preset:22s} BLOCK_N={cex['BLOCK_N']:3d} loop={st['loop_instructions']:5d} "
                  f"-> {st['warp_instr_per_token']:.1f} warp instr/token, spill ops "
                  f"{st['spill_ops']}, {res['reg']} regs, {kernel.metadata.shared} B shared "
                  f"-> {st['programs_per_sm']} programs/SM\n    {top}")
    if args.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
