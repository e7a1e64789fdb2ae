"""tqattn: TurboQuant KV-cache attention backend and a compact inference engine.

The package imports on a CPU-only machine without triton, flash-attn or transformers; features
that need them import them lazily and say so when they are missing.
"""

__version__ = "0.1.0"
