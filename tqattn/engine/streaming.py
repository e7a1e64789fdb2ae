"""A request's output as it grows: the new tokens and text after each engine step.

What is streamed is always a prefix of the final text, so the pieces concatenate to exactly what
the non-streamed request returns. Two kinds of text are held back while the request runs: a
trailing U+FFFD (a multi-byte character whose remaining bytes are in tokens not sampled yet), and,
when the request has stop strings, the last ``max(len(stop)) - 1`` characters (they may turn out
to be the start of a stop string, which the final text cuts off).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from dataclasses import dataclass, field

from .outputs import RequestOutput

logger = logging.getLogger(__name__)


@dataclass
class StreamOutput:
    """The new part of one request's output since the previous StreamOutput of that request."""
    request_id: Hashable
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "abort" on the last piece
    output: RequestOutput | None = field(default=None, repr=False)  # the whole output, on the last piece


class IncrementalOutput:
    """Turns a running request's (output token ids, decoded text) into StreamOutputs."""

    def __init__(self, request_id: Hashable, stop: list[str] | None = None):
        self.request_id = request_id
        self.holdback = max((len(s) for s in stop or ()), default=1) - 1
        self.num_tokens = 0
        self.text = ""

    def update(self, token_ids: list[int], text: str) -> StreamOutput | None:
        """The new part of a running request, or None if nothing can be sent yet."""
        stable = text.rstrip("\ufffd")
        if self.holdback:
            stable = stable[:max(len(stable) - self.holdback, 0)]
        new_text = stable[len(self.text):] if stable.startswith(self.text) else ""
        new_tokens = token_ids[self.num_tokens:]
        if not new_text and not new_tokens:
            return None
        self.text += new_text
        self.num_tokens += len(new_tokens)
        return StreamOutput(self.request_id, new_text, list(new_tokens))

    def finish(self, output: RequestOutput) -> StreamOutput:
        """The last piece: the rest of the final text and tokens, and the finish reason."""
        c = output.outputs[0]
        if not c.text.startswith(self.text):
            # Decoding was not prefix-stable; what was sent cannot be taken back, so say so.
            logger.warning("request %r: streamed text %r is not a prefix of the final text %r",
                           self.request_id, self.text, c.text)
        piece = StreamOutput(self.request_id, c.text[len(self.text):], list(c.token_ids[self.num_tokens:]),
                             finished=True, finish_reason=c.finish_reason, output=output)
        self.text, self.num_tokens = c.text, len(c.token_ids)
        return piece
