"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

Each step fills a token budget in this order: one token for every running sequence that is
generating (decodes), the next chunk of running sequences still prefilling, then new requests
from the waiting queue (first come, first served).

Admission reserves room for growth, so that little prefill is computed twice. A waiting request
is admitted only if the free blocks cover, besides its own prompt, every block the running set
and it can still take: the rest of their prompts and their output up to max_tokens. A request
that can only end by length (ignore_eos, no stop tokens or strings) will take all of it; for the
others max_tokens is a bound, not a certainty (they may stop early), so their part of the
reserve is capped at half the cache — reserving long max_tokens in full would leave most of the
cache idle.
(A fixed watermark of free blocks, as in vLLM's v0 block manager, does not scale with the output
the running set will produce: a cache-bound batch then admits prompts that are preempted later,
each losing its whole prefill.) When a running sequence still needs a block and none is free, the
running sequence with the least computed work is preempted (latest arrival among equals): its
blocks are freed and it goes to the front of the waiting queue, to recompute prompt + output when
readmitted. ``stats`` counts preemptions and the tokens whose K/V were computed again.

The sampling params object is opaque; these attributes are read when present:
max_tokens (None: up to max_model_len), ignore_eos, stop_token_ids, min_tokens.
Stop strings belong to the detokenizing layer, which calls `finish`.
"""

from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

from .block_manager import BlockManager, _cdiv
from .config import SchedulerConfig
from .sequence import Sequence, SequenceStatus


class RequestError(ValueError):
    """A request the engine refuses. ``reason``: the message without the engine's id for the
    request (front ends name it their own way); ``prompt_tokens``: set when the prompt, or the
    prompt with max_tokens, does not fit max_model_len."""

    def __init__(self, request_id: Hashable, reason: str, prompt_tokens: int | None = None):
        super().__init__(f"request {request_id!r}: {reason}")
        self.request_id, self.reason, self.prompt_tokens = request_id, reason, prompt_tokens

    def __reduce__(self):  # it crosses the server's pipe whole
        return RequestError, (self.request_id, self.reason, self.prompt_tokens)


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_scheduled_tokens: int
    is_decode: bool  # one token of a generating sequence
    num_computed_tokens: int  # position of the first scheduled token

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of seq's tokens, i.e. the step samples a token for it."""
        return self.num_computed_tokens + self.num_scheduled_tokens == self.seq.num_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.num_computed_tokens:self.num_computed_tokens + self.num_scheduled_tokens]


@dataclass
class SchedulerStats:
    """Counters since the scheduler was created (or ``stats`` was replaced by a fresh one)."""
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0  # tokens whose K/V had been computed before and were computed again
    num_computed_tokens: int = 0  # all tokens run through the model, recomputed ones included
    max_num_running: int = 0  # peak concurrent sequences

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # decodes first, then prefills
    preempted: list[Sequence] = field(default_factory=list)  # lost their KV this step

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)

    @property
    def num_decodes(self) -> int:
        return sum(s.is_decode for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 eos_token_ids: int | Iterable[int] = ()):
        if block_manager.block_size != config.block_size:
            raise ValueError(f"block manager block_size ({block_manager.block_size}) != config block_size ({config.block_size})")
        if block_manager.enable_prefix_caching != config.enable_prefix_caching:
            raise ValueError("block manager and config disagree on enable_prefix_caching")
        self.config = config
        self.block_manager = block_manager
        self.eos_token_ids = frozenset([eos_token_ids] if isinstance(eos_token_ids, int) else eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.seqs: dict[Hashable, Sequence] = {}  # unfinished ones
        self.stats = SchedulerStats()

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    def add(self, seq: Sequence) -> None:
        """Queue a new request; raise ValueError if it could never run under this config."""
        cfg, bm = self.config, self.block_manager
        if seq.seq_id in self.seqs:
            raise ValueError(f"a request with id {seq.seq_id!r} is already queued or running")
        n_prompt, max_len = seq.num_prompt_tokens, cfg.max_model_len
        max_tokens = getattr(seq.sampling_params, "max_tokens", None)
        if max_tokens is None:
            if n_prompt >= max_len:
                raise RequestError(seq.seq_id, f"prompt has {n_prompt} tokens, max_model_len is {max_len}, "
                                   f"leaving no room to generate; shorten the prompt or raise max_model_len",
                                   n_prompt)
            max_tokens = max_len - n_prompt
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise RequestError(seq.seq_id, f"max_tokens must be a positive integer, got {max_tokens!r}")
        if n_prompt + max_tokens > max_len:
            raise RequestError(seq.seq_id, f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) = "
                               f"{n_prompt + max_tokens} exceeds max_model_len={max_len}; shorten the prompt, "
                               f"lower max_tokens or raise max_model_len", n_prompt)
        # The last sampled token is never fed back, so at most this many tokens need K/V.
        max_kv_tokens = n_prompt + max_tokens - 1
        if not cfg.enable_chunked_prefill and max_kv_tokens > cfg.max_num_batched_tokens:
            # A preempted request recomputes prompt + output, in one step when chunking is off.
            raise RequestError(seq.seq_id, f"with chunked prefill disabled, prompt ({n_prompt} tokens) + "
                             f"max_tokens ({max_tokens}) - 1 = {max_kv_tokens} must fit max_num_batched_tokens="
                             f"{cfg.max_num_batched_tokens}; enable chunked prefill, raise max_num_batched_tokens "
                             f"or lower max_tokens")
        need = _cdiv(max_kv_tokens, cfg.block_size)
        for g, n_blocks in enumerate(bm.num_blocks):
            if need > n_blocks:
                raise RequestError(seq.seq_id, f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) needs "
                                 f"{need} KV blocks of {cfg.block_size} tokens, but KV-cache group {g} has only "
                                 f"{n_blocks}; give the KV cache more memory or lower max_tokens/max_model_len")
        seq.max_tokens = max_tokens
        seq.status = SequenceStatus.WAITING
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    @staticmethod
    def _is_decode(seq: Sequence) -> bool:
        return seq.num_output_tokens > 0 and seq.num_uncomputed_tokens == 1

    def schedule(self) -> SchedulerOutput:
        cfg, bm = self.config, self.block_manager
        out = SchedulerOutput()
        budget = cfg.max_num_batched_tokens

        # Running sequences: decodes, then continuing prefills.
        decodes, prefills = [], []
        for s in self.running:
            (decodes if self._is_decode(s) else prefills).append(s)
        for is_decode, seqs in ((True, decodes), (False, prefills)):
            for seq in seqs:
                if budget == 0:
                    break
                if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                    continue
                n = 1 if is_decode else min(seq.num_uncomputed_tokens, budget)
                while not bm.allocate_slots(seq, n):
                    # The cheapest to redo; among equals the latest arrival (it has waited least).
                    victim = min(self.running, key=lambda s: (s.num_computed_tokens, -s.arrival))
                    budget += self._preempt(victim, out)
                    if victim is seq:
                        break
                else:
                    out.scheduled.append(ScheduledSeq(seq, n, is_decode, seq.num_computed_tokens))
                    budget -= n

        # Waiting sequences, FCFS; none right after a preemption, which would only thrash.
        reserve = None  # _reserve_of summed over the running set, at the first admission check
        while self.waiting and budget and len(self.running) < cfg.max_num_seqs and not out.preempted:
            seq = self.waiting[0]
            cached = bm.get_computed_blocks(seq)
            remaining = seq.num_tokens - cached
            n = min(remaining, budget)
            if n < remaining and not cfg.enable_chunked_prefill:
                break
            own = None
            if self.running:
                if reserve is None:
                    reserve = [sum(x) for x in zip((0, 0, 0), *map(self._reserve_of, self.running))]
                own = self._reserve_of(seq, cached + n)
                if not self._fits_with_reserve(seq, n, cached, reserve, own):
                    break
            if not bm.allocate_slots(seq, n, cached):
                if not self.running:  # add() rules this out; never spin on an empty batch
                    raise RuntimeError(f"seq {seq.seq_id!r} cannot get {_cdiv(seq.num_tokens, cfg.block_size)} "
                                       f"blocks from an idle KV cache of {bm.num_blocks} blocks")
                break
            self.waiting.popleft()
            seq.num_computed_tokens = seq.num_cached_tokens = cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n, False, cached))
            budget -= n
            if reserve is not None and own is not None:
                reserve = [a + b for a, b in zip(reserve, own)]
        self.stats.max_num_running = max(self.stats.max_num_running, len(self.running))
        return out

    def _reserve_of(self, seq: Sequence, num_allocated_tokens: int | None = None) -> tuple[int, int, int]:
        """(rest, sure growth, possible growth): blocks seq can still take for tokens it has (prompt,
        output to recompute), and for output still to come up to max_tokens (the last sampled
        token is never fed back) — sure when only the length can end it. num_allocated_tokens:
        what its tables will cover (default: what they do)."""
        bs = self.config.block_size
        held = len(seq.block_table) if num_allocated_tokens is None else _cdiv(num_allocated_tokens, bs)
        have = _cdiv(seq.num_tokens, bs)
        growth = max(0, _cdiv(seq.num_prompt_tokens + seq.max_tokens - 1, bs) - max(held, have))
        sp = seq.sampling_params
        sure = (getattr(sp, "ignore_eos", False) and not getattr(sp, "stop_token_ids", None)
                and not getattr(sp, "stop", None))
        return max(0, have - held), growth if sure else 0, 0 if sure else growth

    def _fits_with_reserve(self, seq: Sequence, num_new_tokens: int, num_cached_tokens: int,
                           running: list[int], own: tuple[int, int, int]) -> bool:
        """Whether admitting seq now leaves free the blocks the running set and seq can still take."""
        bm = self.block_manager
        reserve = (running[0] + own[0] + running[1] + own[1]
                   + min(running[2] + own[2], min(bm.num_blocks) // 2))
        taken = bm.num_blocks_to_take(seq, num_new_tokens, num_cached_tokens)
        return all(t + reserve <= bm.num_free_blocks(g) for g, t in enumerate(taken))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> int:
        """Send a running seq back to the front of the waiting queue; return the budget it held."""
        self.running.remove(seq)
        refund = 0
        for i, s in enumerate(out.scheduled):
            if s.seq is seq:
                refund = out.scheduled.pop(i).num_scheduled_tokens
                break
        self.block_manager.free(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        return refund

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           sampled_token_ids: dict[Hashable, int | None]) -> list[Sequence]:
        """Advance the scheduled sequences after the model ran; return those that finished."""
        finished = []
        computed = recomputed = 0
        prefix_caching = self.block_manager.enable_prefix_caching
        for s in scheduler_output.scheduled:
            seq = s.seq
            if seq.status is not SequenceStatus.RUNNING:  # finished/aborted since schedule()
                continue
            start = s.num_computed_tokens
            if seq.num_computed_tokens != start:
                raise RuntimeError(f"seq {seq.seq_id!r} was already updated for this scheduler output")
            end = start + s.num_scheduled_tokens
            computed += s.num_scheduled_tokens
            high = seq.max_num_computed_tokens
            if high > start:  # K/V below the high-water mark were computed before
                recomputed += min(end, high) - start
            if end > high:
                seq.max_num_computed_tokens = end
            seq.num_computed_tokens = end
            if prefix_caching:
                self.block_manager.cache_full_blocks(seq)
            if end < seq.num_tokens:  # mid-prompt chunk: nothing sampled
                continue
            token = sampled_token_ids.get(seq.seq_id)
            if token is None:
                raise ValueError(f"no sampled token for seq {seq.seq_id!r}, whose chunk reached its last token")
            seq.append_token(token)
            status = self._stop_status(seq, token)
            if status is not None:
                self._finish(seq, status)
                finished.append(seq)
        self.stats.num_computed_tokens += computed
        self.stats.num_recomputed_tokens += recomputed
        return finished

    def stop_on_token(self, seq: Sequence, token: int) -> bool:
        """Apply a sampled token's value to a sequence updated with a placeholder for it (its
        last token; the length limit was applied then). True if this finishes the sequence; a
        stop token of a sequence already finished by length turns that into a stop."""
        sp = seq.sampling_params
        if seq.num_output_tokens < (getattr(sp, "min_tokens", 0) or 0):
            return False
        if not ((token in self.eos_token_ids and not getattr(sp, "ignore_eos", False))
                or token in (getattr(sp, "stop_token_ids", None) or ())):
            return False
        seq.stop_reason = token
        if seq.status is SequenceStatus.FINISHED_LENGTH:
            seq.status = SequenceStatus.FINISHED_STOPPED
            return False
        if seq.status.is_finished:  # aborted, or stopped by a stop string
            return False
        self._finish(seq, SequenceStatus.FINISHED_STOPPED)
        return True

    def _stop_status(self, seq: Sequence, token: int) -> SequenceStatus | None:
        sp = seq.sampling_params
        if seq.num_output_tokens >= (getattr(sp, "min_tokens", 0) or 0):
            if ((token in self.eos_token_ids and not getattr(sp, "ignore_eos", False))
                    or token in (getattr(sp, "stop_token_ids", None) or ())):
                seq.stop_reason = token
                return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= seq.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = status
        del self.seqs[seq.seq_id]

    def finish(self, seq_id: Hashable, status: SequenceStatus = SequenceStatus.FINISHED_STOPPED) -> bool:
        """Finish a request from outside (stop string, abort); False if it is not live."""
        if not status.is_finished:
            raise ValueError(f"finish needs a FINISHED_* status, got {status.name}")
        seq = self.seqs.get(seq_id)
        if seq is None:
            return False
        self._finish(seq, status)
        return True

    def abort(self, seq_id: Hashable) -> bool:
        return self.finish(seq_id, SequenceStatus.FINISHED_ABORTED)
