"""A driver for Nsight Compute: one decode launch, or the prefill store without and with key
centering, run between cudaProfilerStart/Stop after two warm-up calls, so that
``ncu --profile-from-start off`` sees only the launches of interest.

    ncu --clock-control none --profile-from-start off -k regex:_decode_mma --section ... \
        python3 bench/lab/ncu_kernels.py decode tq_k4v3 4/1/256 32 16384
    ncu ... -k regex:_store_kernel ... python3 bench/lab/ncu_kernels.py store tq_k4v3 16384

decode PRESET HQ/HK/D B L [SPLITS]: decode_attention_triton over B sequences of L tokens
(bench/decode.py's data), at its default split count or SPLITS; store PRESET N:
TurboQuantImpl.store of N tokens x 8 KV heads, head size 128 (bench/centering_overhead.py's
pair: uncentered, then centered). LAB_PART=P in the environment: decode_mma.LAB_PART of
bench/lab/probes/head256_parts.patch (its patched tree only).
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench.decode import make_data, fill_cache  # noqa
from tqattn.kernels.decode import decode_attention_triton  # noqa
from tqattn.quant.codec import TQCodec  # noqa

if os.environ.get("LAB_PART"):  # a tree with bench/lab/probes/head256_parts.patch applied
    from triton.experimental.gluon import language as gl
    from tqattn.kernels import decode_mma
    decode_mma.LAB_PART = gl.constexpr(int(os.environ["LAB_PART"]))
mode = sys.argv[1]
if mode == "decode":
    preset, shape, b, l = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    hq, hk, d = (int(x) for x in shape.split("/"))
    q, k, v, bt = make_data(b, l, hq, hk, d)
    codec = TQCodec(preset, d, device="cuda")
    cache = fill_cache(codec, k, v, hk)
    del k, v
    lens = torch.full((b,), l, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    splits = int(sys.argv[6]) if len(sys.argv) > 6 else None
    fns = [lambda: decode_attention_triton(codec, q, cache, bt, lens, out=out, num_splits=splits)]
else:
    from bench.centering_overhead import prefill_store
    fns = list(prefill_store(sys.argv[2], int(sys.argv[3]), "cuda"))
for f in fns + fns:  # warm-up: compile, then once more
    f()
torch.cuda.synchronize()
torch.cuda.profiler.start()
for f in fns:
    f()
torch.cuda.synchronize()
torch.cuda.profiler.stop()
print("ok", mode, sys.argv[2:])
