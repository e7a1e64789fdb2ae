"""Scheduler configuration (a plain dataclass that flows down into the engine)."""

from dataclasses import dataclass


def _check_positive_int(name: str, value) -> None:
    # bool is an int subclass; True as a block size is a bug, not a 1.
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(kw_only=True)
class SchedulerConfig:
    max_model_len: int  # prompt + generated tokens of one request, from the model config
    max_num_seqs: int = 256  # running sequences at once
    max_num_batched_tokens: int = 2048  # token budget of one step (decodes + prefill chunks)
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    block_size: int = 16  # tokens per KV-cache block

    def __post_init__(self):
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size"):
            _check_positive_int(name, getattr(self, name))
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two (e.g. 16, 32, 64), got {self.block_size}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Otherwise a full batch of decodes could not all run in one step.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}); raise max_num_batched_tokens or lower max_num_seqs")
        for name in ("enable_chunked_prefill", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
