"""Kernels vs their references on the GPU at real shapes (``pytest -m gpu tests/kernels``)."""

import pytest
import torch

from tests.kernels._util import filled_cache, kernel_presets, random_block_table, rel_err, slots_for
from tqattn.quant import paged
from tqattn.quant.codec import TQCodec

pytestmark = pytest.mark.gpu

ALL = kernel_presets(128)   # every preset the kernels take
DEV = "cuda"


def _codec(name, d):
    return TQCodec(name, d, device=DEV)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("name", ALL)
def test_store_gpu(name, d):
    from tqattn.kernels.store import store_kv_triton
    codec = _codec(name, d)
    hk, bs, n = 8, 16, 512
    nb = n // bs + 4
    init = torch.randint(0, 256, paged.kv_cache_shape(nb, bs, hk, codec), dtype=torch.uint8,
                         device=DEV)
    k = torch.randn(n, hk, d, device=DEV, dtype=torch.bfloat16) * 2
    v = torch.randn(n, hk, d, device=DEV, dtype=torch.bfloat16)
    k[5, 1, 7] = float("nan")
    v[9, 0, 3] = float("inf")
    slots = torch.randperm(nb * bs, device=DEV)[:n]
    slots[::50] = -1
    a, b = init.clone(), init.clone()
    paged.store_ref(codec, k, v, a, slots)
    store_kv_triton(codec, k, v, b, slots)
    # codes may differ where the kernel's fp32 norm / rotation (other summation order than
    # cuBLAS) moves a coordinate across a bucket boundary: ~1e-3 of the bytes measured on H200
    frac = (a != b).float().mean().item()
    assert frac < 5e-3, f"{frac:.2e} of the cache bytes differ"
    keep = slots >= 0
    bt = torch.arange(nb, device=DEV, dtype=torch.int32)[None]
    ka, va = paged.dequant_ref(codec, a, bt, torch.tensor([nb * bs], device=DEV))
    kb, vb = paged.dequant_ref(codec, b, bt, torch.tensor([nb * bs], device=DEV))
    fin = torch.isfinite(ka).all(-1) & torch.isfinite(va).all(-1)
    assert torch.equal(fin, torch.isfinite(kb).all(-1) & torch.isfinite(vb).all(-1))
    assert rel_err(kb[fin], ka[fin]) < 2e-3 and rel_err(vb[fin], va[fin]) < 2e-3
    assert int((~fin).sum()) >= 2 and bool(keep.any())


@pytest.mark.parametrize("n", [4, 4096])        # key splits (decode sizes) / one program a row
@pytest.mark.parametrize("name", ["turboquant_k3v4_nc", "tq_k4v3", "tq_k3o4v3.5", "turboquant_k8v4"])
def test_store_centered_gpu(name, n):
    """The store centering the keys itself (key_offset) vs the reference on k − μ, keys mostly
    offset (Qwen2.5's worst layers)."""
    from tqattn.attention.backend import AttentionLayerSpec
    from tqattn.attention.key_centering import KeyOffset
    from tqattn.kernels.store import store_kv_triton
    d, hk, bs = 128, 8, 16
    codec = _codec(name, d)
    nb = n // bs + 4
    mu = torch.randn(hk, d, device=DEV) * 4
    k = (mu + torch.randn(n, hk, d, device=DEV)).to(torch.bfloat16)
    v = torch.randn(n, hk, d, device=DEV, dtype=torch.bfloat16)
    slots = torch.randperm(nb * bs, device=DEV)[:n]
    spec = AttentionLayerSpec(layer_idx=0, num_heads=hk, num_kv_heads=hk, head_size=d,
                              scale=d ** -0.5, dtype=torch.bfloat16, kv_cache_dtype=name)
    offset = KeyOffset(mu, spec).for_store(codec.rotation)
    init = torch.randint(0, 256, paged.kv_cache_shape(nb, bs, hk, codec), dtype=torch.uint8,
                         device=DEV)
    a, b = init.clone(), init.clone()
    paged.store_ref(codec, k.float() - offset[0], v, a, slots)
    store_kv_triton(codec, k, v, b, slots, key_offset=offset)
    frac = (a != b).float().mean().item()
    assert frac < 5e-3, f"{frac:.2e} of the cache bytes differ"
    bt = torch.arange(nb, device=DEV, dtype=torch.int32)[None]
    ka, _ = paged.dequant_ref(codec, a, bt, torch.tensor([nb * bs], device=DEV))
    kb, _ = paged.dequant_ref(codec, b, bt, torch.tensor([nb * bs], device=DEV))
    sel = torch.zeros(nb * bs, dtype=torch.bool, device=DEV)
    sel[slots] = True
    assert rel_err(kb[sel], ka[sel]) < 2e-3


def _decode_case(name, d, hk, group, bs, lens, dtype=torch.bfloat16, **kw):
    from tqattn.kernels.decode import decode_attention_triton
    codec = _codec(name, d)
    # stale page tails: the kernel reads key planes by whole pages and must ignore them
    cache, bt, seq_lens = filled_cache(codec, lens, hk, bs, device=DEV, key_scale=2.0,
                                       stale=True)
    rows = kw.pop("rows", None)
    qsl = qpos = None
    nrows = len(lens)
    if rows is not None:
        qsl = torch.tensor([0] + list(torch.tensor(rows).cumsum(0)), dtype=torch.int32,
                           device=DEV)
        nrows = sum(rows)
        if kw.pop("continuation", False):
            qpos = seq_lens.clone()
    q = torch.randn(nrows, hk * group, d, device=DEV, dtype=dtype)
    splits = kw.pop("num_splits", None)  # the kernel's work split; the reference has none
    ref, lse_ref = paged.decode_attention_ref(codec, q, cache, bt, seq_lens, qsl, qpos,
                                              return_lse=True, **kw)
    out, lse = decode_attention_triton(codec, q, cache, bt, seq_lens, qsl, qpos,
                                       return_lse=True, num_splits=splits, **kw)
    assert out.dtype == dtype
    assert rel_err(out, ref) < 1e-2
    fin = torch.isfinite(lse_ref)
    assert torch.equal(fin, torch.isfinite(lse))
    assert (lse[fin] - lse_ref[fin]).abs().max().item() < 1e-2


@pytest.mark.parametrize("name", ALL)
def test_decode_presets_gpu(name):
    _decode_case(name, 128, 8, 4, 16, [1, 700, 4100, 2000])


@pytest.fixture
def portable(monkeypatch):
    """The portable Triton kernel for every layout (no tensor-core kernel)."""
    from tqattn.kernels import step
    monkeypatch.setattr(step, "tensor_cores", lambda device: False)


@pytest.mark.parametrize("name", ["turboquant_k3v4_nc", "turboquant_3bit_nc", "tq_k3v4"])
def test_decode_without_asm_gpu(name, monkeypatch, portable):
    """The generic Triton conversions (the interpreter's path) on the GPU too: the kernel
    configured as under the interpreter, compiled."""
    from tqattn.kernels import decode
    config = decode.launch_config
    monkeypatch.setattr(decode, "launch_config", lambda spec, interp: config(spec, True))
    _decode_case(name, 128, 8, 4, 16, [1, 700, 4100, 2000])


MMA_PRESETS = ["turboquant_k3v4_nc", "tq_k4v3", "turboquant_4bit_nc", "turboquant_3bit_nc", "tq_k3v3",
               "turboquant_k8v4", "tq_k4v4", "tq_k3v4"]


@pytest.mark.parametrize("name", MMA_PRESETS)
def test_decode_mma_path_gpu(name, monkeypatch):
    """Head size 128 runs the Gluon tensor-core kernel (kernels/decode_mma.py) for its formats
    (3-bit keys + uniform 4-bit values, storing new tokens itself; 4-bit keys + rotated 3-bit
    values, 4-bit keys + uniform 4-bit values, 3-bit keys + uniform or rotated 3-bit
    column-major values, fp8 keys + uniform 4-bit values, after the store kernel): page sizes, GQA 7
    and 3, sequences of 0 tokens and of fewer tiles than splits, several split counts (ranges
    by program age, positions by arrival); the last split of each group merges and resets its
    counter. The portable
    kernel's inline-asm path for the same layout stays covered with the tensor-core kernel
    off."""
    from tqattn.kernels import decode_mma, step
    from tqattn.kernels._spec import kernel_spec
    q = torch.zeros(1, 8, 128, device=DEV)
    spec = kernel_spec(_codec(name, 128), 16)
    fp8_ok = torch.cuda.get_device_capability() >= (8, 9)   # cvt from e4m3: sm_89+
    assert step.tensor_core_decode(spec, q, 1, True) == (spec.mma.keys != 2 or fp8_ok)
    assert not step.tensor_core_decode(spec, q, 1, False)
    want = step.STORE_KERNEL if name == "turboquant_k8v4" else step.DECODE_KERNEL
    assert step.decode_kernel_store(spec, q, 1, True) == want
    assert step.decode_kernel_store(spec, q, 1, False) == step.STORE_KERNEL
    assert step.decode_kernel_store(kernel_spec(_codec("turboquant_k8v4", 128), 16), q, 1,
                                    True) == step.STORE_KERNEL
    for bs in (16, 32, 64):
        _decode_case(name, 128, 2, 7, bs, [63, 64, 65, 129, 5000, 1])
    _decode_case(name, 128, 2, 3, 16, [0, 300, 64])
    for splits in (1, 2, 3, 40):
        _decode_case(name, 128, 3, 4, 16, [5000, 17, 2500, 0, 700], num_splits=splits)
    torch.cuda.synchronize()
    counters = [c for bufs in decode_mma._COUNTERS.values() for c in bufs]
    assert counters and all(int(c.abs().sum()) == 0 for c in counters)
    monkeypatch.setattr(step, "tensor_cores", lambda device: False)
    _decode_case(name, 128, 8, 4, 16, [1, 700, 4100, 2000])


@pytest.mark.parametrize("name", MMA_PRESETS)
@pytest.mark.parametrize("bs", [16, 64])
def test_decode_mma_splits_gpu(name, bs, monkeypatch):
    """The tensor-core kernel (its own query rotation): splits of one partial tile, of full
    tiles only, of full tiles and the partial one, empty splits, sequences of 0 and 1 tokens;
    and against the portable kernel (query rotated by a GEMM): only fp16 roundings of the
    query differ."""
    from tqattn.kernels import step
    from tqattn.kernels.decode import decode_attention_triton
    lens = [63, 64, 65, 128, 129, 191, 5000, 1, 0]
    for splits in (None, 1, 3, 40):
        _decode_case(name, 128, 2, 7, bs, lens, num_splits=splits)
    codec = _codec(name, 128)
    cache, bt, seq_lens = filled_cache(codec, [3000, 17, 900], 4, bs, device=DEV)
    for dtype in (torch.bfloat16, torch.float16):
        q = torch.randn(3, 32, 128, device=DEV, dtype=dtype)
        got = decode_attention_triton(codec, q, cache, bt, seq_lens)
        with monkeypatch.context() as m:
            m.setattr(step, "tensor_cores", lambda device: False)
            want = decode_attention_triton(codec, q, cache, bt, seq_lens)
        assert rel_err(got, want) < 2e-3


def _new_token_cache(codec, lens, hk, bs=16):
    """A filled cache whose sequences' last slots take a decode step's new tokens: (cache, block
    table, seq_lens, slots)."""
    cache, bt, seq_lens = filled_cache(codec, lens, hk, bs, device=DEV)
    slots = torch.cat([slots_for(bt, b, torch.tensor([n - 1], device=DEV), bs)
                       for b, n in enumerate(lens)])
    return cache, bt, seq_lens, slots


MMA64_PRESETS = ["turboquant_k3v4_nc", "tq_k4v3", "turboquant_4bit_nc", "turboquant_3bit_nc",
                 "tq_k3v3", "tq_k4v4", "tq_k3v4"]


@pytest.mark.parametrize("name", MMA64_PRESETS)
def test_decode_mma_head64_gpu(name, monkeypatch):
    """Head size 64 on the tensor-core kernel (D = 64): page sizes, GQA 3 and 7 (SmolLM2,
    Qwen2.5-0.5B) and 8, sequences of 0 and 1 tokens and of fewer tiles than splits, several
    split counts; against the portable kernel too; a step's new K/V go through the store kernel
    first (no fused store at 64)."""
    from tqattn.kernels import step
    from tqattn.kernels._spec import kernel_spec
    from tqattn.kernels.decode import decode_attention_triton
    from tqattn.kernels.store import store_kv_triton
    q = torch.zeros(1, 8, 64, device=DEV)
    spec = kernel_spec(_codec(name, 64), 16)
    assert step.tensor_core_decode(spec, q, 1, True)
    assert step.decode_kernel_store(spec, q, 1, True) == step.STORE_KERNEL
    for bs in (16, 32, 64):
        _decode_case(name, 64, 2, 7, bs, [63, 64, 65, 129, 5000, 1])
    _decode_case(name, 64, 3, 3, 16, [0, 300, 64, 2000])
    _decode_case(name, 64, 1, 8, 16, [4100, 17], dtype=torch.float16)
    for splits in (None, 1, 3, 40):
        _decode_case(name, 64, 3, 4, 16, [5000, 17, 2500, 0, 700], num_splits=splits)
    codec = _codec(name, 64)
    cache, bt, seq_lens = filled_cache(codec, [3000, 17, 900], 2, 16, device=DEV)
    q = torch.randn(3, 14, 64, device=DEV, dtype=torch.bfloat16)
    got = decode_attention_triton(codec, q, cache, bt, seq_lens)
    with monkeypatch.context() as m:
        m.setattr(step, "tensor_cores", lambda device: False)
        want = decode_attention_triton(codec, q, cache, bt, seq_lens)
    assert rel_err(got, want) < 2e-3
    # the new token overwrites each sequence's last slot
    cache, bt, seq_lens, slots = _new_token_cache(codec, [900, 3000, 17, 64], 2)
    q = torch.randn(4, 6, 64, device=DEV, dtype=torch.bfloat16)
    k, v = torch.randn(2, 4, 2, 64, device=DEV, dtype=torch.bfloat16)
    a = cache.clone()
    store_kv_triton(codec, k, v, a, slots)
    want = decode_attention_triton(codec, q, a, bt, seq_lens)
    got = decode_attention_triton(codec, q, cache, bt, seq_lens, new_kv=(k, v, slots))
    assert torch.equal(a, cache) and rel_err(got, want) < 1e-4


@pytest.mark.parametrize("name", MMA64_PRESETS)
def test_decode_mma_head256_gpu(name, monkeypatch):
    """Head size 256 on the tensor-core kernel (D = 256: two 128-coordinate halves): page sizes,
    GQA 2 and 4 (Gemma 3) and 8, sequences of 0 and 1 tokens and of fewer tiles than splits,
    several split counts; against the portable kernel too (a step's new K/V, which the kernel
    stores itself: test_decode_fused_store_gpu)."""
    from tqattn.kernels import step
    from tqattn.kernels._spec import kernel_spec
    from tqattn.kernels.decode import decode_attention_triton
    q = torch.zeros(1, 4, 256, device=DEV)
    spec = kernel_spec(_codec(name, 256), 16)
    assert step.tensor_core_decode(spec, q, 1, True)
    assert step.decode_kernel_store(spec, q, 1, True) == step.DECODE_KERNEL
    for bs in (16, 32, 64):
        _decode_case(name, 256, 2, 4, bs, [63, 64, 65, 129, 3000, 1])
    _decode_case(name, 256, 4, 2, 16, [0, 300, 64, 2000])
    _decode_case(name, 256, 1, 8, 16, [4100, 17], dtype=torch.float16)
    for splits in (None, 1, 3, 40):
        _decode_case(name, 256, 2, 2, 16, [3000, 17, 2500, 0, 700], num_splits=splits)
    codec = _codec(name, 256)
    cache, bt, seq_lens = filled_cache(codec, [3000, 17, 900], 2, 16, device=DEV)
    q = torch.randn(3, 8, 256, device=DEV, dtype=torch.bfloat16)
    got = decode_attention_triton(codec, q, cache, bt, seq_lens)
    with monkeypatch.context() as m:
        m.setattr(step, "tensor_cores", lambda device: False)
        want = decode_attention_triton(codec, q, cache, bt, seq_lens)
    # two bf16 outputs of 16-bit-operand vs fp32 math: 2.05e-3 apart for turboquant_4bit_nc on
    # the H200 (one bf16 rounding alone is ~1.7e-3); each is held to the reference above
    assert rel_err(got, want) < 3e-3


def _replay_new_tokens(codec, step, q, k, v, a, slots, check):
    """Capture step(out) — a decode step that stores k, v at slots — in a CUDA graph; replay it
    twice with new q, k, v, storing them into the reference cache ``a`` with the store kernel,
    and check(out) after each replay."""
    from tqattn.kernels.store import store_kv_triton
    out = torch.empty_like(q)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step(out)
    for _ in range(2):
        k.copy_(torch.randn_like(k))
        v.copy_(torch.randn_like(v))
        q.copy_(torch.randn_like(q))
        g.replay()
        store_kv_triton(codec, k, v, a, slots)
        torch.cuda.synchronize()
        check(out)


@pytest.mark.parametrize("key_splits", [1, 2, 4])
def test_decode_with_new_kv_gpu(key_splits, monkeypatch, portable):
    """The step's new K/V handed to the portable decode: stored by the store kernel first (with
    1, 2 or 4 programs per key row block; test_decode_fused_store_gpu: by the tensor-core
    kernel) — the same cache bytes and output as store, then decode, eager and replayed from a
    CUDA graph with new tokens."""
    from tqattn.kernels import store
    from tqattn.kernels.decode import decode_attention_triton
    from tqattn.kernels.store import store_kv_triton
    monkeypatch.setattr(store, "auto_key_splits", lambda n_kv, device: key_splits)
    codec = _codec("turboquant_k3v4_nc", 128)
    # the new token overwrites each sequence's last slot
    cache, bt, seq_lens, slots = _new_token_cache(codec, [900, 3000, 17, 64], 8)
    q = torch.randn(4, 32, 128, device=DEV, dtype=torch.bfloat16)
    k, v = torch.randn(2, 4, 8, 128, device=DEV, dtype=torch.bfloat16)
    a, b = cache.clone(), cache.clone()
    store_kv_triton(codec, k, v, a, slots)
    want = decode_attention_triton(codec, q, a, bt, seq_lens)
    got = decode_attention_triton(codec, q, b, bt, seq_lens, new_kv=(k, v, slots))
    assert torch.equal(a, b) and rel_err(got, want) < 1e-4

    def check(out):
        assert torch.equal(a, b)
        assert rel_err(out, decode_attention_triton(codec, q, a, bt, seq_lens)) < 1e-4

    _replay_new_tokens(codec, lambda out: decode_attention_triton(
        codec, q, b, bt, seq_lens, new_kv=(k, v, slots), out=out), q, k, v, a, slots, check)


@pytest.mark.parametrize("name", ["turboquant_k3v4_nc", "tq_k4v3", "turboquant_4bit_nc",
                                  "turboquant_3bit_nc", "tq_k3v3", "tq_k4v4", "tq_k3v4"])
@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("d", [128, 256])
def test_decode_fused_store_gpu(bs, name, d):
    """The tensor-core decode kernel stores each sequence's new token itself (its last
    split, before reading) — the cache as the store kernel writes it up to codes on bucket
    boundaries and as its PyTorch twin writes it, the same output, padding slots untouched,
    non-finite rows marked; eager and replayed from a CUDA graph; head sizes 128 and 256."""
    from tqattn.kernels._spec import kernel_spec
    from tqattn.kernels.decode import decode_attention_triton
    from tqattn.kernels.decode_mma import store_new_token_ref
    from tqattn.kernels.store import store_kv_triton
    codec = _codec(name, d)
    lens = [900, 3000, 17, 64, 1, 129]
    cache, bt, seq_lens, slots = _new_token_cache(codec, lens, 8, bs)
    slots[3] = -1                                   # a padding entry: nothing stored
    q = torch.randn(len(lens), 32, d, device=DEV, dtype=torch.bfloat16)
    k, v = torch.randn(2, len(lens), 8, d, device=DEV, dtype=torch.bfloat16)
    k[1, 3, d - 5] = float("nan")                   # in the second half at 256
    v[2, 6, 1] = float("inf")

    def check(a, b):
        ka, va = paged.dequant_ref(codec, a, bt, seq_lens)
        kb, vb = paged.dequant_ref(codec, b, bt, seq_lens)
        for x, y in ((ka, kb), (va, vb)):
            assert torch.equal(x.isnan(), y.isnan())
            fin = ~x.isnan()
            assert rel_err(y[fin], x[fin]) < 2e-3
        assert (a != b).float().mean().item() < 1e-3
        last = torch.tensor(lens, device=DEV).cumsum(0) - 1      # each sequence's new token
        for x, y in ((ka[last], kb[last]), (va[last], vb[last])):
            fin = ~x.isnan()
            assert rel_err(y[fin], x[fin]) < 1e-2

    a, b, c = cache.clone(), cache.clone(), cache.clone()
    store_kv_triton(codec, k, v, a, slots)
    fused = dict(new_kv=(k, v, slots))
    got = decode_attention_triton(codec, q, b, bt, seq_lens, **fused)
    check(a, b)
    store_new_token_ref(kernel_spec(codec, bs), k, v, c, slots)
    # the same fp32 arithmetic: at most a code on a bucket boundary apart (a wrong field or
    # packing would differ in every written token)
    assert int((b != c).sum()) <= 8, int((b != c).sum())
    ok = torch.ones(len(lens), dtype=torch.bool)
    ok[[1, 2]] = False                              # the sequences with non-finite rows
    want = decode_attention_triton(codec, q, a, bt, seq_lens)
    assert rel_err(got[ok], want[ok]) < 2e-3

    def check_replay(out):
        check(a, b)
        assert rel_err(out, decode_attention_triton(codec, q, a, bt, seq_lens)) < 2e-3

    _replay_new_tokens(codec, lambda out: decode_attention_triton(
        codec, q, b, bt, seq_lens, out=out, **fused), q, k, v, a, slots, check_replay)


@pytest.mark.parametrize("name", MMA_PRESETS)
def test_decode_long_split_gpu(name, monkeypatch):
    """One split over 32K tokens: the accumulator sums 32K products, where a cancelling
    offset in it (an earlier value trick) lost the output to the tensor cores' truncating
    fp32 accumulation."""
    from tqattn.kernels.decode import decode_attention_triton
    codec = _codec(name, 128)
    cache, bt, seq_lens = filled_cache(codec, [32768, 20000], 2, 16, device=DEV, key_scale=2.0)
    q = torch.randn(2, 8, 128, device=DEV, dtype=torch.bfloat16)
    ref = paged.decode_attention_ref(codec, q, cache, bt, seq_lens)
    from tqattn.kernels import step
    for splits in (1, 7):
        for mma in (True, False):
            with monkeypatch.context() as m:
                if not mma:
                    m.setattr(step, "tensor_cores", lambda device: False)
                out = decode_attention_triton(codec, q, cache, bt, seq_lens, num_splits=splits)
            assert rel_err(out, ref) < 1e-2, (splits, mma)


@pytest.mark.parametrize("d", [64, 80, 96, 192, 256])
@pytest.mark.parametrize("name", ["turboquant_k3v4_nc", "tq_k3.5v3.5", "turboquant_k8v4"])
def test_decode_head_sizes_gpu(name, d):
    _decode_case(name, d, 4, 2, 16, [300, 1500])


@pytest.mark.parametrize("group,bs,dtype", [(1, 32, torch.float16), (2, 64, torch.bfloat16),
                                            (8, 16, torch.float16), (6, 32, torch.bfloat16)])
def test_decode_gqa_blocks_gpu(group, bs, dtype):
    _decode_case("turboquant_k3v4_nc", 128, 4, group, bs, [900, 3000, 17], dtype=dtype)


@pytest.mark.parametrize("name", ["turboquant_4bit_nc", "tq_k4v4", "turboquant_k3v4_nc",
                                  "tq_k4v3"])
def test_decode_options_gpu(name):
    _decode_case(name, 128, 8, 4, 16, [2000, 300], window=256, softcap=20.0)
    _decode_case(name, 128, 8, 4, 16, [2000, 300, 50], rows=[5, 17, 3])
    _decode_case(name, 128, 8, 4, 16, [2000, 300, 50], rows=[40, 1, 0], continuation=True,
                 window=100)


def test_decode_cuda_graph_gpu():
    from tqattn.kernels.decode import decode_attention_triton
    codec = _codec("turboquant_k3v4_nc", 128)
    cache, bt, _ = filled_cache(codec, [3000, 3000, 3000, 3000], 8, 16, device=DEV)
    lens = torch.tensor([100, 200, 300, 400], dtype=torch.int32, device=DEV)
    q = torch.randn(4, 32, 128, device=DEV, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    decode_attention_triton(codec, q, cache, bt, lens, out=out)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        decode_attention_triton(codec, q, cache, bt, lens, out=out)
    for new in ([2999, 1, 1500, 64], [17, 2048, 3000, 333]):
        lens.copy_(torch.tensor(new))
        q.copy_(torch.randn_like(q))
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(out, paged.decode_attention_ref(codec, q, cache, bt, lens)) < 1e-2


@pytest.mark.parametrize("name,d", [(n, 128) for n in ALL] + [("tq_k3.5v3.5", 80),
                                                              ("turboquant_3bit_nc", 256)])
def test_dequant_gpu(name, d):
    from tqattn.kernels.dequant import dequant_kv_triton
    codec = _codec(name, d)
    cache, bt, lens = filled_cache(codec, [1000, 37, 2500], 8, 16, device=DEV)
    kr, vr = paged.dequant_ref(codec, cache, bt, lens)
    k, v = dequant_kv_triton(codec, cache, bt, lens, dtype=torch.bfloat16)
    assert k.shape == kr.shape and k.dtype == torch.bfloat16
    assert rel_err(k, kr) < 1e-2 and rel_err(v, vr) < 1e-2


def test_dispatch_gpu():
    from tqattn.kernels import decode_attention, dequant_kv, store_kv
    codec = _codec("turboquant_k3v4_nc", 128)
    bt, nb = random_block_table([500], 16)
    bt = bt.to(DEV)
    cache = torch.zeros(paged.kv_cache_shape(nb, 16, 8, codec), dtype=torch.uint8, device=DEV)
    k = torch.randn(500, 8, 128, device=DEV)
    store_kv(codec, k, k, cache, slots_for(bt, 0, torch.arange(500, device=DEV), 16))
    lens = torch.tensor([500], device=DEV, dtype=torch.int32)
    ref = torch.zeros_like(cache)
    paged.store_ref(codec, k, k, ref, slots_for(bt, 0, torch.arange(500, device=DEV), 16))
    assert (cache != ref).float().mean() < 5e-3   # as test_store_gpu: codes on bucket edges
    q = torch.randn(1, 32, 128, device=DEV, dtype=torch.bfloat16)
    out = decode_attention(codec, q, cache, bt, lens)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, paged.decode_attention_ref(codec, q, cache, bt, lens)) < 1e-2
    kd, vd = dequant_kv(codec, cache, bt, lens)
    kr, vr = paged.dequant_ref(codec, cache, bt, lens)
    assert kd.shape == (500, 8, 128) and rel_err(kd, kr) < 1e-2 and rel_err(vd, vr) < 1e-2
