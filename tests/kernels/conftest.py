"""Kernel tests: on a machine without CUDA the Triton kernels run under triton's interpreter.

``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is defined; tests/conftest.py sets
it for the whole CPU session before any test module is imported, and the kernel modules are
imported here under it (also when this directory runs alone with the flag unset by the caller).
With CUDA (``pytest -m gpu``) the kernels compile normally.
"""

import importlib
import os

import torch

INTERPRET = not torch.cuda.is_available()
KERNELS_IMPORTED = False

if INTERPRET:
    _prev = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        # the interpreter imports gluon lazily at the first launch; its definitions check the
        # flag at import time, so import it now while the flag is set
        importlib.import_module("triton.experimental.gluon")
        for _m in ("store", "decode", "dequant", "kv_write"):
            importlib.import_module(f"tqattn.kernels.{_m}")
        KERNELS_IMPORTED = True
    except ImportError:  # no triton: the CPU kernel tests skip themselves
        pass
    finally:
        if _prev is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = _prev
