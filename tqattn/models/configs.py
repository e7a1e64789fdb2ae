"""Model configs shipped as package data (tqattn/configs/models/*.json), for dummy-weight loading.

The real-model files (Qwen3-4B, Llama-3.1-8B, ...) are the models' published HF config.json
facts; the `*-tiny` ones are small deterministic test models (hidden 64, 4 q heads, 2 kv heads).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def _configs_dir() -> Path:
    return Path(str(resources.files("tqattn") / "configs" / "models"))


def list_model_configs() -> list[str]:
    """Names of the shipped configs, e.g. ["Gemma-3-270M", ..., "llama-tiny", ...]."""
    return sorted(p.stem for p in _configs_dir().glob("*.json"))


def model_config_path(name: str) -> Path | None:
    """Path of the shipped config called `name` (case-insensitive), or None."""
    for stem in list_model_configs():
        if stem.lower() == name.lower():
            return _configs_dir() / f"{stem}.json"
    return None
