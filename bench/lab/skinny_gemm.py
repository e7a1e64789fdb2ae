"""Split-K GEMMs for the decode step's projections (issue 24): a candidate for the token counts
of the decode buckets, where cuBLAS reads the weights at 34-68 % of the copy rate
(bench/results/gemm_decode_h100_s26.json). At those shapes an output tile grid leaves SMs idle
(Qwen3-4B's down projection at 256 tokens is 2 × 20 tiles of 128 × 128 on 132 SMs); splitting
the reduction axis over more programs lets every SM stream weights.

``y = x @ w.T`` (``F.linear``'s layout: ``w`` is [N, K], row-major). Each program sums one
K-range of one output tile; with more than one split the partial sums (fp32, [S, M, N]) are
added in split order by a second kernel, so the result does not depend on scheduling (no
atomics). ``swap``: the tile is computed as ``w_tile @ x_tile.T`` so that the weight rows fill
the MMA's M side when the token count is small.

    PYTHONPATH=. python3 bench/lab/skinny_gemm.py --model Qwen3-4B --tokens 1,16,64,128,256 \\
        --out $OUT/skinny_gemm.json

times cuBLAS (``F.linear``), cuBLASLt (``preferred_blas_library``) and each split-K config per
projection and token count (CUDA-graph replay, L2 flushed, median) and checks every candidate
against ``F.linear`` in fp32. ``--smoke`` runs the kernels on the CPU under Triton's
interpreter at small shapes (the test suite does this).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@triton.jit(do_not_specialize=["M"])
def _splitk_tile(x_ptr, w_ptr, out_ptr, M, N, K_SPLIT, sxm, swn, som, sos,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SWAP: tl.constexpr, UPCAST: tl.constexpr):
    """One output tile's sum over K-range program_id(2); K_SPLIT is a multiple of BLOCK_K."""
    pid_n, pid_m, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = pid_s * K_SPLIT + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm[:, None] * sxm + rk[None, :]
    w_ptrs = w_ptr + rn[:, None] * swn + rk[None, :]
    m_ok = rm[:, None] < M
    n_ok = rn[:, None] < N
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for _ in range(0, K_SPLIT, BLOCK_K):
        a = tl.load(x_ptrs, mask=m_ok, other=0.0)
        b = tl.load(w_ptrs, mask=n_ok, other=0.0)
        if UPCAST:  # the interpreter's bf16 dot is wrong
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if SWAP:
            acc = tl.dot(b, tl.trans(a), acc)
        else:
            acc = tl.dot(a, tl.trans(b), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SWAP:
        out = out_ptr + pid_s * sos + rm[None, :] * som + rn[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rm[None, :] < M) & (rn[:, None] < N))
    else:
        out = out_ptr + pid_s * sos + rm[:, None] * som + rn[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok & (rn[None, :] < N))


@triton.jit(do_not_specialize=["MN"])
def _sum_splits(part_ptr, y_ptr, MN, S: tl.constexpr, BLOCK: tl.constexpr):
    """y = Σ_s part[s] in split order, cast to y's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in tl.static_range(S):
        acc += tl.load(part_ptr + s * MN + offs, mask=ok, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


def check_config(m: int, n: int, k: int, cfg: dict) -> None:
    """Raise ValueError if cfg cannot run (m, n, k)."""
    bk, splits = cfg["block_k"], cfg["splits"]
    if k % (bk * splits):
        raise ValueError(f"K={k} is not a multiple of block_k × splits = {bk} × {splits}")
    for key in ("block_m", "block_n", "block_k"):
        if cfg[key] < 16 or cfg[key] & (cfg[key] - 1):
            raise ValueError(f"{key}={cfg[key]}: a power of two >= 16")


def splitk_linear(x: torch.Tensor, w: torch.Tensor, cfg: dict, part: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """x [M, K] @ w[N, K].T with the split-K kernels; part: an fp32 [S, M, N] buffer to reuse."""
    m, k = x.shape
    n = w.shape[0]
    check_config(m, n, k, cfg)
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("x and w need unit stride along K")
    s = cfg["splits"]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if s > 1 and part is None:
        part = torch.empty(s, m, n, dtype=torch.float32, device=x.device)
    dst = y if s == 1 else part
    interp = x.device.type != "cuda"
    grid = (triton.cdiv(n, cfg["block_n"]), triton.cdiv(m, cfg["block_m"]), s)
    _splitk_tile[grid](x, w, dst, m, n, k // s, x.stride(0), w.stride(0), n, m * n,
                       BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
                       SWAP=cfg["swap"], UPCAST=interp, num_warps=cfg.get("warps", 4),
                       num_stages=cfg.get("stages", 3))
    if s > 1:
        block = 1024
        _sum_splits[(triton.cdiv(m * n, block),)](part, y, m * n, S=s, BLOCK=block, num_warps=4)
    return y


def candidates(m: int, n: int, k: int, sms: int) -> list[dict]:
    """Configs worth timing at (m, n, k): tiles that fit m, split counts from 1 to ~2 waves."""
    out = []
    bm = min(max(16, triton.next_power_of_2(m)), 128)
    for swap in ((False, True) if m <= 64 else (False,)):
        for bn in (64, 128):
            for bk in (64, 128):
                tiles = triton.cdiv(n, bn) * triton.cdiv(m, bm)
                for s in (1, 2, 3, 4, 6, 8, 12, 16):
                    if k % (bk * s) or (s > 1 and tiles * (s - 1) >= 2 * sms):
                        continue
                    for stages in (3, 4):
                        # 4 warps spill a 128 x 128 accumulator (offline sm_90 builds)
                        out.append({"block_m": bm, "block_n": bn, "block_k": bk, "splits": s,
                                    "swap": swap, "stages": stages,
                                    "warps": 8 if bm * bn >= 128 * 128 else 4})
    return out


def _max_rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


# (M, N, K, config) run under the interpreter by --smoke and by the tests
SMOKE_CASES = [
    (3, 40, 128, {"block_m": 16, "block_n": 16, "block_k": 32, "splits": 2, "swap": False}),
    (5, 48, 192, {"block_m": 16, "block_n": 32, "block_k": 32, "splits": 3, "swap": True}),
    (20, 24, 64, {"block_m": 16, "block_n": 16, "block_k": 64, "splits": 1, "swap": False}),
    (1, 32, 64, {"block_m": 16, "block_n": 16, "block_k": 16, "splits": 4, "swap": True}),
]


def smoke() -> None:
    g = torch.Generator().manual_seed(0)
    for m, n, k, cfg in SMOKE_CASES:
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        w = torch.randn(n, k, generator=g).to(torch.bfloat16)
        ref = F.linear(x.float(), w.float())
        err = _max_rel_err(splitk_linear(x, w, cfg), ref)
        print(f"M={m} N={n} K={k} {cfg}: max rel err {err:.2e}")
        assert err < 1e-2, err


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen3-4B")
    ap.add_argument("--tokens", default="1,16,64,128,256")
    ap.add_argument("--projections", default="", help="comma list (default: all, LM head too)")
    ap.add_argument("--budget-ms", type=float, default=60.0, help="timing budget per candidate")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default="skinny_gemm.json")
    args = ap.parse_args()
    if args.smoke:
        smoke()
        return

    from bench.common import Timer, copy_bandwidth_gbs, environment
    from bench.lab.gemm_decode import pct_copy, projection_shapes

    env = {**environment(), "command": "python3 " + " ".join(sys.argv)}
    copy = copy_bandwidth_gbs()
    print(json.dumps(env), json.dumps(copy), flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    timer = Timer()
    shapes = projection_shapes(args.model, lm_head=True)
    if args.projections:
        shapes = {p: shapes[p] for p in args.projections.split(",")}
    rows = []
    for name, (k, n) in shapes.items():
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * k ** -0.5
        wbytes = w.numel() * w.element_size()
        for m in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            ref = F.linear(x.float(), w.float())
            row = {"proj": name, "in": k, "out": n, "tokens": m, "weight_mb": wbytes / 1e6}
            us = timer.graph_us(lambda: F.linear(x, w), budget_ms=args.budget_ms)["us"]
            row.update(cublas_us=us, cublas_pct_copy=pct_copy(wbytes, us, copy))
            torch.backends.cuda.preferred_blas_library("cublaslt")
            try:
                us = timer.graph_us(lambda: F.linear(x, w), budget_ms=args.budget_ms)["us"]
                row.update(cublaslt_us=us, cublaslt_pct_copy=pct_copy(wbytes, us, copy))
            finally:
                torch.backends.cuda.preferred_blas_library("cublas")
            timed = []
            for cfg in candidates(m, n, k, sms):
                part = (torch.empty(cfg["splits"], m, n, dtype=torch.float32, device="cuda")
                        if cfg["splits"] > 1 else None)
                try:
                    err = _max_rel_err(splitk_linear(x, w, cfg, part), ref)
                    us = timer.graph_us(lambda: splitk_linear(x, w, cfg, part),
                                        budget_ms=args.budget_ms)["us"]
                except Exception as e:  # a config the compiler rejects (e.g. shared memory)
                    timed.append({**cfg, "error": f"{type(e).__name__}: {e}"[:200]})
                    continue
                timed.append({**cfg, "us": us, "max_rel_err": err})
            ok = [c for c in timed if "us" in c]
            best = min(ok, key=lambda c: c["us"]) if ok else None
            if best:
                row.update(splitk_us=best["us"], splitk_pct_copy=pct_copy(wbytes, best["us"], copy),
                           splitk_best={k_: v for k_, v in best.items() if k_ != "us"},
                           splitk_vs_cublas=best["us"] / row["cublas_us"])
            row["splitk_all"] = timed
            rows.append(row)
            print(json.dumps({k_: v for k_, v in row.items() if k_ != "splitk_all"}), flush=True)
        del w
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"env": env, "copy": copy, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
