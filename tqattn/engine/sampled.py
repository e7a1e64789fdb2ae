"""A step's sampled tokens while the device may still be computing them.

With async scheduling the engine launches step N+1 before it reads step N's tokens: each
sequence that sampled in step N carries ``PLACEHOLDER`` as its last token until then, step N+1
takes those tokens straight from the device tensor (:meth:`SampledTokens.feed`), and the values
reach the host through a pinned buffer (:meth:`SampledTokens.host`).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

PLACEHOLDER = -1  # a token id no vocabulary has (stop_token_ids are >= 0)


class SampledTokens:
    """Token ids of the sampling sequences of one step, in ``seq_ids`` order."""

    def __init__(self, seq_ids: list[Hashable], tokens: torch.Tensor | None,
                 started: torch.cuda.Event | None = None):
        self.seq_ids = seq_ids
        self.device = tokens
        self.row_of = {sid: i for i, sid in enumerate(seq_ids)}
        # timing events around the step's device work (LLMEngine.record_steps on CUDA)
        self.started, self.ended = started, None
        self._event = None
        self._host = None
        if started is not None:
            self.ended = torch.cuda.Event(enable_timing=True)
            self.ended.record()
        if tokens is None:
            return
        if tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tokens

    def host(self) -> list[int]:
        """The values; waits for the device to have computed and copied them."""
        if self.ended is not None:
            self.ended.synchronize()
        if self._host is None:
            return []
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()

    def feed_index(self, scheduled) -> tuple[list[int], list[int]] | None:
        """Where this step's tokens go in the next step's flattened input_ids (the placeholders
        its scheduled chunks end with; a placeholder is only ever a sequence's last token):
        (token index of each placeholder, row of its token here), or None when there is none.
        :func:`apply_feed` writes them on the device."""
        dst, src, t = [], [], 0
        for s in scheduled:
            t += s.num_scheduled_tokens
            if s.seq.token_ids[s.num_computed_tokens + s.num_scheduled_tokens - 1] == PLACEHOLDER:
                row = self.row_of.get(s.seq.seq_id)
                if row is None:
                    raise RuntimeError(f"seq {s.seq.seq_id!r} is scheduled with a token no step "
                                       f"in flight sampled")
                dst.append(t - 1)
                src.append(row)
        return (dst, src) if dst else None


def apply_feed(input_ids: torch.Tensor, index: tuple[list[int], list[int]] | None,
               tokens: torch.Tensor | None) -> None:
    """input_ids[dst] = tokens[src] for a feed_index; on the device, without a host sync."""
    if index is None:
        return
    index = torch.tensor(index, dtype=torch.int64)
    if input_ids.is_cuda:
        index = index.pin_memory().to(input_ids.device, non_blocking=True)
    input_ids.index_copy_(0, index[0], tokens.index_select(0, index[1]))
