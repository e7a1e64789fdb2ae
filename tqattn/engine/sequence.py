"""A request as the scheduler and block manager see it."""

import enum
import itertools
from collections.abc import Hashable, Iterable
from typing import Any


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # back in the waiting queue; its KV is recomputed on readmission
    FINISHED_STOPPED = enum.auto()  # eos, a stop token, or a stop string (via Scheduler.finish)
    FINISHED_LENGTH = enum.auto()  # max_tokens / max_model_len
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED")


_arrival_counter = itertools.count()


class Sequence:
    """Prompt + generated tokens, and how far the KV cache has got through them.

    `token_ids` is prompt followed by output. `num_computed_tokens` counts the leading tokens
    whose K/V are in the cache; the tokens after it are what the next step must run.
    `block_tables[g]` lists the block ids of KV-cache group g; all groups hold the same number of
    blocks (they are allocated in lockstep). The block tables, `block_hashes` and
    `num_hashed_blocks` are managed by the BlockManager.
    """

    def __init__(self, prompt_token_ids: Iterable[int], sampling_params: Any = None, *,
                 seq_id: Hashable = None, extra_key: Hashable = None):
        self.token_ids: list[int] = list(prompt_token_ids)
        if not self.token_ids:
            raise ValueError("prompt_token_ids is empty; a request needs at least one prompt token")
        self.num_prompt_tokens = len(self.token_ids)
        self.arrival = next(_arrival_counter)
        self.seq_id = self.arrival if seq_id is None else seq_id
        self.sampling_params = sampling_params  # opaque; the scheduler reads a few attributes
        self.extra_key = extra_key  # mixed into prefix-cache hashes (LoRA id, cache salt); needs a stable repr
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hit at the last admission
        self.max_tokens: int | None = None  # resolved by Scheduler.add
        self.stop_reason: int | None = None  # the stop/eos token that finished it
        self.num_preemptions = 0
        self.max_num_computed_tokens = 0  # high-water mark: tokens below it had K/V computed once
        self.block_tables: list[list[int]] = []
        self.block_hashes: list[bytes] = []  # hashes of the full blocks of token_ids, grown lazily
        self.num_hashed_blocks = 0  # leading blocks already registered in the prefix cache

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def block_table(self) -> list[int]:
        """Block table of group 0 (the only one in a single-group cache)."""
        return self.block_tables[0] if self.block_tables else []

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id!r}, status={self.status.name}, tokens={self.num_prompt_tokens}"
                f"+{self.num_output_tokens}, computed={self.num_computed_tokens})")
