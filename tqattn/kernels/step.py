"""What runs a kernel call: the Triton kernel or the PyTorch reference, which decode kernel, and
where a decode step's new K/V are written (no triton import).

:func:`plan_decode_store` is the one place that decides where the ``new_kv`` of a decode call
(:func:`tqattn.kernels.decode_attention`) go:

* ``DECODE_KERNEL`` — the tensor-core decode kernel (kernels/decode_mma.py) encodes each
  sequence's new token itself before reading it: one launch per step;
* ``STORE_KERNEL`` — the store kernel runs first, then the portable Triton decode kernel
  (kernels/decode.py);
* ``REFERENCE`` — no Triton kernel for this call (CPU tensors, no triton, a layout without a
  kernel): the reference store, then the reference decode (tqattn.quant.paged).

The attention backend hands a decode-only step's new K/V to the decode; a step with prompt
tokens stores all its tokens first (``TurboQuantImpl.store``) and passes none.

``TQATTN_FORCE_TRITON=1`` runs the Triton kernels on CPU tensors too, under triton's
interpreter (``TRITON_INTERPRET=1`` set before the kernels are imported): the CPU test suite
runs the attention backends through the kernels this way.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os

import torch

from ..quant.paged import cache_block_size
from ._spec import kernel_spec

log = logging.getLogger(__name__)
_warned: set = set()

REFERENCE, STORE_KERNEL, DECODE_KERNEL = "reference", "store_kernel", "decode_kernel"
MAX_MMA_GROUP = 8   # query heads per KV head in one tensor-core tile (its N = 8)


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or os.environ.get("TQATTN_FORCE_TRITON", "0") == "1"


def fallback(what: str, err: Exception) -> None:
    """Log once per ``what`` that the PyTorch reference runs instead of a Triton kernel."""
    if what not in _warned:
        _warned.add(what)
        log.warning("%s: no Triton kernel (%s); using the PyTorch reference", what, err)


def triton_module(name: str):
    """tqattn.kernels.<name>, or None without triton (logged once)."""
    try:
        return importlib.import_module(f"{__package__}.{name}")
    except ImportError as e:
        fallback(f"tqattn.kernels.{name}", e)
        return None


@functools.lru_cache(maxsize=None)
def _tensor_core_module() -> bool:
    """Whether kernels/decode_mma.py imports: a triton with Gluon and its mma_v2 layouts."""
    try:
        importlib.import_module(f"{__package__}.decode_mma")
        return True
    except ImportError:
        return False


def tensor_cores(device) -> bool:
    """Whether the tensor-core decode kernel can run on this device (sm_80+, Gluon)."""
    device = torch.device(device)
    return (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)
            and _tensor_core_module())


def plain(query_start_loc=None, query_pos_start=None, window=None, softcap=0.0) -> bool:
    """One row per sequence, no window, no soft-cap: the calls the tensor-core kernel serves."""
    return query_start_loc is None and query_pos_start is None and not window and not softcap


def tensor_core_decode(spec, q: torch.Tensor, num_kv_heads: int, plain: bool) -> bool:
    """Whether the tensor-core kernel runs a Triton decode call (spec: its KernelSpec; plain:
    see :func:`plain`)."""
    return plain and tensor_core_layout(spec, q.shape[1] // num_kv_heads, q.device)


def tensor_core_layout(spec, group: int, device) -> bool:
    """Whether the tensor-core kernel runs this layout (KernelSpec) at ``group`` query heads
    per KV head on ``device``."""
    return bool(spec.mma and group <= MAX_MMA_GROUP and tensor_cores(device)
                and (spec.mma.keys != 2 or torch.cuda.get_device_capability(device) >= (8, 9)))


def decode_kernel_store(spec, q: torch.Tensor, num_kv_heads: int, plain: bool) -> str:
    """For a Triton decode call: DECODE_KERNEL where the tensor-core kernel runs it and stores
    the step's new token itself, else STORE_KERNEL."""
    return store_site(spec, tensor_core_decode(spec, q, num_kv_heads, plain))


def store_site(spec, mma: bool) -> str:
    """:func:`decode_kernel_store` given whether the tensor-core kernel runs the call: it stores
    the new token itself in its layouts with ``spec.mma.store``."""
    return DECODE_KERNEL if mma and spec.mma.store else STORE_KERNEL


def triton_spec(codec, q: torch.Tensor, kv_cache: torch.Tensor):
    """The KernelSpec of a decode call the Triton kernels serve, or None where the reference
    runs it (CPU tensors, no triton, a layout without a kernel: logged once)."""
    if not use_triton(q) or triton_module("decode") is None:
        return None
    try:
        return kernel_spec(codec, cache_block_size(codec, kv_cache))
    except NotImplementedError as e:
        fallback(f"decode {codec.preset.name}", e)
        return None


def plan_decode_store(codec, q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc=None,
                      query_pos_start=None, window=None, softcap=0.0) -> str:
    """Where this decode call's new K/V are written (and so which kernels run it):
    REFERENCE, STORE_KERNEL or DECODE_KERNEL (module docstring)."""
    spec = triton_spec(codec, q, kv_cache)
    if spec is None:
        return REFERENCE
    return decode_kernel_store(spec, q, kv_cache.shape[1],
                               plain(query_start_loc, query_pos_start, window, softcap))
