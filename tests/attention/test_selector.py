import pytest
import torch

from tqattn.attention import selector
from tqattn.attention.flash_attn import FlashAttentionBackend
from tqattn.attention.selector import (build_attention_layers, describe_plan,
                                       resolve_kv_cache_dtypes)
from tqattn.attention.turboquant import TurboQuantBackend

from .batch_utils import spec

P = "turboquant_k3v4_nc"
FULL = [None] * 8
GEMMA = [8, 8, 8, None, 8, 8, 8, None]  # local, local, local, global, ...


def fp_layers(dtypes):
    return [i for i, d in enumerate(dtypes) if d == "auto"]


def test_default_keeps_every_layer_on_the_preset():
    assert selector.DEFAULT_BOUNDARY_LAYERS == 0
    assert resolve_kv_cache_dtypes(8, FULL, P) == [P] * 8


def test_skip_indices_ints_and_numeric_strings():
    dtypes = resolve_kv_cache_dtypes(8, FULL, P, skip_layers=[0, "3", " 7 "])
    assert fp_layers(dtypes) == [0, 3, 7]
    assert dtypes[1] == P


def test_skip_sliding_window_layers():
    assert fp_layers(resolve_kv_cache_dtypes(8, GEMMA, P, ["sliding_window"])) == [0, 1, 2, 4, 5, 6]
    assert fp_layers(resolve_kv_cache_dtypes(8, GEMMA, P, "sliding_window")) == [0, 1, 2, 4, 5, 6]
    assert fp_layers(resolve_kv_cache_dtypes(8, FULL, P, ["sliding_window"])) == []


@pytest.mark.parametrize("n,expect", [(1, [0, 7]), (2, [0, 1, 6, 7]), (3, [0, 1, 2, 5, 6, 7])])
def test_boundary_layers(n, expect):
    assert fp_layers(resolve_kv_cache_dtypes(8, FULL, P, boundary_layers=n)) == expect


@pytest.mark.parametrize("num_layers,n", [(8, 4), (8, 100), (30, 15), (30, 999), (1, 1)])
def test_boundary_layers_that_leave_no_turboquant_layer_are_an_error(num_layers, n):
    # they once kept every layer in full precision without a word
    with pytest.raises(ValueError, match=rf"kv_cache_boundary_layers={n} keeps .* every layer.*"
                                         rf"use at most {(num_layers - 1) // 2}"):
        resolve_kv_cache_dtypes(num_layers, [None] * num_layers, P, boundary_layers=n)
    # a full-precision cache may have any boundary: there is nothing to lose
    assert resolve_kv_cache_dtypes(num_layers, [None] * num_layers, "auto", boundary_layers=n) == \
        ["auto"] * num_layers


def test_skip_rules_that_leave_no_turboquant_layer_are_an_error():
    with pytest.raises(ValueError, match=r"would apply to no layer.*8 of 8 layers \(skip_layers: 3; "
                                         r"sliding_window: 0, 1, 2, 4, 5, 6; boundary_layers: 0, 7\)"):
        resolve_kv_cache_dtypes(8, GEMMA, P, ["sliding_window", 3], boundary_layers=1)
    with pytest.raises(ValueError, match="would apply to no layer"):
        resolve_kv_cache_dtypes(2, [None] * 2, P, [0, 1])


def test_full_precision_layers_by_rule():
    rules = selector.full_precision_layers(8, GEMMA, ["sliding_window", "3"], boundary_layers=1)
    assert rules == {"skip_layers": [3], "sliding_window": [0, 1, 2, 4, 5, 6],
                     "boundary_layers": [0, 7], "auto": []}
    assert selector.describe_full_precision(rules, 8).startswith("8 of 8 layers (skip_layers: 3; ")
    none = selector.full_precision_layers(8, FULL)
    assert selector.describe_full_precision(none, 8) == "0 of 8 layers"


def test_boundary_default_is_the_module_constant(monkeypatch):
    monkeypatch.setattr(selector, "DEFAULT_BOUNDARY_LAYERS", 2)
    assert fp_layers(resolve_kv_cache_dtypes(8, FULL, P)) == [0, 1, 6, 7]
    assert fp_layers(resolve_kv_cache_dtypes(8, FULL, P, boundary_layers=0)) == []


def test_rules_combine():
    dtypes = resolve_kv_cache_dtypes(8, GEMMA, P, ["sliding_window", 1], boundary_layers=1)
    assert fp_layers(dtypes) == [0, 1, 2, 4, 5, 6, 7]
    dtypes = resolve_kv_cache_dtypes(8, GEMMA, P, ["sliding_window"], boundary_layers=1)
    assert dtypes[3] == P and fp_layers(dtypes) == [0, 1, 2, 4, 5, 6, 7]


@pytest.mark.parametrize("entry,match", [
    (8, r"entry 8 is out of range for a model with 8 layers; allowed: a layer index 0\.\.7"),
    (-1, "entry -1 is out of range"),
    ("12", "entry '12' is out of range"),
    ("sliding", r"entry 'sliding' is not understood; allowed: .*'sliding_window' or 'auto'"),
    ("1.5", "entry '1.5' is not understood"),
    (True, "entry True is not understood"),
    (None, "entry None is not understood"),
])
def test_bad_skip_entries(entry, match):
    with pytest.raises(ValueError, match=match):
        resolve_kv_cache_dtypes(8, FULL, P, [entry])


def test_auto_entry_takes_the_calibrations_layers():
    assert fp_layers(resolve_kv_cache_dtypes(8, FULL, P, ["auto", 5], auto_layers=[0])) == [0, 5]
    assert fp_layers(resolve_kv_cache_dtypes(8, FULL, P, "auto", auto_layers=[])) == []
    # the auto layers count only when asked for
    assert fp_layers(resolve_kv_cache_dtypes(8, FULL, P, [5], auto_layers=[0])) == [5]
    rules = selector.full_precision_layers(8, FULL, ["auto"], auto_layers=[2])
    assert selector.describe_full_precision(rules, 8) == "1 of 8 layers (auto: 2)"
    with pytest.raises(ValueError, match="has 'auto', which needs the layers the start-up "
                                         "calibration chose"):
        resolve_kv_cache_dtypes(8, FULL, P, ["auto"])
    # a full-precision cache has nothing to route
    assert resolve_kv_cache_dtypes(8, FULL, "auto", ["auto"]) == ["auto"] * 8
    assert selector.wants_auto_layers(["auto"]) and selector.wants_auto_layers(" auto ")
    assert not selector.wants_auto_layers([0, "sliding_window"])


# errors like the calibration's of Qwen2.5-Coder-0.5B (tq_k4v3, centered) and SmolLM2-135M
QWEN_LIKE = [8.2, 0.029, 0.017, 0.044, 0.048, 0.039, 0.049, 0.069, 0.053, 0.077, 0.047, 0.065]
SMOL_LIKE = [0.009, 0.015, 0.016, 0.015, 0.02, 0.03, 0.051, 0.02, 0.026, 0.028, 0.017, 0.021]


def test_auto_layers_pick_outliers_only():
    layers, why = selector.auto_full_precision_layers(QWEN_LIKE, range(12), 392, 0.2 * 24 * 120)
    assert layers == [0]
    assert why.startswith("automatic routing keeps 1 layer(s) full precision: layer 0 (8.2 nats)")
    layers, why = selector.auto_full_precision_layers(SMOL_LIKE, range(12), 392, 1e9)
    assert layers == [] and "the worst, layer 6, has attention KL 0.051" in why
    # a fine codec's small errors are not worth bytes, however uneven
    fine = [0.001] * 11 + [0.05]
    assert selector.auto_full_precision_layers(fine, range(12), 392, 1e9)[0] == []


def test_auto_layers_respect_the_budget_and_the_candidates():
    errs = [5.0, 0.02, 3.0, 0.02, 0.02, 0.02, 0.02, 1.0]
    assert selector.auto_full_precision_layers(errs, range(8), 100, 1000)[0] == [0, 2, 7]
    layers, why = selector.auto_full_precision_layers(errs, range(8), 100, 250)
    assert layers == [0, 2] and "over the budget stay compressed: layer 7 (1 nats)" in why
    assert selector.auto_full_precision_layers(errs, range(8), 100, 99)[0] == []
    # layers another rule already keeps are not judged (nor counted in the median)
    assert selector.auto_full_precision_layers(errs, [1, 2, 3, 4], 100, 1000)[0] == [2]
    assert selector.auto_full_precision_layers(errs, [], 100, 1000)[0] == []


def test_bad_arguments():
    with pytest.raises(ValueError, match="kv_cache_boundary_layers must be an int >= 0"):
        resolve_kv_cache_dtypes(8, FULL, P, boundary_layers=-1)
    with pytest.raises(ValueError, match="sliding_windows has 7 entries for 8 layers"):
        resolve_kv_cache_dtypes(8, FULL[:7], P)
    with pytest.raises(ValueError, match="num_layers"):
        resolve_kv_cache_dtypes(0, [], P)
    for budget in (float("inf"), float("nan"), -1.0):
        with pytest.raises(ValueError, match="budget must be a finite number of bytes >= 0"):
            selector.auto_full_precision_layers([5.0] + [0.01] * 9, range(10), 100.0, budget)


def test_layers_groups_and_plan():
    dtypes = resolve_kv_cache_dtypes(4, [None] * 4, P, boundary_layers=1)
    specs = [spec(i, hq=4, hk=2, d=64, dtype=torch.bfloat16, kv=kv) for i, kv in enumerate(dtypes)]
    layers = build_attention_layers(specs, block_size=16)
    assert [l.backend for l in layers] == [FlashAttentionBackend, TurboQuantBackend,
                                          TurboQuantBackend, FlashAttentionBackend]
    assert [l.group for l in layers] == [0, 1, 1, 0]
    plan = describe_plan(layers, 16)
    assert plan["backends"] == {"FLASH_ATTN": 2, "TURBOQUANT": 2}
    bf16 = 2 * 2 * 64 * 2                       # K and V, 2 KV heads, 64 dims, 2 bytes
    tq = 2 * TurboQuantBackend.page_bytes(16, specs[1]) // 16
    assert plan["bytes_per_token"] == 2 * bf16 + tq
    assert plan["bf16_bytes_per_token"] == 4 * bf16
    assert plan["capacity_vs_bf16"] == pytest.approx(4 * bf16 / (2 * bf16 + tq))
    assert plan["groups"][1]["layers"] == [1, 2]
    # A head size of its own makes a group of its own.
    specs.append(spec(4, hq=4, hk=2, d=32, dtype=torch.bfloat16, kv=P))
    assert build_attention_layers(specs)[-1].group == 2
