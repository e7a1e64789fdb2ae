"""FlashAttention detection, version choice and the varlen prefill wrapper.

Three FlashAttention implementations can serve prefill:

- FA2: the ``flash_attn`` package, or torch's built-in flash kernel (``torch.nn.attention.varlen``
  or SDPA's FLASH_ATTENTION backend). Ampere and newer (SM >= 8.0).
- FA3: ``flash_attn_interface`` (e.g. the ``tokenspeed-fa3`` wheel). Hopper only (SM 9.x).
- FA4: ``flash_attn.cute`` (the ``flash-attn-4`` wheel). Hopper and Blackwell (SM 9.x, 10.x, 11.x).

Each attention layer picks its version once, at construction, with :func:`get_flash_attn_version`
and passes it to every :func:`flash_attn_varlen` call; the wrapper dispatches on that version and
never substitutes "whatever is installed". ``None`` means no usable FlashAttention: the wrapper
then runs torch SDPA per sequence (CPU, pre-Ampere GPUs, machines without FA).

Nothing here imports an FA package at module import time; detection is lazy and cached.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import os

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

FA_VERSIONS = (2, 3, 4)
FA_VERSION_ENV = "TQATTN_FLASH_ATTN_VERSION"
# FA2 and FA3 kernels exist up to head size 256. FA4 checks its own limit when called, so the
# version choice does not cap it (a head size it cannot run fails there with FA4's message).
FA2_FA3_MAX_HEAD_SIZE = 256

_LOGGED: set[object] = set()


def _log_once(level: int, key: object, msg: str, *args: object) -> None:
    if key in _LOGGED:
        return
    _LOGGED.add(key)
    logger.log(level, msg, *args)


# --------------------------------------------------------------------------------------------
# Detection
# --------------------------------------------------------------------------------------------


def current_capability() -> tuple[int, int] | None:
    """Compute capability of the current CUDA device, or None without a usable CUDA GPU.

    ROCm counts as no GPU here: the FA packages this module dispatches to are CUDA builds.
    """
    try:
        if torch.version.hip is not None or not torch.cuda.is_available():
            return None
        major, minor = torch.cuda.get_device_capability()
        return int(major), int(minor)
    except Exception:  # a broken driver must not crash detection
        return None


def _import_attr(module: str, attr: str):
    """``module.attr`` if it imports and is callable, else None. Never raises."""
    try:
        fn = getattr(importlib.import_module(module), attr, None)
    except Exception:  # ImportError, and CUDA/ABI errors raised while loading an extension
        return None
    return fn if callable(fn) else None


@functools.lru_cache(maxsize=None)
def _flash_attn_package_varlen():
    """The ``flash_attn`` package's ``flash_attn_varlen_func`` (FA2), or None."""
    return _import_attr("flash_attn", "flash_attn_varlen_func")


def _torch_flash_available() -> bool:
    is_available = getattr(torch.backends.cuda, "is_flash_attention_available", None)
    try:
        return bool(is_available()) if is_available is not None else torch.cuda.is_available()
    except Exception:
        return False


@functools.lru_cache(maxsize=None)
def fa2_provider() -> str | None:
    """Who provides FA2 here: ``"flash_attn"`` (the package), ``"torch"`` (built-in) or None."""
    capability = current_capability()
    if capability is None:
        return None
    if _flash_attn_package_varlen() is not None:
        return "flash_attn"
    if capability >= (8, 0) and _torch_flash_available():
        return "torch"
    return None


@functools.lru_cache(maxsize=None)
def detect_fa_versions() -> frozenset[int]:
    """FlashAttention versions installed and loadable here; empty without a CUDA GPU.

    Whether a version can run a given layer on this device (capability, head size, ALiBi) is
    decided by :func:`get_flash_attn_version`, not here.
    """
    if current_capability() is None:
        return frozenset()
    found = set()
    if fa2_provider() is not None:
        found.add(2)
    if _import_attr("flash_attn_interface", "flash_attn_varlen_func") is not None:
        found.add(3)
    if _import_attr("flash_attn.cute", "flash_attn_varlen_func") is not None:
        found.add(4)
    return frozenset(found)


# --------------------------------------------------------------------------------------------
# Version choice
# --------------------------------------------------------------------------------------------


FA3_KERNEL_HEAD_SIZES = (64, 96, 128, 192, 256)


@functools.lru_cache(maxsize=None)
def fa3_build_flags() -> dict:
    """Compile-time switches of the installed FA3 (``flash_attn_config.CONFIG``), {} if unknown.

    Wheels such as tokenspeed-fa3 are built with features switched off (soft-cap, some head-size
    kernels); calling them for those raises inside the kernel, so the version choice asks first.
    """
    try:
        config = getattr(importlib.import_module("flash_attn_config"), "CONFIG", None)
    except Exception:  # not installed, or a broken install: nothing known
        config = None
    flags = config.get("build_flags", {}) if isinstance(config, dict) else {}
    return {k: bool(v) for k, v in flags.items()}


def _fa3_build_reason(head_size: int, requires_softcap: bool) -> str | None:
    flags = fa3_build_flags()
    if requires_softcap and flags.get("FLASHATTENTION_DISABLE_SOFTCAP"):
        return "the installed FA3 was built without soft-cap (FLASHATTENTION_DISABLE_SOFTCAP)"
    # FA3 runs a head size on the smallest compiled kernel size that holds it
    if not any(k >= head_size and not flags.get(f"FLASHATTENTION_DISABLE_HDIM{k}")
               for k in FA3_KERNEL_HEAD_SIZES):
        return f"the installed FA3 has no kernel for head size {head_size} (build flags)"
    return None


def fa_unsupported_reason(
    version: int, head_size: int, capability: tuple[int, int], requires_alibi: bool = False,
    requires_softcap: bool = False,
) -> str | None:
    """Why FlashAttention ``version`` cannot run this attention on ``capability``; None if it can.

    Installation is not checked here (see :func:`detect_fa_versions`), but the installed FA3's
    build flags are (:func:`fa3_build_flags`).
    """
    major, minor = capability
    if head_size % 8 != 0:
        return f"head size {head_size} is not a multiple of 8"
    if version == 2 and capability < (8, 0):
        return f"FA2 needs SM 8.0 or newer, the device is SM {major}.{minor}"
    if version == 3 and major != 9:
        return f"FA3 runs only on Hopper (SM 9.x), the device is SM {major}.{minor}"
    if version == 4 and major not in (9, 10, 11):
        return f"FA4 runs only on SM 9.x/10.x/11.x, the device is SM {major}.{minor}"
    if requires_alibi and version != 2:
        return f"FA{version} has no ALiBi (only FA2 does)"
    if version in (2, 3) and head_size > FA2_FA3_MAX_HEAD_SIZE:
        return f"FA{version} supports head size <= {FA2_FA3_MAX_HEAD_SIZE}, got {head_size}"
    if version == 3:
        return _fa3_build_reason(head_size, requires_softcap)
    return None


def fa_version_supports(
    version: int, head_size: int, capability: tuple[int, int], requires_alibi: bool = False,
    requires_softcap: bool = False,
) -> bool:
    """Whether FA ``version`` (if installed) can run this attention on ``capability``."""
    return fa_unsupported_reason(version, head_size, capability, requires_alibi,
                                 requires_softcap) is None


def _preferred_version(
    head_size: int, requires_alibi: bool, capability: tuple[int, int]
) -> tuple[int, str]:
    """The version this device prefers before looking at what is installed, and why."""
    major, minor = capability
    if requires_alibi:
        return 2, "ALiBi needs FA2"
    if major == 9 and head_size > FA2_FA3_MAX_HEAD_SIZE:
        return 4, f"FA3 stops at head size {FA2_FA3_MAX_HEAD_SIZE}, so SM 9.x prefers FA4"
    if major == 9:
        return 3, "SM 9.x prefers FA3"
    if major in (10, 11):
        return 4, f"SM {major}.x prefers FA4"
    return 2, f"SM {major}.{minor} uses FA2"


def _parse_override(override: int | str | None) -> tuple[int | None, str]:
    """The requested version (argument first, then the environment variable) and its source."""
    if override is not None:
        raw, source = override, f"override={override!r}"
    else:
        raw = os.environ.get(FA_VERSION_ENV, "").strip()
        if not raw:
            return None, "automatic"
        source = f"{FA_VERSION_ENV}={raw!r}"
    try:
        version = int(raw) if not isinstance(raw, (bool, float)) else None
    except (TypeError, ValueError):
        version = None
    if version not in FA_VERSIONS:
        raise ValueError(
            f"invalid FlashAttention version {raw!r} ({source}); allowed values: 2, 3, 4"
        )
    return version, source


def _choose(
    head_size: int,
    requires_alibi: bool,
    capability: tuple[int, int] | None,
    available: set[int] | frozenset[int] | None,
    override: int | str | None,
    requires_softcap: bool = False,
) -> tuple[int | None, str]:
    """(version or None, readable reason). Raises ValueError for an override that can't run."""
    if isinstance(head_size, bool) or not isinstance(head_size, int) or head_size <= 0:
        raise ValueError(f"head_size must be a positive int, got {head_size!r}")
    requested, source = _parse_override(override)
    if capability is None:
        capability = current_capability()
    if available is None:
        available = detect_fa_versions()

    if requested is not None:
        return _check_override(requested, source, head_size, requires_alibi, capability, available,
                               requires_softcap)
    if capability is None:
        return None, "no CUDA GPU"

    preferred, why = _preferred_version(head_size, requires_alibi, capability)
    rejected = []
    for version in dict.fromkeys((preferred, 2)):  # the preferred one, then FA2
        reason = (
            f"FA{version} is not installed"
            if version not in available
            else fa_unsupported_reason(version, head_size, capability, requires_alibi,
                                       requires_softcap)
        )
        if reason is None:
            return version, why if not rejected else f"fallback to FA2 ({'; '.join(rejected)})"
        rejected.append(reason)
    return None, "; ".join(rejected)


def _check_override(
    version: int,
    source: str,
    head_size: int,
    requires_alibi: bool,
    capability: tuple[int, int] | None,
    available: set[int] | frozenset[int],
    requires_softcap: bool = False,
) -> tuple[int, str]:
    if capability is None:
        why = "no CUDA GPU was found"
    elif version not in available:
        installed = ", ".join(f"FA{v}" for v in sorted(available)) or "none"
        why = f"FA{version} is not installed (installed: {installed})"
    else:
        why = fa_unsupported_reason(version, head_size, capability, requires_alibi,
                                    requires_softcap)
    if why is None:
        return version, f"requested by {source}"
    usable = [
        f"FA{v}"
        for v in sorted(available)
        if capability is not None
        and fa_unsupported_reason(v, head_size, capability, requires_alibi,
                                  requires_softcap) is None
    ]
    alibi = " with ALiBi" if requires_alibi else ""
    raise ValueError(
        f"FlashAttention {version} was requested ({source}) but cannot run: {why}. "
        f"Usable here for head size {head_size}{alibi}: {', '.join(usable) or 'none'}; "
        f"drop {source} to choose automatically (torch SDPA when none is usable)."
    )


def get_flash_attn_version(
    head_size: int,
    requires_alibi: bool = False,
    *,
    capability: tuple[int, int] | None = None,
    available: set[int] | frozenset[int] | None = None,
    override: int | str | None = None,
    requires_softcap: bool = False,
) -> int | None:
    """The FlashAttention version (2, 3 or 4) for prefill of one layer, or None for torch SDPA.

    Args:
        head_size: the layer's head size; FA needs a multiple of 8.
        requires_alibi: the layer uses ALiBi (only FA2 has it).
        capability: ``(major, minor)``; None = the current CUDA device (no GPU -> None).
        available: installed versions; None = :func:`detect_fa_versions` (empty set = none usable).
        override: a version to force; None = ``$TQATTN_FLASH_ATTN_VERSION`` if set, else automatic.
        requires_softcap: the layer soft-caps its logits (an FA3 built without it is skipped).

    Automatic rules: SM 9.x -> FA3 (FA4 when head size > 256), SM 10.x/11.x -> FA4, else FA2; the
    preferred version falls back to FA2 when it is not installed or cannot run the layer; None when
    neither can. An override that cannot run raises ValueError saying why and what is usable.
    """
    return _choose(head_size, requires_alibi, capability, available, override,
                   requires_softcap)[0]


def describe_choice(
    head_size: int,
    requires_alibi: bool = False,
    *,
    capability: tuple[int, int] | None = None,
    available: set[int] | frozenset[int] | None = None,
    override: int | str | None = None,
    requires_softcap: bool = False,
) -> str:
    """:func:`get_flash_attn_version`'s answer and why, e.g. ``"FA3: SM 9.x prefers FA3"``."""
    version, why = _choose(head_size, requires_alibi, capability, available, override,
                           requires_softcap)
    return f"{fa_version_label(version)}: {why}"


def fa_version_label(version: int | None) -> str:
    return f"FA{version}" if version is not None else "none (torch SDPA)"


def log_fa_choice(layer_name: str, version: int | None) -> None:
    """Log the prefill implementation once per version (naming the first layer that uses it)."""
    what = fa_version_label(version)
    if version == 2:
        pkg = _flash_attn_package_varlen() is not None
        what += " (flash_attn package)" if pkg else " (torch built-in)"
    _log_once(logging.INFO, ("fa_choice", version), "Prefill attention: %s, first used by %s",
              what, layer_name)


# --------------------------------------------------------------------------------------------
# Varlen wrapper
# --------------------------------------------------------------------------------------------


def fa_window_size(window: int | None, causal: bool) -> tuple[int, int]:
    """Our window (a query sees the last ``window`` keys, itself included) as FA's (left, right).

    -1 means unbounded. FA aligns windows bottom-right, like our causal mask.
    """
    return (-1 if window is None else window - 1), (0 if causal else -1)


def flash_attn_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None,
    causal: bool,
    window: int | None = None,
    fa_version: int | None = None,
    softcap: float = 0.0,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed variable-length sequences; the one entry point for every prefill.

    Args:
        q: (total_q, Hq, D); k, v: (total_k, Hk, D) with Hq % Hk == 0 (GQA).
        cu_seqlens_q, cu_seqlens_k: int32 (B + 1,) offsets of each sequence in q and in k/v.
        max_seqlen_q, max_seqlen_k: longest query / key sequence (used by the FA kernels).
        softmax_scale: None = 1 / sqrt(D).
        causal: bottom-right aligned: query i of a sequence with q_len queries and k_len keys sits
            at key position k_len - q_len + i (what continuation chunks need).
        window: sliding window W: a query at position p sees keys at positions > p - W.
        fa_version: 2, 3 or 4 (chosen by :func:`get_flash_attn_version`), or None for torch SDPA.
        softcap: > 0 applies ``softcap * tanh(scores / softcap)`` before the softmax.
        return_lse: also return the log-sum-exp (natural log) of the scaled, softcapped scores.

    Returns:
        out (total_q, Hq, D) in q's dtype, and with ``return_lse`` the LSE (Hq, total_q) float32.
        A query that sees no key gets output 0 and LSE -inf on the SDPA path.
    """
    _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, window, softcap, fa_version)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    if fa_version is None:
        out, lse = _sdpa_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window, softcap, return_lse
        )
    else:
        fa_args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale)
        window_size = fa_window_size(window, causal)
        fa2_package = _flash_attn_package_varlen() if fa_version == 2 else None
        if fa2_package is not None:
            result = _call_fa2_fa3(fa2_package, *fa_args, causal, window_size, softcap, return_lse)
            out, lse = _split_result(result, return_lse, q, "flash_attn")
        elif fa_version == 2:
            out, lse = _torch_fa2_varlen(*fa_args, causal, window, softcap, return_lse)
        elif fa_version == 3:
            fn = _require("flash_attn_interface", 3, "pip install tokenspeed-fa3")
            result = _call_fa2_fa3(fn, *fa_args, causal, window_size, softcap, return_lse)
            out, lse = _split_result(result, return_lse, q, "flash_attn_interface")
        else:
            fn = _require("flash_attn.cute", 4, "pip install flash-attn-4")
            result = _call_fa4(fn, *fa_args, causal, window_size, softcap, return_lse)
            out, lse = _split_result(result, return_lse, q, "flash_attn.cute")
    return (out, lse) if return_lse else out


def _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, window, softcap, fa_version):
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q, k, v must be 3-D (tokens, heads, head_size), got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"k and v must have the same shape and q the same head size: "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})"
        )
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
            raise ValueError(
                f"{name} must be a 1-D int32 tensor of B + 1 offsets, got dtype {cu.dtype} "
                f"shape {tuple(cu.shape)}"
            )
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same length (B + 1), got "
            f"{cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}"
        )
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0 disables it), got {softcap}")
    if fa_version not in (None, *FA_VERSIONS):
        raise ValueError(f"fa_version must be None, 2, 3 or 4, got {fa_version!r}")


def _require(module: str, version: int, hint: str):
    fn = _import_attr(module, "flash_attn_varlen_func")
    if fn is None:
        raise RuntimeError(
            f"fa_version={version} needs {module}.flash_attn_varlen_func, which does not import "
            f"here ({hint}); choose the version with get_flash_attn_version()"
        )
    return fn


def _call_fa2_fa3(fn, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window_size, softcap,
                  return_lse):
    # flash_attn (FA2) and flash_attn_interface (FA3) share these argument names.
    return fn(
        q, k, v,
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
        softmax_scale=scale, causal=causal, window_size=window_size, softcap=softcap,
        return_attn_probs=return_lse,
    )


def _call_fa4(fn, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window_size, softcap,
              return_lse):
    # FA4 spells "unbounded" as None rather than -1.
    left, right = (None if w < 0 else w for w in window_size)
    return fn(
        q, k, v,
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
        softmax_scale=scale, causal=causal, window_size=(left, right), softcap=softcap,
        return_lse=return_lse,
    )


def _split_result(result, return_lse: bool, q: torch.Tensor, name: str):
    """(out, lse or None) from an FA call that returns ``out`` or ``(out, lse, ...)``."""
    if isinstance(result, (tuple, list)):
        out, lse = result[0], (result[1] if len(result) > 1 else None)
    else:
        out, lse = result, None
    if not return_lse:
        return out, None
    if lse is None:
        raise RuntimeError(f"{name} returned no LSE although it was requested")
    return out, _lse_heads_first(lse, q.shape[1], q.shape[0])


def _lse_heads_first(lse: torch.Tensor, num_heads: int, total_q: int) -> torch.Tensor:
    """LSE as (num_heads, total_q) float32.

    FA2, FA3, FA4 and torch's flash kernel return varlen LSE as (num_heads, total_q) already;
    torch's varlen_attn documents (total_q, num_heads), so that layout is transposed.
    """
    if lse.shape != (num_heads, total_q) and lse.shape == (total_q, num_heads):
        lse = lse.transpose(0, 1)
    if lse.shape != (num_heads, total_q):
        raise RuntimeError(
            f"unexpected LSE shape {tuple(lse.shape)}; expected ({num_heads}, {total_q})"
        )
    return lse.float()


# --- FA2 through torch's built-in flash kernel ------------------------------------------------


@functools.lru_cache(maxsize=None)
def _torch_varlen_attn():
    """(torch.nn.attention.varlen.varlen_attn, accepts enable_gqa) if usable, else None."""
    try:
        from torch.nn.attention import varlen

        params = inspect.signature(varlen.varlen_attn).parameters
    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    if not {"scale", "window_size", "return_aux"} <= params.keys():
        return None
    return varlen.varlen_attn, "enable_gqa" in params


def _torch_fa2_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, softcap,
                      return_lse):
    varlen = _torch_varlen_attn()
    if softcap:
        missing = "softcap"
    elif varlen is None and window is not None:
        missing = "sliding window"
    elif varlen is None and return_lse:
        missing = "LSE output"
    else:
        missing = None
    if missing is not None:
        # Same math, slower: logged once, never silent.
        _log_once(logging.WARNING, ("torch_fa2", missing),
                  "torch's built-in FlashAttention 2 has no %s here; those calls run the torch "
                  "SDPA reference path (install flash-attn for the fast path)", missing)
        return _sdpa_varlen(q, k, v, cu_q, cu_k, scale, causal, window, softcap, return_lse)
    if varlen is None:
        return _sdpa_flash_varlen(q, k, v, cu_q, cu_k, scale, causal), None

    varlen_attn, has_enable_gqa = varlen
    kwargs = {"scale": scale, "window_size": fa_window_size(window, causal)}
    if q.shape[1] != k.shape[1]:
        if has_enable_gqa:
            kwargs["enable_gqa"] = True
        else:  # torch 2.11's varlen_attn has no GQA
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if return_lse:
        from torch.nn.attention.varlen import AuxRequest

        kwargs["return_aux"] = AuxRequest(lse=True)
    result = varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
    return _split_result(result, return_lse, q, "torch varlen_attn")


def _sdpa_flash_varlen(q, k, v, cu_q, cu_k, scale, causal):
    """Per-sequence SDPA restricted to the FLASH_ATTENTION backend (torch without varlen_attn)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    out = torch.zeros_like(q)
    group = q.shape[1] // k.shape[1]
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for qa, qb, ka, kb in _sequence_bounds(cu_q, cu_k, q.shape[0], k.shape[0]):
            if qb == qa or kb == ka:
                continue
            # The lower-right causal bias calls the flash kernel without GQA support: repeat heads.
            qs = q[qa:qb].transpose(0, 1).unsqueeze(0)
            ks = k[ka:kb].transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0)
            vs = v[ka:kb].transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0)
            mask, is_causal = None, causal
            if causal and qb - qa != kb - ka:
                mask, is_causal = causal_lower_right(qb - qa, kb - ka), False
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=is_causal,
                                               scale=scale)
            out[qa:qb] = o[0].transpose(0, 1)
    return out


# --- torch SDPA path (fa_version=None) --------------------------------------------------------


def _sequence_bounds(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int):
    """[(q_start, q_end, k_start, k_end)] per sequence.

    Reads the offsets with ``.tolist()``, a host sync: fine for the CPU / no-FA fallbacks only.
    """
    offsets_q, offsets_k = cu_q.tolist(), cu_k.tolist()
    for name, offsets, total in (("cu_seqlens_q", offsets_q, total_q),
                                 ("cu_seqlens_k", offsets_k, total_k)):
        if offsets[0] != 0 or offsets[-1] != total or any(
                a > b for a, b in zip(offsets, offsets[1:])):
            raise ValueError(
                f"{name} must rise from 0 to the token count {total}, got {offsets}"
            )
    return [
        (offsets_q[i], offsets_q[i + 1], offsets_k[i], offsets_k[i + 1])
        for i in range(len(offsets_q) - 1)
    ]


def varlen_attn_mask(q_len: int, k_len: int, causal: bool, window: int | None,
                     device: torch.device | str = "cpu") -> torch.Tensor | None:
    """Boolean (q_len, k_len) mask, True = attend; None when every key is visible.

    Query i sits at key position p = k_len - q_len + i (bottom-right alignment); causal keeps keys
    <= p, a window W keeps keys > p - W.
    """
    if not causal and window is None:
        return None
    pos_q = torch.arange(q_len, device=device).unsqueeze(1) + (k_len - q_len)
    pos_k = torch.arange(k_len, device=device).unsqueeze(0)
    mask = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if causal:
        mask &= pos_k <= pos_q
    if window is not None:
        mask &= pos_k > pos_q - window
    return mask


def _attention_math(q, k, v, scale, mask, softcap):
    """Attention for one sequence in fp32. q: (Hq, Lq, D), k/v: (Hk, Lk, D).

    Returns out (Hq, Lq, D) and lse (Hq, Lq); a row with no visible key gets 0 and -inf.
    """
    group = q.shape[0] // k.shape[0]
    k = k.float().repeat_interleave(group, dim=0)
    v = v.float().repeat_interleave(group, dim=0)
    scores = torch.matmul(q.float(), k.transpose(-1, -2)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    safe_lse = lse.masked_fill(lse == float("-inf"), 0.0)  # exp(-inf - 0) = 0 for empty rows
    probs = torch.exp(scores - safe_lse.unsqueeze(-1))
    return torch.matmul(probs, v), lse


def _sdpa_varlen(q, k, v, cu_q, cu_k, scale, causal, window, softcap, return_lse):
    """torch SDPA per sequence; the manual math path when softcap or the LSE is needed."""
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32,
                     device=q.device) if return_lse else None
    gqa = q.shape[1] != k.shape[1]
    for qa, qb, ka, kb in _sequence_bounds(cu_q, cu_k, q.shape[0], k.shape[0]):
        q_len, k_len = qb - qa, kb - ka
        if q_len == 0 or k_len == 0:
            continue  # no keys: output 0, LSE -inf
        qs, ks, vs = (t.transpose(0, 1) for t in (q[qa:qb], k[ka:kb], v[ka:kb]))
        if softcap or return_lse:
            mask = varlen_attn_mask(q_len, k_len, causal, window, q.device)
            o, seq_lse = _attention_math(qs, ks, vs, scale, mask, softcap)
            if lse is not None:
                lse[:, qa:qb] = seq_lse
        elif causal and window is None and q_len == k_len:
            # top-left == bottom-right alignment here, and no mask keeps fast SDPA kernels usable;
            # 4-D inputs: with 3-D ones CPU SDPA leaves its fast kernel (3x slower at 2K keys)
            o = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], is_causal=True,
                                               scale=scale, enable_gqa=gqa)[0]
        else:
            mask = varlen_attn_mask(q_len, k_len, causal, window, q.device)
            o = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], attn_mask=mask,
                                               scale=scale, enable_gqa=gqa)[0]
        out[qa:qb] = o.transpose(0, 1).to(q.dtype)
    return out, lse
