"""``tqattn env``: what this machine offers for attention, in the spirit of ``vllm collect-env``."""

from __future__ import annotations

import importlib.metadata
import os
import platform

import torch

import tqattn
from tqattn.attention import fa_utils

REPORT_HEAD_SIZES = (64, 128, 256, 512)


def _package_version(name: str) -> str | None:
    # Read from the installed metadata: importing transformers or triton just to ask is slow.
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _fa_choices() -> list[dict]:
    """The prefill FA version for each reported head size, with and without ALiBi."""
    rows = []
    for head_size in REPORT_HEAD_SIZES:
        for alibi in (False, True):
            try:
                version = fa_utils.get_flash_attn_version(head_size, alibi)
                choice = fa_utils.describe_choice(head_size, alibi)
            except ValueError as e:  # e.g. an invalid or unusable TQATTN_FLASH_ATTN_VERSION
                version, choice = None, f"error: {e}"
            rows.append({"head_size": head_size, "alibi": alibi, "version": version,
                         "choice": choice})
    return rows


def collect_env() -> dict:
    """Versions, device and FlashAttention facts as a plain dict (JSON-serializable)."""
    capability = fa_utils.current_capability()
    device_name = None
    if capability is not None:
        try:
            device_name = torch.cuda.get_device_name()
        except Exception:
            device_name = None
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "tqattn": tqattn.__version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": _package_version("triton"),
        "transformers": _package_version("transformers"),
        "flash_attn": _package_version("flash-attn") or _package_version("flash_attn"),
        "flash_attn_4": _package_version("flash-attn-4"),
        "tokenspeed_fa3": _package_version("tokenspeed-fa3"),
        "cuda_available": torch.cuda.is_available(),
        "device_name": device_name,
        "device_capability": None if capability is None else f"{capability[0]}.{capability[1]}",
        "fa_versions": sorted(fa_utils.detect_fa_versions()),
        "fa2_provider": {"flash_attn": "flash_attn package", "torch": "torch built-in"}.get(
            fa_utils.fa2_provider() or ""),
        "fa_version_env": os.environ.get(fa_utils.FA_VERSION_ENV),
        "fa_choice": _fa_choices(),
        "fa3_disabled": sorted(k for k, v in fa_utils.fa3_build_flags().items()
                               if v and "DISABLE" in k),
        "softcap_choice": _softcap_choice(),
    }


def _softcap_choice() -> str:
    """The choice for a soft-capped head-size-128 layer (some FA builds lack soft-cap)."""
    try:
        return fa_utils.describe_choice(128, requires_softcap=True)
    except ValueError as e:
        return f"error: {e}"


def format_env(d: dict) -> str:
    """Human-readable report of :func:`collect_env`'s dict."""

    def show(value) -> str:
        return "N/A" if value is None else str(value)

    fa = ", ".join(f"FA{v}" for v in d["fa_versions"]) or "none"
    lines = [
        "tqattn environment",
        "==================",
        f"tqattn version:       {show(d['tqattn'])}",
        f"Python version:       {d['python']}",
        f"Platform:             {d['platform']}",
        f"PyTorch version:      {d['torch']} (CUDA {show(d['torch_cuda'])})",
        f"Triton version:       {show(d['triton'])}",
        f"Transformers version: {show(d['transformers'])}",
        f"flash-attn:           {show(d['flash_attn'])}",
        f"flash-attn-4:         {show(d['flash_attn_4'])}",
        f"tokenspeed-fa3:       {show(d['tokenspeed_fa3'])}",
        "",
        f"CUDA available:       {d['cuda_available']}",
        f"GPU:                  {show(d['device_name'])}",
        f"Compute capability:   {show(d['device_capability'])}",
        f"FlashAttention found: {fa}",
        f"FA2 provided by:      {show(d['fa2_provider'])}",
        f"FA3 built without:    {', '.join(d['fa3_disabled']) or '-'}",
        f"{fa_utils.FA_VERSION_ENV}: {d['fa_version_env'] or '(unset: automatic)'}",
        "",
        "Prefill attention by head size:",
        f"  {'head':>4}  {'alibi':<5}  choice: reason",
    ]
    for row in d["fa_choice"]:
        alibi = "yes" if row["alibi"] else "no"
        lines.append(f"  {row['head_size']:>4}  {alibi:<5}  {row['choice']}")
    lines.append(f"   128  no     soft-cap: {d['softcap_choice']}")
    return "\n".join(lines)
