import pytest

from tqattn.quant.layout import build_layout
from tqattn.quant.presets import PRESETS, KeySpec, TQPreset, ValueSpec, get_preset, preset_names

VLLM_128 = {"turboquant_k8v4": 196, "turboquant_4bit_nc": 134,
            "turboquant_k3v4_nc": 118, "turboquant_3bit_nc": 102}
VLLM_64 = {"turboquant_k8v4": 100, "turboquant_4bit_nc": 70,
           "turboquant_k3v4_nc": 62, "turboquant_3bit_nc": 54}
VLLM_256 = {"turboquant_k8v4": 388, "turboquant_4bit_nc": 262,
            "turboquant_k3v4_nc": 230, "turboquant_3bit_nc": 198}


@pytest.mark.parametrize("table,dim", [(VLLM_64, 64), (VLLM_128, 128), (VLLM_256, 256)])
def test_vllm_slot_bytes(table, dim):
    for name, nbytes in table.items():
        lay = build_layout(name, dim)
        assert lay.slot_bytes == nbytes, name
        assert lay.compression_vs_bf16 == pytest.approx(4 * dim / nbytes)


def test_bits_per_element_counts_metadata():
    assert build_layout("turboquant_k3v4_nc", 128).bits_per_element == pytest.approx(3.6875)


def test_vllm_field_offsets_k3v4_nc_128():
    f = build_layout("turboquant_k3v4_nc", 128).fields
    assert (f["k_idx"].offset, f["k_idx"].nbytes) == (0, 48)
    assert f["k_norm"].offset == 48
    assert (f["v_q"].offset, f["v_q"].nbytes) == (50, 64)
    assert (f["v_scale"].offset, f["v_zero"].offset) == (114, 116)


def test_project_presets_are_smaller_per_width():
    # rotated values store one fp16 norm instead of a scale and a minimum
    assert build_layout("tq_k3v4", 128).slot_bytes == 116
    assert build_layout("tq_k4v4", 128).slot_bytes == 132
    lay = build_layout("tq_k3.5v3.5", 128)   # 64 coords at 4 bits, 64 at 3 bits, + norm
    assert lay.fields["k_idx_hi"].nbytes == 32 and lay.fields["k_idx"].nbytes == 24
    assert lay.slot_bytes == 116


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("dim", [64, 80, 96, 128, 192, 256, 512])
def test_every_layout_is_consistent(name, dim):
    if PRESETS[name].key.outliers and dim > 256:
        with pytest.raises(ValueError, match="one byte"):
            build_layout(name, dim)
        return
    lay = build_layout(name, dim)
    end = 0
    for f in sorted(lay.fields.values(), key=lambda f: f.offset):
        assert f.offset == end
        end += f.nbytes
    assert lay.key_bytes + lay.value_bytes == end
    assert lay.slot_bytes in (end, end + 1) and lay.slot_bytes % 2 == 0


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError) as e:
        get_preset("turboquant_2bit")
    assert "turboquant_k3v4_nc" in str(e.value) and "tq_k4v4" in str(e.value)
    assert set(preset_names()) == set(PRESETS)


def test_bad_head_size():
    with pytest.raises(ValueError, match="head size"):
        build_layout("tq_k4v4", 63)
    # a custom preset keeping more outlier channels than a head has
    p = TQPreset("x", KeySpec("mse", 3, "nc", outliers=16), ValueSpec("tq", 3), True, "exact")
    assert p.supports_head_dim(18)
    assert p.head_dim_unsupported_reason(16) == ("preset x keeps 16 outlier channels apart, so "
                                                 "head size 16 needs to be larger")
