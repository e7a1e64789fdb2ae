"""Loading Hugging Face models: local safetensors dirs, GGUF files, dummy weights from a config.

Importing this package does not import transformers; `load_model` does, on first use.
"""

from tqattn.models.configs import list_model_configs, model_config_path
from tqattn.models.info import ModelInfo, model_info
from tqattn.models.loader import (
    DEFAULT_MODEL,
    DEFAULT_MODEL_INSTALL,
    LoadedModel,
    default_model_path,
    load_config,
    load_model,
)

__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_MODEL_INSTALL",
    "LoadedModel",
    "ModelInfo",
    "default_model_path",
    "list_model_configs",
    "load_config",
    "load_model",
    "model_config_path",
    "model_info",
]
