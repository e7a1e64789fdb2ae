"""tqattn: TurboQuant KV-cache attention backend and a compact inference engine.

The package imports on a CPU-only machine without triton, flash-attn or transformers; features
that need them import them lazily and say so when they are missing.
"""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name):
    # Lazy, so that `import tqattn` stays light (no transformers until a model is loaded).
    if name == "LLM":
        from .engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from .engine.sampling import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'tqattn' has no attribute {name!r}")
