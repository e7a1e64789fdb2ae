"""bench/lab/load_patterns.py: how a page splits into the TMA copies' power-of-two pieces."""

import pytest

from bench.lab import load_patterns as lp
from tqattn.quant.codec import TQCodec
from tqattn.quant.paged import kv_cache_shape


def test_pieces_cover_tq_k4v3_page():
    page = kv_cache_shape(1, 16, 1, TQCodec("tq_k4v3", 256))[-1]
    ps = lp.pieces(page)
    # contiguous, largest first, powers of two, 16-byte rows covering the page exactly
    assert [r for r, _ in ps] == [sum(n for _, n in ps[:i]) for i in range(len(ps))]
    assert all(n & (n - 1) == 0 for _, n in ps) and [n for _, n in ps] == sorted(
        (n for _, n in ps), reverse=True)
    assert 16 * sum(n for _, n in ps) == page
    assert all(r * 16 % 128 == 0 for r, _ in ps) and len(ps) <= 5


def test_pieces_refuse_unaligned_pages():
    with pytest.raises(ValueError, match="unaligned"):
        lp.pieces(3680)  # turboquant_k3v4_nc's head-256 page: its 32-byte piece lands at 3,648
    with pytest.raises(ValueError, match="16-byte rows"):
        lp.pieces(3650)
