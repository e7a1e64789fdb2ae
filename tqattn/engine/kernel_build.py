"""One Triton/Gluon kernel build as data: what ``triton.compile`` takes, without the launch's tensors.

A launch ``kernel[grid](*args, **kwargs)`` is bound the way triton's ``JITFunction.run`` binds it
(the same binder, the same argument packing), so the description compiles to the very entry the
JIT looks up in Triton's disk cache. It pickles (the kernel by module and name; constexprs are
plain values and frozen dataclasses), so a process without a GPU can compile it for the device's
target: the engine's start-up hands these to worker processes (:mod:`tqattn.engine.precompile`).

Uses triton's own binding and cache-key functions (triton 3.6); :func:`available` says whether
this triton has them.
"""

from __future__ import annotations

import hashlib
import importlib
import time
from dataclasses import dataclass
from typing import Any


def available() -> str | None:
    """None if this triton has what binding and cache keys need, else why not."""
    try:
        from triton import knobs  # noqa: F401
        from triton._C.libtriton import get_cache_invalidating_env_vars  # noqa: F401
        from triton.compiler import ASTSource, make_backend  # noqa: F401
        from triton.runtime.cache import get_cache_key, get_cache_manager  # noqa: F401
        from triton.runtime.jit import (JITFunction, compute_cache_key,  # noqa: F401
                                        create_function_from_signature)
    except ImportError as e:
        return f"triton lacks {e.name or e}"
    if not hasattr(JITFunction, "_pack_args"):
        return "triton's JITFunction has no _pack_args"
    return None


@dataclass
class KernelBuild:
    """A build of the JIT function ``module.name`` for ``target`` (a triton GPUTarget)."""
    module: str
    name: str
    signature: dict[str, Any]
    constexprs: dict[tuple, Any]
    attrs: dict[tuple, Any]
    options: dict[str, Any]
    target: Any

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"

    def function(self):
        return getattr(importlib.import_module(self.module), self.name)

    def source(self, fn=None):
        fn = self.function() if fn is None else fn
        if fn.is_gluon():
            from triton.experimental.gluon._runtime import GluonASTSource as Source
        else:
            from triton.compiler import ASTSource as Source
        return Source(fn, self.signature, self.constexprs, self.attrs)

    def cache_key(self, fn=None) -> str:
        """The name of this build's entry in Triton's disk cache, as ``triton.compile`` derives it."""
        from triton._C.libtriton import get_cache_invalidating_env_vars
        from triton.compiler import make_backend
        from triton.runtime.cache import get_cache_key

        src = self.source(fn)
        backend = make_backend(self.target)
        options = backend.parse_options(dict(self.options, **src.parse_options()))
        key = get_cache_key(src, backend, options, get_cache_invalidating_env_vars())
        return hashlib.sha256(key.encode("utf-8")).hexdigest()

    def in_disk_cache(self, cache_key: str) -> bool:
        """Whether Triton's disk cache (TRITON_CACHE_DIR) holds the build of this key."""
        from triton.runtime.cache import get_cache_manager

        name = f"{self.name[:150]}.json"  # triton.compile's (truncated) metadata file name
        group = get_cache_manager(cache_key).get_group(name)
        return bool(group) and name in group

    def compile(self) -> float:
        """Compile into Triton's disk cache (a hit just loads it); returns the seconds taken."""
        from triton import compile as triton_compile

        t = time.perf_counter()
        triton_compile(self.source(), target=self.target, options=self.options)
        return time.perf_counter() - t


class Binder:
    """Binds launches to :class:`KernelBuild` for one target, as ``JITFunction.run`` does."""

    def __init__(self, target):
        from triton.compiler import make_backend

        self.target = target
        self.backend = make_backend(target)
        self._binders: dict[int, tuple] = {}  # id(fn) -> (fn, binder, key cache)

    def _run_kwargs(self, fn, kwargs: dict) -> dict:
        from triton import knobs

        # the two options JITFunction.run adds before binding
        kwargs = dict(kwargs)
        kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        return kwargs

    def bind(self, fn, args: tuple, kwargs: dict):
        """(the JIT's in-process key of this launch's specialization, the bound launch)."""
        from triton.runtime.jit import compute_cache_key, create_function_from_signature

        entry = self._binders.get(id(fn))
        if entry is None:
            binder = create_function_from_signature(fn.signature, fn.params, self.backend)
            entry = self._binders[id(fn)] = (fn, binder, {})
        kwargs = self._run_kwargs(fn, kwargs)
        bound, specialization, options = entry[1](*args, **kwargs)
        key = compute_cache_key(entry[2], specialization, options)
        return key, (kwargs, bound, specialization, options)

    def build(self, fn, bound_launch) -> KernelBuild:
        """The build of a launch :meth:`bind` bound. Raises ValueError for a kernel that a fresh
        process cannot find by module and name (defined in a function, say)."""
        kwargs, bound, specialization, options = bound_launch
        options, signature, constexprs, attrs = fn._pack_args(self.backend, kwargs, bound,
                                                              specialization, options)
        module, name = fn.module, fn.__name__
        if getattr(importlib.import_module(module), name, None) is not fn:
            raise ValueError(f"{module}.{name} is not a module-level kernel")
        return KernelBuild(module, name, signature, constexprs, attrs, dict(options.__dict__),
                           self.target)
