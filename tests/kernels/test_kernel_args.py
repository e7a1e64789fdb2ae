"""Bad arguments of the kernel entry points get the reference's clear errors (checked on the
host from dtypes and shapes) instead of an out-of-bounds read or a silently wrong answer."""

import pytest
import torch

from tests.kernels import conftest
from tests.kernels._util import filled_cache
from tqattn.quant import paged
from tqattn.quant.codec import TQCodec

pytestmark = pytest.mark.skipif(not (conftest.INTERPRET and conftest.KERNELS_IMPORTED),
                                reason="CPU interpreter tests")


@pytest.fixture
def setup():
    codec = TQCodec("tq_k4v3", 64)
    cache, bt, lens = filled_cache(codec, [20, 5], 1, 16)
    return codec, cache, bt, lens


def test_decode_rows_batch_and_offsets(setup):
    from tqattn.kernels.decode import decode_attention_triton as decode

    codec, cache, bt, lens = setup
    with pytest.raises(ValueError, match="q has 3 rows but there are 2 sequences"):
        decode(codec, torch.randn(3, 2, 64), cache, bt, lens)
    with pytest.raises(ValueError, match="q has 3 rows but there are 2 sequences"):
        paged.decode_attention_ref(codec, torch.randn(3, 2, 64), cache, bt, lens)
    with pytest.raises(ValueError, match="query_start_loc has 2 entries, expected 3"):
        decode(codec, torch.randn(3, 2, 64), cache, bt, lens,
               query_start_loc=torch.tensor([0, 3], dtype=torch.int32), max_query_len=3)
    with pytest.raises(TypeError, match="seq_lens must be int32 or int64, got torch.float32"):
        decode(codec, torch.randn(2, 2, 64), cache, bt, lens.float())
    with pytest.raises(ValueError, match="block_table has 1 entries, fewer than the 2 needed"):
        decode(codec, torch.randn(2, 2, 64), cache, bt[:1], lens)
    with pytest.raises(ValueError, match="kv_cache must be uint8 .num_blocks"):
        decode(codec, torch.randn(2, 2, 64), cache[None], bt, lens)
    for f in (decode, paged.decode_attention_ref):
        with pytest.raises(ValueError, match="window must be None or an int >= 0"):
            f(codec, torch.randn(2, 2, 64), cache, bt, lens, window=-3)


def test_decode_of_no_sequence_matches_the_reference(setup):
    from tqattn.kernels.decode import decode_attention_triton as decode

    codec, cache, bt, lens = setup
    empty = torch.zeros(0, dtype=torch.int32)
    for qsl, rows in ((None, 0), (torch.zeros(1, dtype=torch.int32), 0)):
        out, lse = decode(codec, torch.randn(rows, 2, 64), cache, bt[:0], empty,
                          query_start_loc=qsl, max_query_len=1, return_lse=True)
        ref, lse_ref = paged.decode_attention_ref(codec, torch.randn(rows, 2, 64), cache, bt[:0],
                                                  empty, query_start_loc=qsl, return_lse=True)
        assert out.shape == ref.shape == (0, 2, 64) and lse.shape == lse_ref.shape


def test_store_and_dequant_arguments(setup):
    from tqattn.kernels.dequant import dequant_kv_triton
    from tqattn.kernels.store import store_kv_triton

    codec, cache, bt, lens = setup
    k = torch.randn(3, 1, 64)
    with pytest.raises(TypeError, match="key must be float16/bfloat16/float32, got torch.int32"):
        store_kv_triton(codec, k.int(), k, cache, torch.arange(3))
    with pytest.raises(TypeError, match="value must be float16/bfloat16/float32, got torch.float64"):
        store_kv_triton(codec, k, k.double(), cache, torch.arange(3))
    with pytest.raises(ValueError, match="slot_mapping has 2 entries, fewer than the 3 needed"):
        store_kv_triton(codec, k, k, cache, torch.arange(2))
    with pytest.raises(TypeError, match="dtype must be float16/bfloat16/float32, got torch.int32"):
        dequant_kv_triton(codec, cache, bt, lens, dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens has 2 entries, expected 3"):
        dequant_kv_triton(codec, cache, bt, lens, cu_seqlens=torch.tensor([0, 20]), max_seq_len=20)
