"""How a model splits over tensor-parallel ranks: its heads, and transformers' plan that shards it.

A rank computes whole attention heads and holds the KV heads they read, so attention needs no
communication and each rank's KV cache holds only its own KV heads. The weights are sharded by
the model's own transformers tensor-parallel plan (``base_model_tp_plan``) through
``from_pretrained(..., distributed_config=DistributedConfig(tp_size=N))``, on the process group
the caller has already joined.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tqattn.models.info import model_info

# Model types whose transformers TP plan was checked against tqattn's attention (heads split
# column-wise per head, o_proj row-wise): other plans may shard attention differently.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
_ATTENTION_PLAN = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise"}


@dataclass(frozen=True)
class HeadSplit:
    tensor_parallel_size: int
    num_q_heads: int  # attention heads per rank
    num_kv_heads: int  # KV heads per rank (what its cache holds)
    kv_head_replicas: int  # ranks holding each KV head: 1 = sharded, > 1 = replicated


def split_heads(num_q_heads: int, num_kv_heads: int, tp: int) -> HeadSplit:
    """Each rank's heads; raises ValueError naming the sizes that work when tp cannot split them.

    With fewer KV heads than ranks, each KV head is replicated on tp / num_kv_heads ranks (the
    grouped-query heads of one KV head stay on its ranks); a tp that neither divides nor is a
    multiple of the KV heads would need a rank to hold part of a KV group, and is refused."""
    allowed = [d for d in range(1, num_q_heads + 1)
               if num_q_heads % d == 0 and (num_kv_heads % d == 0 or d % num_kv_heads == 0)]
    hint = f"allowed tensor_parallel_size for this model: {', '.join(map(str, allowed))}"
    if tp > num_q_heads:
        raise ValueError(f"tensor_parallel_size={tp} is more than the model's {num_q_heads} "
                         f"attention heads (a rank computes whole heads); {hint}")
    if num_q_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {num_q_heads} "
                         f"attention heads; {hint}")
    if num_kv_heads % tp == 0:
        return HeadSplit(tp, num_q_heads // tp, num_kv_heads // tp, 1)
    if tp % num_kv_heads == 0:
        return HeadSplit(tp, num_q_heads // tp, 1, tp // num_kv_heads)
    raise ValueError(f"tensor_parallel_size={tp} cannot split the model's {num_kv_heads} KV heads: "
                     f"each rank holds whole KV heads, so {tp} must divide {num_kv_heads} (sharded) "
                     f"or be a multiple of it (replicated); {hint}")


def _text_config(hf_config: Any) -> Any:
    return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config


def check_model(hf_config: Any, tp: int) -> HeadSplit:
    """The model's heads split over tp ranks; raises ValueError when its type, its transformers
    plan, its heads or the installed transformers cannot do it."""
    info = model_info(hf_config)
    if tp == 1:
        return split_heads(info.num_q_heads, info.num_kv_heads, 1)
    if info.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"tensor_parallel_size={tp}: model_type {info.model_type!r} is not supported "
                         f"with tensor parallelism; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    plan = getattr(_text_config(hf_config), "base_model_tp_plan", None) or {}
    styles = {key.rsplit(".", 1)[-1]: style for key, style in plan.items() if ".self_attn." in key}
    if any(styles.get(k) != v for k, v in _ATTENTION_PLAN.items()):
        raise ValueError(f"tensor_parallel_size={tp}: the transformers tensor-parallel plan of "
                         f"{info.model_type} does not split attention by heads ({styles or 'no plan'}); "
                         f"tqattn needs {_ATTENTION_PLAN}")
    split = split_heads(info.num_q_heads, info.num_kv_heads, tp)
    try:
        from transformers.distributed import DistributedConfig  # noqa: F401
    except ImportError:
        import transformers

        raise ValueError(f"tensor_parallel_size={tp} needs transformers' DistributedConfig "
                         f"(transformers.distributed, in 5.25); transformers {transformers.__version__} "
                         f"has none") from None
    return split


def tp_load_kwargs(hf_config: Any, model_prefix: str, tp: int) -> dict:
    """``from_pretrained`` keyword arguments that shard the model over the joined process group
    with its own plan, and three overrides (transformers' own styles):

    * the input embedding stays whole on every rank (``replicate``): the plan's vocab-parallel
      embedding (DTensor sharding propagation) could not be traced when the whole model was
      compiled; the embedding now runs eagerly, but sharding it is untested. A tied LM head
      shares that whole weight, so it stays whole too;
    * with fewer KV heads than ranks the KV projections use ``unit_colwise`` (whole heads, each on
      tp / num_kv_heads ranks)."""
    from transformers.distributed import DistributedConfig

    split = check_model(hf_config, tp)
    cfg = _text_config(hf_config)
    overrides = {f"{model_prefix}.embed_tokens": "replicate"}
    if getattr(hf_config, "tie_word_embeddings", False) or getattr(cfg, "tie_word_embeddings", False):
        overrides["lm_head"] = "replicate"
    if split.kv_head_replicas > 1:
        overrides.update({f"{model_prefix}.{key}": "unit_colwise" for key, style in cfg.base_model_tp_plan.items()
                          if key.rsplit(".", 1)[-1] in ("k_proj", "v_proj") and style == "colwise"})
    return {"distributed_config": DistributedConfig(tp_size=tp, tp_plan=overrides)}


def shard(model: Any, tp: int) -> Any:
    """A whole model (dummy or de-quantized GGUF weights, the same on every rank) re-loaded as this
    rank's shard: transformers slices each weight by the plan as it loads the state dict."""
    return type(model).from_pretrained(None, config=model.config, state_dict=model.state_dict(),
                                       dtype=model.dtype, **tp_load_kwargs(model.config,
                                                                           model.base_model_prefix, tp))
