"""How fast one-warp programs can read a paged head-256 cache, by load method (issue 27).

At 4/1/256, B = 32, 16K the tensor-core decode runs 512 one-warp programs, one per SM scheduler,
and reads its cache at 35-42 % of the copy rate on an H200, where FA3 (bulk copies, larger
programs) reaches 85 %. This times the reads alone, with the decode's grid (B·Hk groups × the
split count, one warp each, a split's tiles of 64 tokens = 4 pages of 16 in turn) and nothing
computed but an xor of every word:

- ``ldg``: each tile's pages loaded into registers (16 bytes a lane a load), then folded;
- ``ldg_l2``: the same, the next tile's blocks prefetched into L2 while a tile is folded
  (the decode's head-256 loop where a program is alone on its scheduler);
- ``ldg2``: the next tile's pages loaded before a tile is folded (two tiles in flight);
- ``tmaN``: whole pages copied by the tensor memory accelerator into shared memory, N tiles in
  flight (an mbarrier per stage), then read from shared memory and folded;
- ``tmaNw``: the same with one 4 KB copy a page (the page and the start of the next block:
  fewer copies to issue, 12 % more bytes moved for ``tq_k4v3``).

Rates count the cache's bytes once. Pages are copied as power-of-two pieces of 16-byte rows (the
descriptors' boxes must be powers of two): ``tq_k4v3``'s 3,648-byte page is four pieces, each
landing 128-byte aligned; offline for sm_90 a tile's copies take ~390 instructions to issue in
four pieces a page, ~100 as one 4 KB copy.

    PYTHONPATH=. python3 bench/lab/load_patterns.py --out $OUT/load_patterns.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.common import Timer, copy_bandwidth_gbs, environment  # noqa: E402
from tqattn.kernels import decode_mma  # noqa: E402
from tqattn.quant.codec import TQCodec  # noqa: E402
from tqattn.quant.paged import kv_cache_shape  # noqa: E402

BS = gl.constexpr(16)      # tokens a page
PAGES = gl.constexpr(4)    # pages a tile (64 tokens)
ROWS = gl.constexpr(256)   # 16-byte rows a page slot holds (pages of up to 4 KB)
_ROWS = gl.constexpr(gl.BlockedLayout([1, 4], [32, 1], [1, 1], [1, 0]))  # [rows, 4] int32


def pieces(page_bytes: int) -> list[tuple[int, int]]:
    """(first row, rows) of the power-of-two pieces of a page of 16-byte rows, largest first."""
    if page_bytes % 16:
        raise ValueError(f"page of {page_bytes} bytes: not whole 16-byte rows")
    rows, out, at = page_bytes // 16, [], 0
    for bit in reversed(range(rows.bit_length())):
        if rows >> bit & 1:
            out.append((at, 1 << bit))
            at += 1 << bit
    if any(r * 16 % 128 for r, _ in out):
        raise ValueError(f"page of {page_bytes} bytes: a piece would land unaligned in shared "
                         f"memory ({out})")
    return out


@gluon.jit
def _split_tiles(n_tiles, SPLITS: gl.constexpr):
    split = gl.program_id(1)
    return n_tiles * split // SPLITS, n_tiles * (split + 1) // SPLITS


@gluon.jit
def _page_words(page_ptr, NROWS: gl.constexpr):
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, _ROWS))
    c = gl.arange(0, 4, layout=gl.SliceLayout(0, _ROWS))
    p = page_ptr.to(gl.pointer_type(gl.int32)) + (4 * r)[:, None] + c[None, :]
    return gl.load(p, mask=(r < NROWS)[:, None], other=0)


@gluon.jit
def _tile_pages(bt_row, t, t1):
    """The page indices of tile t (of the split's last tile past t1): four independent loads."""
    tt = gl.minimum(t, t1 - 1) * PAGES
    return (gl.load(bt_row + tt), gl.load(bt_row + tt + 1), gl.load(bt_row + tt + 2),
            gl.load(bt_row + tt + 3))


@gluon.jit
def _tile_words(base, sc_b, pages, NROWS: gl.constexpr):
    """The 4 pages' words (:func:`_page_words`) of a tile."""
    ws = ()
    for i in gl.static_range(PAGES):
        ws = ws + (_page_words(base + pages[i].to(gl.int64) * sc_b, NROWS),)
    return ws


@gluon.jit
def _ldg_kernel(cache_ptr, sc_b, sc_h, bt_ptr, sbt, seq_len, out_ptr, HK: gl.constexpr,
                SPLITS: gl.constexpr, PAGE: gl.constexpr, MODE: gl.constexpr):
    """MODE 0: a tile's pages loaded, then folded; 1: and the next tile's blocks prefetched into
    L2 meanwhile, as the decode's head-256 loop does alone on its scheduler; 2: the next tile's
    pages loaded before a tile is folded."""
    g = gl.program_id(0)
    base = cache_ptr + (g % HK).to(gl.int64) * sc_h
    bt_row = bt_ptr + (g // HK).to(gl.int64) * sbt
    t0, t1 = _split_tiles(seq_len // (PAGES * BS), SPLITS)
    NROWS: gl.constexpr = PAGE // 16
    lane = gl.arange(0, 32, layout=decode_mma._LANE)
    acc = gl.zeros([ROWS, 4], gl.int32, layout=_ROWS)
    if MODE == 2:
        nxt = _tile_words(base, sc_b, _tile_pages(bt_row, t0, t1), NROWS)
    for t in range(t0, t1):
        if MODE == 2:
            cur = nxt
            nxt = _tile_words(base, sc_b, _tile_pages(bt_row, t + 1, t1), NROWS)
        else:
            cur = _tile_words(base, sc_b, _tile_pages(bt_row, t, t1), NROWS)
            if MODE == 1:
                decode_mma._l2_prefetch(decode_mma._l2_page(t + 1, t1, seq_len, bt_row, lane, BS),
                                        base, sc_b, sc_h, lane, BS, 256)
        for i in gl.static_range(PAGES):
            acc = acc ^ cur[i]
    gl.store(out_ptr + g * SPLITS + gl.program_id(1), gl.sum(gl.sum(acc, axis=1), axis=0))


@gluon.jit
def _tma_tile(descs, smem, bar, pages, ok, head, HK: gl.constexpr, PAGE: gl.constexpr,
              P: gl.constexpr, COPY: gl.constexpr):
    """A tile's pages (indices pages) copied into smem (a stage's 4 page slots) where ok; P:
    the pieces' first rows (0 after the last); COPY: the bytes copied a page."""
    mbarrier.expect(bar, PAGES * COPY, pred=ok)
    NROWS: gl.constexpr = PAGE // 16
    for i in gl.static_range(PAGES):
        # the cache as 16-byte rows: page (pg, head) starts at row (pg · HK + head) · NROWS
        row = (pages[i] * HK + head) * NROWS
        for j in gl.static_range(5):
            if j == 0 or P[j] != 0:
                dst = smem.slice(i * ROWS + P[j], descs[j].block_shape[0], dim=0)
                tma.async_copy_global_to_shared(descs[j], [row + P[j], 0], bar, dst, pred=ok)


@gluon.jit
def _tma_kernel(d0, d1, d2, d3, d4, bt_ptr, sbt, seq_len, out_ptr, HK: gl.constexpr,
                SPLITS: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr,
                P0: gl.constexpr, P1: gl.constexpr, P2: gl.constexpr, P3: gl.constexpr,
                P4: gl.constexpr, COPY: gl.constexpr):
    g = gl.program_id(0)
    head = g % HK
    bt_row = bt_ptr + (g // HK).to(gl.int64) * sbt
    t0, t1 = _split_tiles(seq_len // (PAGES * BS), SPLITS)
    descs = (d0, d1, d2, d3, d4)
    P: gl.constexpr = (P0, P1, P2, P3, P4)
    # one allocation per stage (a stage: 4 page slots of 4 KB)
    smem = ()
    for k in gl.static_range(STAGES):
        smem = smem + (gl.allocate_shared_memory(gl.uint8, [PAGES * ROWS, 16], d0.layout),)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for k in gl.static_range(STAGES):
        mbarrier.init(bars.index(k), count=1)
    for k in gl.static_range(STAGES):
        _tma_tile(descs, smem[k], bars.index(k), _tile_pages(bt_row, t0 + k, t1), t0 + k < t1,
                  head, HK, PAGE, P, COPY)
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, _ROWS))
    acc = gl.zeros([ROWS, 4], gl.int32, layout=_ROWS)
    # stages are unrolled, so that every slot and barrier index is a constant
    for j in range(0, gl.cdiv(t1 - t0, STAGES)):
        for k in gl.static_range(STAGES):
            t = t0 + j * STAGES + k
            if t < t1:
                # the refill's page indices load while the tile is read
                nxt = _tile_pages(bt_row, t + STAGES, t1)
                mbarrier.wait(bars.index(k), j & 1)
                words = smem[k]._reinterpret(gl.int32, [PAGES * ROWS, 4],
                                             gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
                for i in gl.static_range(PAGES):
                    x = words.slice(i * ROWS, ROWS, dim=0).load(_ROWS)
                    acc = acc ^ gl.where((r < PAGE // 16)[:, None], x, 0)
                gl.thread_barrier()  # every lane has read slot k before it is refilled
                fence_async_shared()
                _tma_tile(descs, smem[k], bars.index(k), nxt, t + STAGES < t1, head, HK, PAGE, P,
                          COPY)
    for k in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(k))
    gl.store(out_ptr + g * SPLITS + gl.program_id(1), gl.sum(gl.sum(acc, axis=1), axis=0))


def descriptors(cache: torch.Tensor, page_bytes: int,
                whole: bool = False) -> tuple[list, list[int]]:
    """Five descriptors (the page's pieces, the last repeated as padding; whole: one 4 KB
    piece) over the cache as 16-byte rows, and the pieces' first rows (0 for padding)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    rows = cache.view(-1, 16)
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
    ps = [(0, ROWS.value)] if whole else pieces(page_bytes)
    if len(ps) > 5:
        raise ValueError(f"page of {page_bytes} bytes: {len(ps)} pieces, at most 5")
    descs = [TensorDescriptor.from_tensor(rows, [n, 16], layout) for _, n in ps]
    firsts = [r for r, _ in ps]
    while len(descs) < 5:
        descs.append(descs[-1])
        firsts.append(0)
    return descs, firsts


def launches(cache, bt, seq_len, hk, splits, page_bytes, method, out):
    """A callable launching one method's kernel over every (sequence, KV head) group."""
    groups = bt.shape[0] * hk
    grid = (groups, splits)
    common = dict(HK=hk, SPLITS=splits, PAGE=page_bytes, num_warps=1)
    if method.startswith("ldg"):
        mode = {"ldg": 0, "ldg_l2": 1, "ldg2": 2}[method]
        return lambda: _ldg_kernel[grid](cache, cache.stride(0), cache.stride(1), bt, bt.stride(0),
                                         seq_len, out, MODE=mode, **common)
    whole = method.endswith("w")
    stages = int(method[3:].rstrip("w"))
    descs, (p0, p1, p2, p3, p4) = descriptors(cache, page_bytes, whole)
    copy = 16 * ROWS.value if whole else page_bytes
    return lambda: _tma_kernel[grid](*descs, bt, bt.stride(0), seq_len, out, STAGES=stages,
                                     P0=p0, P1=p1, P2=p2, P3=p3, P4=p4, COPY=copy, **common)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tq_k4v3")
    ap.add_argument("--shapes", default="4/1/256:16,8/4/256:8",
                    help="Hq/Hk/D:splits, comma-separated (the decode's default split counts)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--methods", default="ldg,ldg_l2,ldg2,tma1,tma2,tma3,tma4,tma2w,tma3w")
    ap.add_argument("--out", default="load_patterns.json")
    args = ap.parse_args()
    env = {**environment(), "command": "python3 " + " ".join(sys.argv)}
    copy = copy_bandwidth_gbs()
    print(json.dumps(env), f"copy {copy['gbs_rw']:.0f} GB/s", flush=True)
    timer = Timer()
    rows = []
    for shape in args.shapes.split(","):
        heads, splits = shape.split(":")
        _, hk, d = (int(x) for x in heads.split("/"))
        codec = TQCodec(args.preset, d)
        nblk = args.batch * args.context // BS.value
        cshape = kv_cache_shape(nblk, BS.value, hk, codec)
        cache = torch.randint(-128, 128, cshape, dtype=torch.int8, device="cuda").view(torch.uint8)
        page_bytes = cache.shape[2]
        gen = torch.Generator(device="cuda").manual_seed(0)
        bt = torch.randperm(nblk, device="cuda", generator=gen).to(torch.int32)
        bt = bt.view(args.batch, args.context // BS.value)
        out = torch.empty(args.batch * hk * int(splits), dtype=torch.int32, device="cuda")
        ref = None
        for method in args.methods.split(","):
            fn = launches(cache, bt, args.context, hk, int(splits), page_bytes, method, out)
            fn()
            torch.cuda.synchronize()
            # every method folds the same words: the same xor per program
            got = out.clone()
            ref = got if ref is None else ref
            t = timer.graph_us(fn)["us"]
            nbytes = args.batch * hk * (args.context // BS.value) * page_bytes
            row = {"preset": args.preset, "heads": heads, "splits": int(splits),
                   "programs": args.batch * hk * int(splits), "method": method, "us": t,
                   "bytes": nbytes, "gbs": nbytes / t / 1e3,
                   "of_copy": nbytes / t / 1e3 / copy["gbs_rw"],
                   "same_fold": bool(torch.equal(got, ref))}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del cache
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"env": env, "copy": copy, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
