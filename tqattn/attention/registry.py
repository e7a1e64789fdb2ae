"""Backend registry and selection (vLLM's ``get_attn_backend``, reduced to what we need).

Backends register under their ``name``. :func:`select_backend` walks :data:`PRIORITY` and
returns the first backend whose ``unsupported_reason(spec)`` is None: only TURBOQUANT accepts
the quantized presets and only FLASH_ATTN the full-precision dtypes, so the KV-cache dtype
decides, and a layer nobody can run gets one error listing every backend's reason.
"""

from __future__ import annotations

import importlib

from .backend import AttentionBackend, AttentionLayerSpec

# Checked in this order; backends registered by others are tried after these.
PRIORITY = ("TURBOQUANT", "FLASH_ATTN")
_BUILTIN_MODULES = ("tqattn.attention.turboquant", "tqattn.attention.flash_attn")

_REGISTRY: dict[str, type[AttentionBackend]] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    """Register a backend class under ``cls.name`` (usable as a class decorator)."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls!r} has no backend name")
    other = _REGISTRY.get(name)
    if other is not None and other is not cls:
        raise ValueError(f"backend name {name!r} already registered by {other.__qualname__}")
    _REGISTRY[name] = cls
    return cls


def _load_builtin() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def registered_backends() -> list[type[AttentionBackend]]:
    """Every registered backend, in selection order."""
    _load_builtin()
    ordered = [_REGISTRY[n] for n in PRIORITY if n in _REGISTRY]
    return ordered + [b for n, b in _REGISTRY.items() if n not in PRIORITY]


def get_backend(name: str) -> type[AttentionBackend]:
    _load_builtin()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; registered: "
                         f"{', '.join(b.name for b in registered_backends())}") from None


def select_backend(spec: AttentionLayerSpec, backend: str | None = None) -> type[AttentionBackend]:
    """The backend for one layer: ``backend`` if named (and able), else the first able one."""
    candidates = [get_backend(backend)] if backend is not None else registered_backends()
    reasons = []
    for cls in candidates:
        reason = cls.unsupported_reason(spec)
        if reason is None:
            return cls
        reasons.append(f"{cls.name}: {reason}")
    raise ValueError(
        f"no attention backend can run {spec.name} (kv_cache_dtype={spec.kv_cache_dtype!r}, "
        f"head_size={spec.head_size}, dtype={spec.dtype}): " + "; ".join(reasons))
