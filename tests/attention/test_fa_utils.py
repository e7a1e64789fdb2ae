import logging
import sys
import types

import pytest
import torch

from tqattn.attention import env_report, fa_utils
from tqattn.attention.fa_utils import (
    describe_choice,
    fa_window_size,
    flash_attn_varlen,
    get_flash_attn_version,
)

ENV = fa_utils.FA_VERSION_ENV


CACHED = (fa_utils.detect_fa_versions, fa_utils.fa2_provider, fa_utils._flash_attn_package_varlen,
          fa_utils._torch_varlen_attn, fa_utils.fa3_build_flags)


def clear_caches():
    for fn in CACHED:
        fn.cache_clear()


@pytest.fixture(autouse=True)
def _clean_state(monkeypatch):
    """No override from the outside, and no detection results cached across tests."""
    monkeypatch.delenv(ENV, raising=False)

    def clear():
        clear_caches()
        fa_utils._LOGGED.clear()

    clear()
    yield
    clear()


def choose(head_size, capability, available, alibi=False, **kw):
    return get_flash_attn_version(head_size, alibi, capability=capability, available=available,
                                  **kw)


# --------------------------------------------------------------------------------------------
# Version choice matrix
# --------------------------------------------------------------------------------------------

ALL = {2, 3, 4}


@pytest.mark.parametrize(
    "capability, available, head_size, alibi, expected",
    [
        # Ampere / Ada -> FA2 whatever else is installed
        ((8, 0), ALL, 128, False, 2),
        ((8, 6), ALL, 128, False, 2),
        ((8, 9), {2, 3}, 64, False, 2),
        # Hopper
        ((9, 0), {2, 3}, 128, False, 3),
        ((9, 0), ALL, 128, False, 3),
        ((9, 0), {2}, 128, False, 2),       # FA3 missing -> FA2
        ((9, 0), {2, 4}, 128, False, 2),    # SM90 prefers FA3, not FA4
        ((9, 0), ALL, 512, False, 4),       # FA3 stops at 256 -> FA4
        ((9, 0), {2, 3}, 512, False, None),  # nothing runs head 512
        ((9, 0), {2, 3}, 256, False, 3),
        # Blackwell
        ((10, 0), {2, 4}, 128, False, 4),
        ((11, 0), {2, 4}, 128, False, 4),
        ((10, 0), {2}, 128, False, 2),
        ((10, 0), {2, 4}, 512, False, 4),   # FA4 checks its own head limit at call time
        ((10, 0), {2}, 512, False, None),
        ((12, 0), ALL, 128, False, 2),      # consumer Blackwell: FA2
        # ALiBi -> FA2 only
        ((9, 0), ALL, 128, True, 2),
        ((10, 0), ALL, 128, True, 2),
        ((9, 0), {3, 4}, 128, True, None),
        ((9, 0), ALL, 512, True, None),
        # nothing usable
        ((9, 0), set(), 128, False, None),
        ((8, 0), frozenset(), 128, False, None),
        ((7, 5), ALL, 128, False, None),    # FA2 needs SM 8.0
        ((9, 0), {3}, 128, False, 3),       # FA3 alone is fine on Hopper
        ((8, 0), {3, 4}, 128, False, None),  # neither runs on Ampere
        # head sizes
        ((8, 0), {2}, 80, False, 2),
        ((8, 0), {2}, 96, False, 2),
        ((8, 0), {2}, 192, False, 2),
        ((9, 0), {2, 3}, 80, False, 3),
        ((9, 0), {2, 3}, 96, False, 3),
        ((9, 0), {2, 3}, 192, False, 3),
        # 72 is a multiple of 8: FA2/FA3 round it up to their next kernel size internally
        ((8, 0), {2}, 72, False, 2),
        ((9, 0), {2, 3}, 72, False, 3),
        ((8, 0), {2}, 100, False, None),    # not a multiple of 8
        ((9, 0), ALL, 36, False, None),
        ((10, 0), ALL, 1, False, None),
        ((8, 0), {2}, 264, False, None),    # > 256 on Ampere
    ],
)
def test_version_matrix(capability, available, head_size, alibi, expected):
    assert choose(head_size, capability, available, alibi) == expected


def test_no_gpu_gives_none():
    # This CPU machine: no capability, nothing detected.
    assert fa_utils.current_capability() is None
    assert fa_utils.detect_fa_versions() == set()
    assert get_flash_attn_version(128) is None
    # A capability alone does not conjure up installed kernels.
    assert get_flash_attn_version(128, capability=(9, 0)) is None


def test_capability_none_and_no_gpu_even_with_available(monkeypatch):
    monkeypatch.setattr(fa_utils, "current_capability", lambda: None)
    assert get_flash_attn_version(128, available=ALL) is None


@pytest.mark.parametrize("head_size", [0, -8, 64.0, None, True])
def test_bad_head_size_raises(head_size):
    with pytest.raises(ValueError, match="head_size"):
        choose(head_size, (9, 0), ALL)


def test_describe_choice_reasons():
    assert describe_choice(128, capability=(9, 0), available={2, 3}) == "FA3: SM 9.x prefers FA3"
    fallback = describe_choice(128, capability=(9, 0), available={2})
    assert fallback.startswith("FA2: fallback to FA2") and "FA3 is not installed" in fallback
    none = describe_choice(512, capability=(9, 0), available={2, 3})
    assert none.startswith("none (torch SDPA):") and "FA4 is not installed" in none
    assert "no CUDA GPU" in describe_choice(128)
    assert "ALiBi" in describe_choice(64, True, capability=(10, 0), available=ALL)


def test_fa_version_supports():
    assert fa_utils.fa_version_supports(3, 128, (9, 0))
    assert not fa_utils.fa_version_supports(3, 128, (8, 0))
    assert not fa_utils.fa_version_supports(4, 128, (9, 0), requires_alibi=True)
    assert fa_utils.fa_version_supports(4, 512, (10, 0))
    assert not fa_utils.fa_version_supports(2, 512, (10, 0))


# --------------------------------------------------------------------------------------------
# Overrides
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "capability, available, head_size, alibi, override",
    [
        ((9, 0), {2, 3}, 128, False, 2),
        ((9, 0), {2, 3}, 128, False, 3),
        ((9, 0), ALL, 128, False, 4),
        ((10, 0), ALL, 128, True, 2),
        ((8, 0), {2}, 64, False, 2),
    ],
)
def test_override_accepted(capability, available, head_size, alibi, override):
    assert choose(head_size, capability, available, alibi, override=override) == override


@pytest.mark.parametrize(
    "capability, available, head_size, alibi, override, why",
    [
        ((9, 0), {2}, 128, False, 3, r"FA3 is not installed \(installed: FA2\)"),
        ((9, 0), set(), 128, False, 2, r"FA2 is not installed \(installed: none\)"),
        ((9, 0), {2, 3}, 128, True, 3, "FA3 has no ALiBi"),
        ((10, 0), ALL, 128, True, 4, "FA4 has no ALiBi"),
        ((8, 0), ALL, 128, False, 3, r"FA3 runs only on Hopper \(SM 9.x\), the device is SM 8.0"),
        ((8, 0), ALL, 128, False, 4, "FA4 runs only on SM 9.x/10.x/11.x"),
        ((7, 5), {2}, 128, False, 2, "FA2 needs SM 8.0 or newer"),
        ((9, 0), ALL, 512, False, 3, "FA3 supports head size <= 256, got 512"),
        ((9, 0), ALL, 100, False, 3, "head size 100 is not a multiple of 8"),
    ],
)
def test_override_that_cannot_run_raises(capability, available, head_size, alibi, override, why):
    with pytest.raises(ValueError, match=why) as e:
        choose(head_size, capability, available, alibi, override=override)
    assert f"override={override}" in str(e.value)
    assert "Usable here" in str(e.value)


def test_override_error_lists_usable_versions():
    with pytest.raises(ValueError, match="Usable here for head size 128 with ALiBi: FA2;"):
        choose(128, (9, 0), ALL, True, override=3)


def test_override_without_gpu_raises():
    with pytest.raises(ValueError, match="no CUDA GPU was found"):
        get_flash_attn_version(128, override=2)


@pytest.mark.parametrize("value", [1, 5, 0, -3, "x", 3.0, True])
def test_invalid_override_value(value):
    with pytest.raises(ValueError, match="allowed values: 2, 3, 4") as e:
        choose(128, (9, 0), ALL, override=value)
    assert repr(value) in str(e.value)


def test_env_override(monkeypatch):
    monkeypatch.setenv(ENV, "2")
    assert choose(128, (9, 0), {2, 3}) == 2
    monkeypatch.setenv(ENV, " 4 ")
    assert choose(128, (10, 0), {2, 4}) == 4
    monkeypatch.setenv(ENV, "")  # empty = unset
    assert choose(128, (9, 0), {2, 3}) == 3
    # the argument wins over the environment
    monkeypatch.setenv(ENV, "2")
    assert choose(128, (9, 0), {2, 3}, override=3) == 3


@pytest.mark.parametrize("raw", ["fa3", "3.0", "7", "two"])
def test_env_override_invalid(monkeypatch, raw):
    monkeypatch.setenv(ENV, raw)
    with pytest.raises(ValueError, match=f"{ENV}='{raw}'.*allowed values: 2, 3, 4"):
        choose(128, (9, 0), ALL)


def test_env_override_that_cannot_run(monkeypatch):
    monkeypatch.setenv(ENV, "3")
    with pytest.raises(ValueError, match=f"{ENV}='3'.*FA3 is not installed"):
        choose(128, (9, 0), {2})


# --------------------------------------------------------------------------------------------
# Detection (fake packages injected into sys.modules)
# --------------------------------------------------------------------------------------------


class Recorder:
    """Stands in for an FA entry point: records its calls and returns (out, lse)."""

    def __init__(self, lse_layout="heads_first", returns_tuple=True):
        self.calls = []
        self.lse_layout = lse_layout
        self.returns_tuple = returns_tuple

    def __call__(self, q, k, v, **kwargs):
        self.calls.append(kwargs)
        out = torch.full_like(q, 7.0)
        lse = torch.arange(q.shape[0] * q.shape[1], dtype=torch.float32)
        lse = lse.reshape(q.shape[1], q.shape[0])
        if self.lse_layout == "tokens_first":
            lse = lse.t().contiguous()
        wants_lse = kwargs.get("return_lse") or kwargs.get("return_attn_probs")
        if not self.returns_tuple:
            return (out, lse) if wants_lse else out
        return out, (lse if wants_lse else None)


def install_fakes(monkeypatch, fa2=False, fa3=False, fa4=False):
    fakes = {}
    if fa2 or fa4:
        pkg = types.ModuleType("flash_attn")
        pkg.__path__ = []
        if fa2:
            pkg.flash_attn_varlen_func = fakes[2] = Recorder(returns_tuple=False)
        monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    if fa4:
        cute = types.ModuleType("flash_attn.cute")
        cute.flash_attn_varlen_func = fakes[4] = Recorder()
        monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    if fa3:
        iface = types.ModuleType("flash_attn_interface")
        iface.flash_attn_varlen_func = fakes[3] = Recorder(returns_tuple=False)
        monkeypatch.setitem(sys.modules, "flash_attn_interface", iface)
    return fakes


def test_detection_with_fake_packages(monkeypatch):
    monkeypatch.setattr(fa_utils, "current_capability", lambda: (9, 0))
    monkeypatch.setattr(fa_utils, "_torch_flash_available", lambda: False)
    install_fakes(monkeypatch, fa3=True, fa4=True)
    assert fa_utils.detect_fa_versions() == {3, 4}
    assert fa_utils.fa2_provider() is None
    assert get_flash_attn_version(128) == 3


def test_detection_fa2_providers(monkeypatch):
    monkeypatch.setattr(fa_utils, "current_capability", lambda: (8, 0))
    monkeypatch.setattr(fa_utils, "_torch_flash_available", lambda: True)
    assert fa_utils.fa2_provider() == "torch"
    assert fa_utils.detect_fa_versions() == {2}
    clear_caches()
    install_fakes(monkeypatch, fa2=True)
    assert fa_utils.fa2_provider() == "flash_attn"


def test_torch_builtin_fa2_needs_sm80(monkeypatch):
    monkeypatch.setattr(fa_utils, "current_capability", lambda: (7, 5))
    monkeypatch.setattr(fa_utils, "_torch_flash_available", lambda: True)
    assert fa_utils.detect_fa_versions() == set()


def test_detection_survives_broken_packages(monkeypatch):
    monkeypatch.setattr(fa_utils, "current_capability", lambda: (9, 0))
    monkeypatch.setattr(fa_utils, "_torch_flash_available", lambda: False)
    # A module whose import blows up with something other than ImportError.
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)  # -> ImportError
    broken = types.ModuleType("flash_attn")
    broken.__path__ = []
    broken.__getattr__ = lambda name: (_ for _ in ()).throw(RuntimeError("CUDA driver too old"))
    monkeypatch.setitem(sys.modules, "flash_attn", broken)
    assert fa_utils.detect_fa_versions() == set()


def test_import_is_light():
    """FA packages are imported lazily: the module's top level imports only torch and stdlib."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(fa_utils))
    top_level = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            top_level |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            top_level.add(node.module.split(".")[0])
    assert top_level <= {"__future__", "functools", "importlib", "inspect", "logging", "os",
                         "torch"}


# --------------------------------------------------------------------------------------------
# Wrapper dispatch
# --------------------------------------------------------------------------------------------


def varlen_batch(q_lens, k_lens, hq=4, hk=2, d=16, dtype=torch.float32):
    q = torch.randn(sum(q_lens), hq, d, dtype=dtype)
    k = torch.randn(sum(k_lens), hk, d, dtype=dtype)
    v = torch.randn(sum(k_lens), hk, d, dtype=dtype)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu_q, cu_k


def test_fa_window_size():
    assert fa_window_size(None, False) == (-1, -1)
    assert fa_window_size(None, True) == (-1, 0)
    assert fa_window_size(4, True) == (3, 0)
    assert fa_window_size(1, False) == (0, -1)


@pytest.mark.parametrize("causal, window", [(True, None), (True, 8), (False, None), (False, 3)])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_dispatch_fa3(monkeypatch, causal, window, softcap):
    fakes = install_fakes(monkeypatch, fa2=True, fa3=True, fa4=True)
    q, k, v, cu_q, cu_k = varlen_batch([3, 5], [3, 9])
    out = flash_attn_varlen(q, k, v, cu_q, cu_k, 5, 9, 0.25, causal, window=window, fa_version=3,
                            softcap=softcap)
    assert torch.all(out == 7.0)
    assert not fakes[2].calls and not fakes[4].calls
    (call,) = fakes[3].calls
    assert call["cu_seqlens_q"] is cu_q and call["cu_seqlens_k"] is cu_k
    assert (call["max_seqlen_q"], call["max_seqlen_k"]) == (5, 9)
    assert call["softmax_scale"] == 0.25 and call["causal"] is causal
    assert call["window_size"] == ((window - 1) if window else -1, 0 if causal else -1)
    assert call["softcap"] == softcap and call["return_attn_probs"] is False


def test_dispatch_fa2_package(monkeypatch):
    fakes = install_fakes(monkeypatch, fa2=True, fa3=True)
    q, k, v, cu_q, cu_k = varlen_batch([4], [4])
    flash_attn_varlen(q, k, v, cu_q, cu_k, 4, 4, None, True, window=16, fa_version=2,
                      softcap=50.0)
    assert not fakes[3].calls
    (call,) = fakes[2].calls
    assert call["window_size"] == (15, 0) and call["causal"] is True
    assert call["softcap"] == 50.0 and call["softmax_scale"] == 16 ** -0.5


@pytest.mark.parametrize("causal, window, expected", [
    (True, None, (None, 0)), (True, 4, (3, 0)), (False, None, (None, None)), (False, 1, (0, None)),
])
def test_dispatch_fa4(monkeypatch, causal, window, expected):
    fakes = install_fakes(monkeypatch, fa2=True, fa3=True, fa4=True)
    q, k, v, cu_q, cu_k = varlen_batch([2, 6], [2, 6])
    out, lse = flash_attn_varlen(q, k, v, cu_q, cu_k, 6, 6, 0.5, causal, window=window,
                                 fa_version=4, softcap=10.0, return_lse=True)
    assert not fakes[2].calls and not fakes[3].calls
    (call,) = fakes[4].calls
    assert call["window_size"] == expected
    assert call["return_lse"] is True and call["softcap"] == 10.0 and call["causal"] is causal
    assert lse.shape == (4, 8) and lse.dtype == torch.float32


@pytest.mark.parametrize("layout", ["heads_first", "tokens_first"])
def test_fa_lse_layout_normalized(monkeypatch, layout):
    fakes = install_fakes(monkeypatch, fa3=True)
    fakes[3].lse_layout = layout
    q, k, v, cu_q, cu_k = varlen_batch([3, 2], [3, 2], hq=4, hk=4)
    out, lse = flash_attn_varlen(q, k, v, cu_q, cu_k, 3, 3, None, True, fa_version=3,
                                 return_lse=True)
    assert fakes[3].calls[0]["return_attn_probs"] is True
    expected = torch.arange(20, dtype=torch.float32).reshape(4, 5)
    torch.testing.assert_close(lse, expected)


def test_none_path_calls_no_fa(monkeypatch):
    fakes = install_fakes(monkeypatch, fa2=True, fa3=True, fa4=True)
    q, k, v, cu_q, cu_k = varlen_batch([3], [3])
    out = flash_attn_varlen(q, k, v, cu_q, cu_k, 3, 3, None, True)
    assert not any(f.calls for f in fakes.values())
    assert not torch.all(out == 7.0)


def test_missing_fa_package_raises_clearly(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    q, k, v, cu_q, cu_k = varlen_batch([3], [3])
    with pytest.raises(RuntimeError, match="fa_version=3 needs flash_attn_interface"):
        flash_attn_varlen(q, k, v, cu_q, cu_k, 3, 3, None, True, fa_version=3)


def fake_torch_varlen(recorded, with_gqa=True):
    """A stand-in for torch.nn.attention.varlen.varlen_attn computing with our reference."""

    def run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
            scale=None, window_size=(-1, -1), enable_gqa=False):
        recorded.append({"window_size": window_size, "enable_gqa": enable_gqa,
                         "heads": (query.shape[1], key.shape[1]), "return_aux": return_aux})
        left, right = window_size
        assert right in (0, -1)
        out, lse = fa_utils._sdpa_varlen(query, key, value, cu_seq_q, cu_seq_k, scale,
                                         right == 0, None if left < 0 else left + 1, 0.0, True)
        # torch documents the varlen LSE as (total_q, Hq)
        return (out, lse.t()) if return_aux is not None and return_aux.lse else out

    if not with_gqa:
        def run_no_gqa(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                       scale=None, window_size=(-1, -1)):
            return run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                       return_aux=return_aux, scale=scale, window_size=window_size)
        return run_no_gqa
    return run


@pytest.mark.parametrize("with_gqa", [True, False])
def test_dispatch_torch_varlen(monkeypatch, with_gqa):
    from torch.nn.attention import varlen

    recorded = []
    monkeypatch.setattr(varlen, "varlen_attn", fake_torch_varlen(recorded, with_gqa))
    q, k, v, cu_q, cu_k = varlen_batch([3, 4], [7, 4])
    out, lse = flash_attn_varlen(q, k, v, cu_q, cu_k, 4, 7, 0.3, True, window=5, fa_version=2,
                                 return_lse=True)
    (call,) = recorded
    assert call["window_size"] == (4, 0)
    assert call["enable_gqa"] is with_gqa
    assert call["heads"] == ((4, 2) if with_gqa else (4, 4))
    ref_out, ref_lse = reference(q, k, v, cu_q, cu_k, 0.3, True, 5, 0.0)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_torch_fa2_softcap_falls_back_with_one_warning(monkeypatch, caplog):
    from torch.nn.attention import varlen

    recorded = []
    monkeypatch.setattr(varlen, "varlen_attn", fake_torch_varlen(recorded))
    q, k, v, cu_q, cu_k = varlen_batch([3], [3])
    with caplog.at_level(logging.WARNING, logger=fa_utils.__name__):
        for _ in range(3):
            out = flash_attn_varlen(q, k, v, cu_q, cu_k, 3, 3, None, True, fa_version=2,
                                    softcap=5.0)
    assert not recorded
    assert sum("no softcap" in r.getMessage() for r in caplog.records) == 1
    ref_out, _ = reference(q, k, v, cu_q, cu_k, 16 ** -0.5, True, None, 5.0)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)


def test_torch_fa2_sdpa_flash_fallback(monkeypatch):
    """torch without varlen_attn: per-sequence SDPA on the FLASH_ATTENTION backend (CPU has one)."""
    monkeypatch.setattr(fa_utils, "_torch_varlen_attn", lambda: None)
    q, k, v, cu_q, cu_k = varlen_batch([3, 5, 1], [8, 5, 6])
    for causal in (True, False):
        out = flash_attn_varlen(q, k, v, cu_q, cu_k, 5, 8, None, causal, fa_version=2)
        ref_out, _ = reference(q, k, v, cu_q, cu_k, 16 ** -0.5, causal, None, 0.0)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------
# The SDPA path (fa_version=None) against a dense reference
# --------------------------------------------------------------------------------------------


def reference(q, k, v, cu_q, cu_k, scale, causal, window, softcap):
    """Dense fp64 attention, one (sequence, head, query) at a time from first principles."""
    hq, hk = q.shape[1], k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((hq, q.shape[0]), float("-inf"), dtype=torch.float64)
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(bounds_q) - 1):
        q0, q1, k0, k1 = bounds_q[b], bounds_q[b + 1], bounds_k[b], bounds_k[b + 1]
        q_len, k_len = q1 - q0, k1 - k0
        for h in range(hq):
            kh = h // (hq // hk)
            for i in range(q_len):
                pos = k_len - q_len + i
                keys = [j for j in range(k_len)
                        if (not causal or j <= pos) and (window is None or j > pos - window)]
                if not keys:
                    continue
                qi = q[q0 + i, h].double()
                s = torch.stack([(qi @ k[k0 + j, kh].double()) * scale for j in keys])
                if softcap:
                    s = softcap * torch.tanh(s / softcap)
                lse[h, q0 + i] = torch.logsumexp(s, 0)
                p = torch.softmax(s, 0)
                out[q0 + i, h] = sum(p[n] * v[k0 + j, kh].double() for n, j in enumerate(keys))
    return out.to(q.dtype), lse.float()


CASES = [
    # q_lens, k_lens, causal, window, softcap
    ([5, 3, 7], [5, 3, 7], True, None, 0.0),       # plain causal prefill
    ([2, 4, 1], [9, 4, 6], True, None, 0.0),       # continuation chunks (q_len < k_len)
    ([5, 3], [5, 11], False, None, 0.0),
    ([6, 3], [6, 10], True, 3, 0.0),               # sliding window
    ([4, 5], [4, 12], False, 2, 0.0),
    ([5, 2], [5, 8], True, None, 4.0),             # softcap
    ([6, 4], [9, 4], True, 4, 2.5),                # everything at once
    ([0, 3, 0], [2, 3, 0], True, None, 0.0),       # empty sequences
]


@pytest.mark.parametrize("q_lens, k_lens, causal, window, softcap", CASES)
@pytest.mark.parametrize("return_lse", [False, True])
def test_sdpa_path_matches_reference(q_lens, k_lens, causal, window, softcap, return_lse):
    q, k, v, cu_q, cu_k = varlen_batch(q_lens, k_lens, hq=6, hk=2, d=16)
    scale = 0.2
    result = flash_attn_varlen(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), scale, causal,
                               window=window, softcap=softcap, return_lse=return_lse)
    ref_out, ref_lse = reference(q, k, v, cu_q, cu_k, scale, causal, window, softcap)
    out = result[0] if return_lse else result
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    if return_lse:
        lse = result[1]
        assert lse.shape == (6, q.shape[0]) and lse.dtype == torch.float32
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("return_lse", [False, True])
def test_sdpa_path_no_visible_key_gives_zero(return_lse):
    # Causal with more queries than keys: the first queries sit before every key.
    q, k, v, cu_q, cu_k = varlen_batch([5], [2], hq=2, hk=2)
    out = flash_attn_varlen(q, k, v, cu_q, cu_k, 5, 2, None, True, return_lse=return_lse)
    out, lse = out if return_lse else (out, None)
    assert torch.all(out[:3] == 0)
    ref_out, ref_lse = reference(q, k, v, cu_q, cu_k, 16 ** -0.5, True, None, 0.0)
    torch.testing.assert_close(out, ref_out)
    if return_lse:
        assert torch.all(lse[:, :3] == float("-inf"))
        torch.testing.assert_close(lse, ref_lse)


def test_sdpa_path_keeps_dtype():
    q, k, v, cu_q, cu_k = varlen_batch([4, 3], [6, 3], dtype=torch.bfloat16)
    out, lse = flash_attn_varlen(q, k, v, cu_q, cu_k, 4, 6, None, True, return_lse=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref_out, _ = reference(q.float(), k.float(), v.float(), cu_q, cu_k, 0.25, True, None, 0.0)
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)


# --------------------------------------------------------------------------------------------
# Input validation
# --------------------------------------------------------------------------------------------


def test_input_validation():
    q, k, v, cu_q, cu_k = varlen_batch([3, 2], [3, 2], hq=4, hk=2)
    call = lambda **kw: flash_attn_varlen(  # noqa: E731
        kw.get("q", q), kw.get("k", k), kw.get("v", v), kw.get("cu_q", cu_q),
        kw.get("cu_k", cu_k), 3, 3, None, True, window=kw.get("window"),
        fa_version=kw.get("fa_version"), softcap=kw.get("softcap", 0.0))
    with pytest.raises(ValueError, match="dtypes differ"):
        call(k=k.half())
    with pytest.raises(ValueError, match=r"query heads \(4\) must be a multiple of .* \(3\)"):
        call(k=torch.randn(5, 3, 16), v=torch.randn(5, 3, 16))
    with pytest.raises(ValueError, match="3-D"):
        call(q=q.unsqueeze(0))
    with pytest.raises(ValueError, match="same shape"):
        call(v=torch.randn(5, 2, 8))
    with pytest.raises(ValueError, match="cu_seqlens_q must be a 1-D int32"):
        call(cu_q=cu_q.long())
    with pytest.raises(ValueError, match="cu_seqlens_k must be a 1-D int32"):
        call(cu_k=cu_k.view(1, -1))
    with pytest.raises(ValueError, match="same length"):
        call(cu_k=cu_k[:2])
    with pytest.raises(ValueError, match="rise from 0 to the token count 5"):
        call(cu_q=torch.tensor([0, 3, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="window must be a positive int"):
        call(window=0)
    with pytest.raises(ValueError, match="softcap must be >= 0"):
        call(softcap=-1.0)
    with pytest.raises(ValueError, match="fa_version must be None, 2, 3 or 4"):
        call(fa_version=1)


# --------------------------------------------------------------------------------------------
# Logging and the env report
# --------------------------------------------------------------------------------------------


def test_log_fa_choice_once_per_version(caplog):
    with caplog.at_level(logging.INFO, logger=fa_utils.__name__):
        fa_utils.log_fa_choice("model.layers.0.self_attn", 3)
        fa_utils.log_fa_choice("model.layers.1.self_attn", 3)
        fa_utils.log_fa_choice("model.layers.2.self_attn", None)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "FA3" in messages[0] and "model.layers.0.self_attn" in messages[0]
    assert "none (torch SDPA)" in messages[1]


def test_collect_env_on_cpu():
    d = env_report.collect_env()
    assert d["torch"] == torch.__version__
    assert d["cuda_available"] is False and d["device_capability"] is None
    assert d["fa_versions"] == [] and d["fa2_provider"] is None
    assert len(d["fa_choice"]) == 8
    assert all(row["version"] is None for row in d["fa_choice"])
    text = env_report.format_env(d)
    assert "none (torch SDPA)" in text and "FlashAttention found: none" in text


def test_collect_env_with_fake_hopper(monkeypatch):
    monkeypatch.setattr(fa_utils, "current_capability", lambda: (9, 0))
    monkeypatch.setattr(fa_utils, "_torch_flash_available", lambda: True)
    install_fakes(monkeypatch, fa3=True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake H200")
    d = env_report.collect_env()
    assert d["fa_versions"] == [2, 3] and d["fa2_provider"] == "torch built-in"
    assert d["device_name"] == "Fake H200" and d["device_capability"] == "9.0"
    by_key = {(r["head_size"], r["alibi"]): r["version"] for r in d["fa_choice"]}
    assert by_key == {(64, False): 3, (64, True): 2, (128, False): 3, (128, True): 2,
                      (256, False): 3, (256, True): 2, (512, False): None, (512, True): None}
    assert "FA2 provided by:      torch built-in" in env_report.format_env(d)


def test_collect_env_reports_bad_env_override(monkeypatch):
    monkeypatch.setenv(ENV, "9")
    d = env_report.collect_env()
    assert d["fa_version_env"] == "9"
    assert all(r["choice"].startswith("error: invalid FlashAttention version '9'")
               for r in d["fa_choice"])


# --------------------------------------------------------------------------------------------
# GPU: the real kernels against the reference (run with -m gpu)
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("causal, window, softcap", [(True, None, 0.0), (True, 64, 0.0),
                                                      (False, None, 0.0), (True, None, 20.0)])
def test_gpu_detected_version_matches_reference(causal, window, softcap):
    version = get_flash_attn_version(128, requires_softcap=bool(softcap))
    q, k, v, cu_q, cu_k = varlen_batch([100, 37, 256], [300, 37, 256], hq=8, hk=2, d=128,
                                       dtype=torch.bfloat16)
    q, k, v, cu_q, cu_k = (t.cuda() for t in (q, k, v, cu_q, cu_k))
    out, lse = flash_attn_varlen(q, k, v, cu_q, cu_k, 256, 300, None, causal, window=window,
                                 fa_version=version, softcap=softcap, return_lse=True)
    ref_out, ref_lse = flash_attn_varlen(q.float(), k.float(), v.float(), cu_q, cu_k, 256, 300,
                                         None, causal, window=window, softcap=softcap,
                                         return_lse=True)
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-2, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_sdpa_flash_fallback(monkeypatch, causal):
    monkeypatch.setattr(fa_utils, "_torch_varlen_attn", lambda: None)
    monkeypatch.setattr(fa_utils, "_flash_attn_package_varlen", lambda: None)
    q, k, v, cu_q, cu_k = varlen_batch([100, 37, 256], [300, 37, 256], hq=8, hk=2, d=128,
                                       dtype=torch.bfloat16)
    q, k, v, cu_q, cu_k = (t.cuda() for t in (q, k, v, cu_q, cu_k))
    out = flash_attn_varlen(q, k, v, cu_q, cu_k, 256, 300, None, causal, fa_version=2)
    ref_out = flash_attn_varlen(q.float(), k.float(), v.float(), cu_q, cu_k, 256, 300, None,
                                causal)
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)


# --------------------------------------------------------------------------------------------
# The installed FA3's build flags (tokenspeed-fa3 ships without soft-cap and head-size-96 kernels)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def fa3_built_without(monkeypatch):
    def install(**flags):
        module = types.ModuleType("flash_attn_config")
        module.CONFIG = {"build_flags": {f"FLASHATTENTION_DISABLE_{k}": v for k, v in flags.items()}}
        monkeypatch.setitem(sys.modules, "flash_attn_config", module)
        fa_utils.fa3_build_flags.cache_clear()
    return install


def test_fa3_without_softcap_falls_back_to_fa2_for_softcap_layers(fa3_built_without):
    fa3_built_without(SOFTCAP=True, HDIM96=True)
    hopper = dict(capability=(9, 0), available={2, 3})
    assert get_flash_attn_version(128, **hopper) == 3
    assert get_flash_attn_version(128, requires_softcap=True, **hopper) == 2
    assert "soft-cap" in fa_utils.describe_choice(128, requires_softcap=True, **hopper)
    assert get_flash_attn_version(128, requires_softcap=True, capability=(9, 0),
                                  available={3}) is None
    with pytest.raises(ValueError, match="FLASHATTENTION_DISABLE_SOFTCAP"):
        get_flash_attn_version(128, requires_softcap=True, override=3, **hopper)


def test_fa3_head_size_runs_on_next_compiled_kernel(fa3_built_without):
    fa3_built_without(HDIM96=True)  # 80 and 96 run on the 128 kernels
    assert fa_utils.fa_version_supports(3, 96, (9, 0))
    fa3_built_without(HDIM96=True, HDIM128=True, HDIM192=True, HDIM256=True)
    assert fa_utils.fa_version_supports(3, 64, (9, 0))
    reason = fa_utils.fa_unsupported_reason(3, 96, (9, 0))
    assert reason is not None and "head size 96" in reason
    assert get_flash_attn_version(96, capability=(9, 0), available={2, 3}) == 2


def test_collect_env_shows_fa3_build_flags(monkeypatch, fa3_built_without):
    monkeypatch.setattr(fa_utils, "current_capability", lambda: (9, 0))
    monkeypatch.setattr(fa_utils, "_torch_flash_available", lambda: True)
    install_fakes(monkeypatch, fa3=True)
    fa3_built_without(SOFTCAP=True, HDIM96=True, FP8=False)
    d = env_report.collect_env()
    assert d["fa3_disabled"] == ["FLASHATTENTION_DISABLE_HDIM96", "FLASHATTENTION_DISABLE_SOFTCAP"]
    assert d["softcap_choice"].startswith("FA2: fallback to FA2")
    text = env_report.format_env(d)
    assert "FA3 built without:    FLASHATTENTION_DISABLE_HDIM96, FLASHATTENTION_DISABLE_SOFTCAP" in text
    assert "soft-cap: FA2" in text


def test_fa3_without_config_module_is_assumed_complete(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn_config", None)  # import raises ImportError
    fa_utils.fa3_build_flags.cache_clear()
    assert fa_utils.fa3_build_flags() == {}
    assert get_flash_attn_version(128, requires_softcap=True, capability=(9, 0),
                                  available={2, 3}) == 3
