"""Adapters that put tqattn's KV-cache codec into other libraries (transformers: ``transformers``).

Each submodule imports its library; this package imports nothing optional."""
