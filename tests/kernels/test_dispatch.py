"""tqattn.kernels dispatch: reference on CPU, Triton when forced, imports without triton."""

import subprocess
import sys

import pytest
import torch

from tests.kernels import conftest
from tests.kernels._util import filled_cache, random_block_table, rel_err, slots_for
from tqattn import kernels
from tqattn.quant import paged
from tqattn.quant.codec import TQCodec


def test_cpu_runs_the_reference(monkeypatch):
    monkeypatch.delenv("TQATTN_FORCE_TRITON", raising=False)
    codec = TQCodec("turboquant_k3v4_nc", 64)
    cache, bt, lens = filled_cache(codec, [20, 3], 2, 16)
    q = torch.randn(2, 4, 64)
    out = kernels.decode_attention(codec, q, cache, bt, lens)
    assert torch.equal(out, paged.decode_attention_ref(codec, q, cache, bt, lens))
    k, v = kernels.dequant_kv(codec, cache, bt, lens, dtype=torch.float32)
    assert torch.equal(k, paged.dequant_ref(codec, cache, bt, lens)[0])
    c2 = torch.zeros_like(cache)
    bt2, _ = random_block_table([4], 16)
    kv = torch.randn(4, 2, 64)
    kernels.store_kv(codec, kv, kv, c2, slots_for(bt2, 0, torch.arange(4), 16))
    assert bool(c2.any())


@pytest.mark.skipif(not (conftest.INTERPRET and conftest.KERNELS_IMPORTED),
                    reason="CPU interpreter test (the GPU tests run the kernels)")
def test_forced_triton_matches(monkeypatch):
    monkeypatch.setenv("TQATTN_FORCE_TRITON", "1")
    codec = TQCodec("turboquant_k8v4", 64)
    cache, bt, lens = filled_cache(codec, [20], 1, 16)
    q = torch.randn(1, 2, 64)
    out = kernels.decode_attention(codec, q, cache, bt, lens)
    assert rel_err(out, paged.decode_attention_ref(codec, q, cache, bt, lens)) < 2e-3
    # QJL has no kernel: the dispatch falls back to the reference
    qjl = TQCodec("tq_k4v4_qjl", 64)
    cache, bt, lens = filled_cache(qjl, [9], 1, 16)
    out = kernels.decode_attention(qjl, q, cache, bt, lens)
    assert torch.equal(out, paged.decode_attention_ref(qjl, q, cache, bt, lens))


def test_imports_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, tqattn.kernels as k\n"
            "from tqattn.quant.codec import TQCodec\n"
            "from tqattn.quant import paged\n"
            "c = TQCodec('turboquant_4bit_nc', 64)\n"
            "cache = torch.zeros(paged.kv_cache_shape(1, 16, 1, c), dtype=torch.uint8)\n"
            "x = torch.randn(2, 1, 64)\n"
            "k.store_kv(c, x, x, cache, torch.tensor([0, 1]))\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip().endswith("ok"), r.stderr
