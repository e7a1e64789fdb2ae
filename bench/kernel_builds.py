"""Compile the kernels' product builds for sm_90 on a CPU machine, exactly as the product launches
them, and dump or compare their PTX / SASS.

The entry points (``decode_attention_triton``, ``store_kv_triton``, ``dequant_kv_triton``) run on
CPU tensors with a pretend H200 (``fake_h200``: compiled kernels, tensor cores, 132 SMs, 8
resident tensor-core programs per SM); every ``kernel[grid](...)`` call is captured instead of
launched and compiled with triton's own binder (argument specialisation, divisibility, options)
for ``GPUTarget("cuda", 90, 32)`` with the bundled ptxas. The same cases run on any tree with
these entry points (``--tree``: e.g. an export of an older commit), so two dumps compare build
by build. SASS is compared with kernel-parameter constant-bank addresses rewritten to parameter
names (a parameter added or removed shifts the others' offsets, not the code).

    PYTHONPATH=. python3 bench/kernel_builds.py --dump /tmp/builds_new
    python3 bench/kernel_builds.py --tree /tmp/old_tree --dump /tmp/builds_old   # other tree
    python3 bench/kernel_builds.py --compare /tmp/builds_old /tmp/builds_new
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = ("cuda", 90, 32)
SMS, MMA_PROGRAMS_PER_SM = 132, 8


def _tool(name: str) -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


# --- capture -----------------------------------------------------------------------------------

class Captured(list):
    """(jit function, args, kwargs) of each kernel launch inside :func:`capturing`."""


@contextlib.contextmanager
def capturing():
    from triton.runtime.jit import JITFunction
    got = Captured()
    orig = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        got.append((self, args, dict(kwargs)))

    JITFunction.run = run
    try:
        yield got
    finally:
        JITFunction.run = orig


@contextlib.contextmanager
def fake_h200():
    """Patch the device queries of tqattn.kernels so that CPU tensors take the H200's paths."""
    import importlib
    mods = {}
    for name in ("_spec", "step", "decode", "decode_mma", "store", "dequant"):
        try:
            mods[name] = importlib.import_module(f"tqattn.kernels.{name}")
        except ImportError:
            pass
    saved = []

    def patch(obj, attr, value):
        if hasattr(obj, attr):
            saved.append((obj, attr, getattr(obj, attr)))
            setattr(obj, attr, value)

    patch(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    for m in mods.values():
        patch(m, "num_sms", lambda device: SMS)
        patch(m, "interpreted", lambda device: False)    # trees with the device helpers
        patch(m, "tensor_cores", lambda device: True)
    mma = mods.get("decode_mma")
    if mma is not None:
        patch(mma, "programs_per_sm", lambda *a, **k: MMA_PROGRAMS_PER_SM)
        if "is_cuda" in (mma.supported.__code__.co_names if hasattr(mma, "supported") else ()):
            # trees that test q.is_cuda inline: the same predicate on a CUDA-looking proxy
            orig = mma.supported

            class _Cuda:
                is_cuda = True

                def __init__(self, q):
                    self.device = q.device

            patch(mma, "supported", lambda spec, q, group, plain: orig(spec, _Cuda(q), group,
                                                                      plain))
    dec = mods.get("decode")
    if dec is not None and not hasattr(dec, "interpreted") and hasattr(dec, "launch_config"):
        orig_cfg = dec.launch_config      # trees that pass the interpreter flag as an argument
        patch(dec, "launch_config", lambda spec, tune, interp: orig_cfg(spec, tune, False))
    try:
        yield
    finally:
        for obj, attr, value in reversed(saved):
            setattr(obj, attr, value)


# constexprs that a tree without the device helpers derives from the tensors' device inline
DEVICE_CONSTEXPRS = {"FP8_NATIVE": True, "TF32X3": True}


def compile_captured(fn, args, kwargs):
    """triton.compile of one captured launch, specialised as JITFunction.run would on the GPU."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import create_function_from_signature
    kwargs = dict(kwargs)
    for k, v in DEVICE_CONSTEXPRS.items():
        if k in kwargs:
            kwargs[k] = v
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    target = GPUTarget(*TARGET)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound,
                                                          specialization, options)
    if fn.is_gluon():
        from triton.experimental.gluon._runtime import GluonASTSource as Source
    else:
        Source = ASTSource
    kernel = compile(Source(fn, signature, constexprs, attrs), target=target,
                     options=options.__dict__)
    runtime = [n for n, t in signature.items() if t != "constexpr"]
    return kernel, runtime


# --- the product's launches ---------------------------------------------------------------------

def _cases():
    """name → callable running the product entry points on CPU tensors (under fake_h200)."""
    from tqattn.kernels.decode import decode_attention_triton
    from tqattn.kernels.dequant import dequant_kv_triton
    from tqattn.kernels.store import store_kv_triton
    from tqattn.quant.codec import TQCodec
    from tqattn.quant.paged import kv_cache_shape

    bs, hk = 16, 8

    def setup(preset, d, b, l, hq=32, dtype=torch.bfloat16):
        codec = TQCodec(preset, d)
        cache = torch.zeros(kv_cache_shape(64, bs, hk, codec), dtype=torch.uint8)
        bt = torch.zeros(b, l // bs, dtype=torch.int32)
        lens = torch.full((b,), l, dtype=torch.int32)
        q = torch.zeros(b, hq, d, dtype=dtype)
        return codec, q, cache, bt, lens

    def decode(preset, d=128, b=32, l=16384, hq=32, dtype=torch.bfloat16, new_kv=False, **kw):
        def run():
            codec, q, cache, bt, lens = setup(preset, d, b, l, hq, dtype)
            out = torch.empty_like(q)
            if new_kv:
                k = torch.zeros(b, hk, d, dtype=torch.bfloat16)
                kw["new_kv"] = (k, k.clone(), torch.arange(b, dtype=torch.int64))
            decode_attention_triton(codec, q, cache, bt, lens, out=out, **kw)
        return run

    def rows(preset, d=128):
        def run():
            codec, _, cache, bt, lens = setup(preset, d, 8, 4096)
            n = torch.tensor([4, 1, 7, 2, 8, 3, 5, 6], dtype=torch.int32)
            qsl = torch.zeros(9, dtype=torch.int32)
            qsl[1:] = n.cumsum(0)
            q = torch.zeros(int(n.sum()), 32, d, dtype=torch.bfloat16)
            decode_attention_triton(codec, q, cache, bt, lens, qsl, lens.clone(),
                                    return_lse=True, max_query_len=8)
        return run

    def store(preset, n, d=128, centered=False):
        def run():
            codec = TQCodec(preset, d)
            cache = torch.zeros(kv_cache_shape(n // bs + 1, bs, hk, codec), dtype=torch.uint8)
            k = torch.zeros(n, hk, d, dtype=torch.bfloat16)
            mu = torch.zeros(hk, d)
            store_kv_triton(codec, k, k.clone(), cache, torch.arange(n),
                            key_offset=(mu, mu.clone()) if centered else None)
        return run

    def dequant(preset, d=128):
        def run():
            codec, _, cache, bt, lens = setup(preset, d, 4, 8192)
            cu = torch.arange(5, dtype=torch.int32) * 8192
            out = tuple(torch.empty(4 * 8192, hk, d, dtype=torch.bfloat16) for _ in range(2))
            dequant_kv_triton(codec, cache, bt, lens, cu, 8192, torch.bfloat16, out)
        return run

    k3 = "turboquant_k3v4_nc"
    cases = {
        # tensor-core kernel: several splits per group (positions by arrival), one split,
        # with the step's new K/V, GQA 8, the LSE, an fp16 query
        "mma_b32": decode(k3), "mma_b128": decode(k3, b=128, l=4096),
        "mma_b32_new_kv": decode(k3, new_kv=True), "mma_b128_new_kv": decode(k3, b=128, l=4096,
                                                                            new_kv=True),
        "mma_b8_gqa8": decode(k3, b=8, hq=64), "mma_b32_lse": decode(k3, return_lse=True),
        "mma_b32_fp16": decode(k3, dtype=torch.float16),
        # its 4-bit-key / rotated-3-bit-value format
        "mma_tq_k4v3_b32": decode("tq_k4v3"), "mma_tq_k4v3_b128": decode("tq_k4v3", b=128, l=4096),
        "mma_tq_k4v3_b8_gqa8": decode("tq_k4v3", b=8, hq=64),
        "mma_tq_k4v3_lse": decode("tq_k4v3", return_lse=True),
        # 3-bit keys in the column-major values' token order, 3-bit uniform values
        "mma_3bit_nc_b32": decode("turboquant_3bit_nc"),
        "mma_3bit_nc_b128": decode("turboquant_3bit_nc", b=128, l=4096),
        "mma_3bit_nc_b8_gqa8": decode("turboquant_3bit_nc", b=8, hq=64),
        "mma_tq_k3v3_b32": decode("tq_k3v3"),
        # fp8 row keys (unrotated), 4-bit uniform values
        "mma_k8v4_b32": decode("turboquant_k8v4"),
        "mma_k8v4_b128": decode("turboquant_k8v4", b=128, l=4096),
        "mma_k8v4_b8_gqa8": decode("turboquant_k8v4", b=8, hq=64),
        # portable kernel (+ merge): k3v4_nc off the tensor-core path, other presets
        "portable_k3v4_nc_rows": rows(k3), "portable_k3v4_nc_d64": decode(k3, d=64, window=1024),
        "portable_k3v4_nc_window": decode(k3, window=1024, softcap=30.0),
        "portable_tq_k4v3": rows("tq_k4v3"), "portable_turboquant_k8v4": rows(
            "turboquant_k8v4"), "portable_tq_k3o4v3.5": decode("tq_k3o4v3.5"),
        "portable_tq_k3.5v3.5": decode("tq_k3.5v3.5"), "portable_turboquant_4bit_nc": decode(
            "turboquant_4bit_nc"),
        # the step's new K/V stored by the tensor-core kernel in the other formats
        "mma_tq_k4v3_new_kv": decode("tq_k4v3", new_kv=True),
        "mma_tq_k4v3_b128_new_kv": decode("tq_k4v3", b=128, l=4096, new_kv=True),
        "mma_4bit_nc_new_kv": decode("turboquant_4bit_nc", new_kv=True),
        "mma_3bit_nc_new_kv": decode("turboquant_3bit_nc", new_kv=True),
        "mma_tq_k3v3_new_kv": decode("tq_k3v3", new_kv=True),
        # rotated 4-bit row values (LUT4_PAIRS)
        "mma_tq_k4v4_b32": decode("tq_k4v4"), "mma_tq_k4v4_b128": decode("tq_k4v4", b=128, l=4096),
        "mma_tq_k4v4_b8_gqa8": decode("tq_k4v4", b=8, hq=64),
        "mma_tq_k4v4_new_kv": decode("tq_k4v4", new_kv=True),
        "mma_tq_k3v4_b32": decode("tq_k3v4"), "mma_tq_k3v4_new_kv": decode("tq_k3v4", new_kv=True),
    }
    # head sizes 64 and 256 (no fused store): GQA 4 and 8, one split
    for p in (k3, "tq_k4v3", "turboquant_4bit_nc", "turboquant_3bit_nc", "tq_k3v3", "tq_k4v4",
              "tq_k3v4"):
        cases[f"mma_d64_{p}_b32"] = decode(p, d=64)
        cases[f"mma_d64_{p}_b8_gqa8"] = decode(p, d=64, b=8, hq=64)
        cases[f"mma_d64_{p}_b128"] = decode(p, d=64, b=128, l=4096)
        # head size 256 (two 128-coordinate halves): GQA 2 and 4 (Gemma 3)
        cases[f"mma_d256_{p}_b32"] = decode(p, d=256, hq=16)
        cases[f"mma_d256_{p}_b8_gqa4"] = decode(p, d=256, b=8, hq=32)
        cases[f"mma_d256_{p}_b128"] = decode(p, d=256, b=128, l=4096, hq=16)
    for p in (k3, "tq_k4v3", "turboquant_k8v4", "tq_k3o4v3.5", "tq_k3.5v3.5"):
        for n in (32, 128, 2048):
            cases[f"store_{p}_{n}"] = store(p, n)
            cases[f"store_centered_{p}_{n}"] = store(p, n, centered=True)
        cases[f"dequant_{p}"] = dequant(p)
    return cases


# --- SASS --------------------------------------------------------------------------------------

def _param_table(ptx: str, names: list[str]) -> list[tuple[int, int, str]]:
    """(cbank offset, size, name) of the entry's parameters, from the PTX param list (names of
    the runtime arguments in order, then triton's scratch pointers)."""
    entry = re.search(r"\.entry\s+\w+\s*\((.*?)\)", ptx, re.S).group(1)
    out, off = [], 0x210          # sm_90: kernel parameters start at c[0x0][0x210]
    for i, m in enumerate(re.finditer(r"\.param\s+\.(\w+)(?:\s+\.ptr[^_]*?)?(?:\s+\.align\s+\d+)?"
                                      r"\s+\w+", entry)):
        size = int(re.search(r"\d+", m.group(1)).group()) // 8 if m.group(1) != "pred" else 1
        off = (off + size - 1) // size * size
        out.append((off, size, names[i] if i < len(names) else f"scratch{i - len(names)}"))
        off += size
    return out


def sass(cubin: bytes, params: list[tuple[int, int, str]]) -> list[str]:
    """Instruction lines of the cubin (nvdisasm), addresses dropped, parameter reads named."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_tool("nvdisasm"), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout

    def name(m):
        off = int(m.group(1), 16)
        for start, size, n in params:
            if start <= off < start + size:
                return f"c[0x0][{n}+{off - start}]" if off > start else f"c[0x0][{n}]"
        return m.group(0)

    out = []
    for line in text.splitlines():
        s = line.strip()
        if re.match(r"^\.L_x_\d+:", s):
            out.append(s)
            continue
        m = re.match(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", s)
        if m:
            out.append(re.sub(r"c\[0x0\]\[(0x[0-9a-f]+)\]", name, m.group(1)))
    return out


def resources(cubin: bytes) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True,
                              text=True, check=True).stdout
    return {k.lower(): int(v) for k, v in re.findall(r"(REG|SHARED|STACK):(\d+)", text)}


def dump(out_dir: str, only: str | None = None) -> None:
    os.makedirs(out_dir, exist_ok=True)
    summary = {}
    seen = {}
    for name, run in _cases().items():
        if only and not re.search(only, name):
            continue
        with fake_h200(), capturing() as got:
            run()
        for i, (fn, args, kwargs) in enumerate(got):
            kernel, runtime = compile_captured(fn, args, kwargs)
            tag = f"{name}.{i}.{fn.__name__}"
            lines = sass(kernel.asm["cubin"], _param_table(kernel.asm["ptx"], runtime))
            body = "\n".join(lines) + "\n"
            with open(os.path.join(out_dir, tag + ".sass"), "w") as f:
                f.write(body)
            with open(os.path.join(out_dir, tag + ".ptx"), "w") as f:
                f.write(kernel.asm["ptx"])
            res = resources(kernel.asm["cubin"])
            summary[tag] = {"kernel": fn.__name__, "instructions": sum(
                1 for x in lines if not x.startswith(".L_x_")), "spills": sum(
                1 for x in lines if re.match(r"(@\S+\s+)?(STL|LDL)\b", x)), **res,
                "shared_bytes": kernel.metadata.shared, "num_warps": kernel.metadata.num_warps,
                "same_as": seen.get(body)}
            seen.setdefault(body, tag)
            print(tag, json.dumps(summary[tag]), flush=True)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)


def compare(a_dir: str, b_dir: str) -> int:
    """Per build: identical SASS, or the first differing lines; returns the count of
    differing or missing builds."""
    a = json.load(open(os.path.join(a_dir, "summary.json")))
    b = json.load(open(os.path.join(b_dir, "summary.json")))
    bad = 0
    for tag in sorted(set(a) | set(b)):
        if tag not in a or tag not in b:
            print(f"{tag}: only in {'new' if tag in b else 'old'}")
            bad += 1
            continue
        sa = open(os.path.join(a_dir, tag + ".sass")).read().splitlines()
        sb = open(os.path.join(b_dir, tag + ".sass")).read().splitlines()
        regs = f"{a[tag]['reg']}/{b[tag]['reg']} regs, {len(sa)}/{len(sb)} lines"
        if sa == sb:
            print(f"{tag}: identical SASS ({regs})")
            continue
        bad += 1
        diff = [(i, x, y) for i, (x, y) in enumerate(zip(sa, sb)) if x != y][:3]
        print(f"{tag}: DIFFERS ({regs}); first: {diff}")
    return bad


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", default=None, help="repository root to import tqattn from")
    ap.add_argument("--dump", default=None, help="output folder")
    ap.add_argument("--only", default=None, help="regex of case names")
    ap.add_argument("--compare", nargs=2, default=None, metavar=("OLD", "NEW"))
    args = ap.parse_args()
    if args.compare:
        sys.exit(1 if compare(*args.compare) else 0)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the kernels must be compiled, not interpreted")
    sys.path.insert(0, os.path.abspath(args.tree or HERE))
    dump(args.dump, args.only)


if __name__ == "__main__":
    main()
