"""Dequantize kernel vs dequant_ref under triton's interpreter (CPU, tiny shapes)."""

import pytest
import torch

from tests.kernels import conftest
from tests.kernels._util import filled_cache, kernel_presets, rel_err
from tqattn.quant import paged
from tqattn.quant.codec import TQCodec

pytestmark = pytest.mark.skipif(not (conftest.INTERPRET and conftest.KERNELS_IMPORTED),
                                reason="CPU interpreter tests (GPU runs test_kernels_gpu.py)")


@pytest.mark.parametrize("name,d", [(p, 64) for p in kernel_presets()]
                         + [("turboquant_3bit_nc", 80), ("tq_k3.5v3.5", 80), ("tq_k3o4v3.5", 80)])
def test_dequant_matches_reference(name, d):
    from tqattn.kernels.dequant import dequant_kv_triton
    codec = TQCodec(name, d)
    cache, bt, lens = filled_cache(codec, [37, 0, 20], 2, 16)
    kr, vr = paged.dequant_ref(codec, cache, bt, lens)
    k, v = dequant_kv_triton(codec, cache, bt, lens, dtype=torch.float32)
    assert k.shape == kr.shape == (57, 2, d)
    assert rel_err(k, kr) < 1e-5 and rel_err(v, vr) < 1e-5
    kb, vb = dequant_kv_triton(codec, cache, bt, lens, dtype=torch.bfloat16, max_seq_len=37)
    assert kb.dtype == torch.bfloat16 and rel_err(kb, kr) < 1e-2 and rel_err(vb, vr) < 1e-2
