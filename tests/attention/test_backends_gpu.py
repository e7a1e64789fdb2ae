"""Both backends on the GPU at bf16: the CUDA paths (FlashAttention as chosen for the device,
the Triton kernels) against the same plain-PyTorch references as the CPU tests."""

import pytest
import torch

from tqattn.attention import fa_utils

from . import test_flash_attn as fa_tests
from . import test_turboquant as tq_tests
from .batch_utils import spec

pytestmark = pytest.mark.gpu

BIG_MIXED = [(300, 1), (1000, 1), (64, 1), (500, 40), (0, 700), (700, 300), (0, 3), (37, 129)]


@pytest.mark.parametrize("reqs", [fa_tests.PREFILLS, fa_tests.MIXED, BIG_MIXED])
@pytest.mark.parametrize("window,softcap", [(None, 0.0), (64, 0.0), (None, 20.0)])
def test_flash_attn_backend_cuda(reqs, window, softcap):
    s = spec(hq=8, hk=2, d=128, dtype=torch.bfloat16, window=window, softcap=softcap)
    out, ref, _, _, impl = fa_tests.run_step(s, reqs, fa_version="auto", device="cuda")
    assert impl.fa_version == fa_utils.get_flash_attn_version(128, requires_softcap=bool(softcap))
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k8v4", "tq_k3v4"])
@pytest.mark.parametrize("reqs", [tq_tests.MIXED, tq_tests.UNORDERED, BIG_MIXED])
@pytest.mark.parametrize("window,softcap", [(None, 0.0), (64, 20.0)])
def test_turboquant_backend_cuda(preset, reqs, window, softcap):
    s = spec(hq=8, hk=2, d=128, dtype=torch.bfloat16, kv=preset, window=window, softcap=softcap)
    out, ref, *_ = tq_tests.run_step(s, reqs, fa_version="auto", device="cuda")
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("preset", ["turboquant_k3v4_nc", "tq_k4v3"])
@pytest.mark.parametrize("d", [80, 96])
@pytest.mark.parametrize("fused", [False, True], ids=["store_then_forward", "fused"])
def test_turboquant_padded_cache_cuda(preset, d, fused):
    """Head sizes 80 / 96 on a cache padded to 128 (kv_cache_pad_head_size): the tensor-core
    decode kernel and the head-128 store and dequant kernels, against the reference."""
    s = spec(hq=8, hk=2, d=d, dtype=torch.bfloat16, kv=preset, kv_cache_head_size=128)
    for reqs in (tq_tests.DECODES, BIG_MIXED):
        out, ref, *_ = tq_tests.run_step(s, reqs, fa_version="auto", device="cuda", fused=fused)
        assert out.shape[-1] == d
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kv", ["auto", "turboquant_4bit_nc"])
def test_forward_has_no_host_sync(kv):
    """A mixed batch (decodes, short and long continuations, a fresh prompt) captured in a CUDA
    graph — impossible if forward synchronised with the host — replays the eager result."""
    from tqattn.attention.selector import build_attention_layers, build_metadata_builders

    from .batch_utils import make_batch, num_blocks

    s = spec(hq=8, hk=2, d=128, dtype=torch.bfloat16, kv=kv, window=64)
    layer = build_attention_layers([s])[0]
    builder = build_metadata_builders([layer], "cuda")[0]
    batch = make_batch(BIG_MIXED, device="cuda")
    nblk = num_blocks(batch)
    cache = torch.zeros(layer.backend.kv_cache_shape(nblk, 16, s),
                        dtype=layer.backend.kv_cache_torch_dtype(s), device="cuda")
    fill = torch.randn(2, nblk * 16, 2, 128, device="cuda", dtype=torch.bfloat16)
    layer.impl.store(fill[0], fill[1], cache, type("M", (), {
        "num_actual_tokens": nblk * 16, "slot_mapping": torch.arange(nblk * 16, device="cuda")}))
    n = batch.common.num_actual_tokens
    q = torch.randn(n, 8, 128, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn(2, n, 2, 128, device="cuda", dtype=torch.bfloat16)
    md = builder.build(batch.common)
    eager = layer.impl.forward(q, k, v, cache, md)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer.impl.forward(q, k, v, cache, md)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer.impl.forward(q, k, v, cache, md)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager)


@pytest.mark.parametrize("window,softcap", [(None, 0.0), (64, 20.0)])
def test_flash_attn_pure_decode_graph_replay(window, softcap):
    """FLASH_ATTN pure decode as the model runner graphs it: metadata built once over static
    buffers, store + forward captured once, each step rewriting the buffers and replaying —
    equal to an eager build of that step (FA3's paged call where the device has it)."""
    from tqattn.attention.flash_attn import (FlashAttentionBackend, FlashAttentionImpl,
                                             FlashAttentionMetadataBuilder)

    from .batch_utils import make_batch

    s = spec(hq=8, hk=2, d=128, dtype=torch.bfloat16, window=window, softcap=softcap)
    impl = FlashAttentionImpl(s)
    builder = FlashAttentionMetadataBuilder({s.name: impl}, "cuda")
    nblk, width, bucket, dev = 400, 80, 8, "cuda"
    cache = torch.randn(FlashAttentionBackend.kv_cache_shape(nblk, 16, s), device=dev).to(s.dtype)
    seq_lens = torch.zeros(bucket, dtype=torch.int32, device=dev)
    table = torch.zeros(bucket, width, dtype=torch.int32, device=dev)
    slots = torch.full((bucket,), -1, dtype=torch.int64, device=dev)
    q = torch.zeros(bucket, 8, 128, dtype=s.dtype, device=dev)
    k, v = torch.zeros(2, bucket, 2, 128, dtype=s.dtype, device=dev)
    md = builder.build(fa_tests._bucket_common(seq_lens, table, slots))

    def step():
        impl.store(k, v, cache, md)
        return impl.forward(q, k, v, cache, md)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    gen = torch.Generator().manual_seed(0)
    for reqs in ([(300, 1), (1000, 1), (64, 1)], [(301, 1)],
                 [(0, 1), (1200, 1), (17, 1), (500, 1), (5, 1), (800, 1), (33, 1), (1000, 1)]):
        need = sum(-(-(c + 1) // 16) for c, _ in reqs)
        batch = make_batch(reqs, gen=gen, extra_blocks=nblk - need, device=dev)
        n, w = len(reqs), batch.block_table.shape[1]
        seq_lens.zero_(), table.zero_(), slots.fill_(-1)
        seq_lens[:n] = batch.common.seq_lens
        table[:n, :w] = batch.common.block_table
        slots[:n] = batch.common.slot_mapping
        for x in (q, k, v):
            x.copy_(torch.randn(x.shape, generator=gen).to(x))
        eager_cache = cache.clone()
        graph.replay()
        fresh = builder.build(batch.common)
        impl.store(k[:n], v[:n], eager_cache, fresh)
        eager = impl.forward(q[:n], k[:n], v[:n], eager_cache, fresh)
        torch.cuda.synchronize()
        assert torch.equal(cache, eager_cache)
        torch.testing.assert_close(out[:n].float(), eager.float(), atol=2e-2, rtol=2e-2)
        assert torch.isfinite(out).all() and out[n:].abs().sum() == 0


@pytest.mark.parametrize("kv,d", [("auto", 128), ("turboquant_k3v4_nc", 128), ("tq_k4v3", 128),
                                  ("tq_k4v3", 256), ("turboquant_k3v4_nc", 64)])
@pytest.mark.parametrize("reqs", [tq_tests.DECODES, BIG_MIXED], ids=["decode", "mixed"])
def test_head_major_inputs_cuda(kv, d, reqs):
    """q/k/v laid out head by head (what the compiled model hands the op): the decode kernels,
    the fused store and the full-precision cache write take the strides; the same output as
    token rows, against the reference."""
    s = spec(hq=8, hk=2, d=d, dtype=torch.bfloat16, kv=kv)
    tests = fa_tests if kv == "auto" else tq_tests
    extra = {} if kv == "auto" else {"fused": True}
    rows, ref, *_ = tests.run_step(s, reqs, fa_version="auto", device="cuda", **extra)
    heads, *_ = tests.run_step(s, reqs, fa_version="auto", device="cuda", heads_first=True,
                               **extra)
    assert heads.is_contiguous()
    torch.testing.assert_close(heads, rows, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(heads.float(), ref, atol=2e-2, rtol=2e-2)
