"""A request's output as it grows: the new tokens and text after each engine step.

What is streamed is always a prefix of the final text, so the pieces concatenate to exactly what
the non-streamed request returns. Two kinds of text are held back while the request runs: a
trailing U+FFFD (a multi-byte character whose remaining bytes are in tokens not sampled yet), and,
when the request has stop strings, the last ``max(len(stop)) - 1`` characters (they may turn out
to be the start of a stop string, which the final text cuts off).

Text comes either with the tokens (:meth:`IncrementalOutput.update`, the whole decoded text so
far) or is decoded here from the new tokens alone (:meth:`IncrementalOutput.add_tokens`):
a fast tokenizer decodes each token once through the tokenizers library's ``DecodeStream``
instead of the whole output every step, which would cost O(output length) per token.
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


def merge(pieces: list[StreamOutput]) -> StreamOutput:
    """Consecutive pieces of one request as one (what a reader that fell behind sends at once)."""
    if len(pieces) == 1:
        return pieces[0]
    last = pieces[-1]
    return StreamOutput(last.request_id, "".join(p.text for p in pieces),
                        [t for p in pieces for t in p.token_ids], last.finished, last.finish_reason,
                        last.output)


class Detokenizer:
    """The text of a growing list of token ids, as ``tokenizer.decode(ids, skip_special_tokens)``
    gives it, extended by each call of :meth:`add` with the new ids.

    A fast tokenizer whose decode is the backend's alone (no clean-up of tokenization spaces)
    decodes through ``tokenizers.decoders.DecodeStream``; any other decodes all ids again.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.text = ""
        self._ids: list[int] = []
        self._stream = self._backend = None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            try:
                from tokenizers.decoders import DecodeStream
            except ImportError:  # tokenizers < 0.21
                return
            self._stream, self._backend = DecodeStream(skip_special_tokens=skip_special_tokens), backend

    def add(self, token_ids: list[int]) -> str:
        """The whole text after appending token_ids; a character whose bytes are not all in yet
        is left out (the incremental decoder) or shows as U+FFFD (the full decode)."""
        if self.tokenizer is None:
            return ""
        if self._stream is None:
            self._ids.extend(token_ids)
            self.text = self.tokenizer.decode(self._ids, skip_special_tokens=self.skip_special_tokens)
            return self.text
        step, backend = self._stream.step, self._backend
        new = [s for t in token_ids if (s := step(backend, t)) is not None]
        if new:
            self.text += "".join(new)
        return self.text


class IncrementalOutput:
    """Turns a running request's (output token ids, decoded text) into StreamOutputs."""

    def __init__(self, request_id: Hashable, stop: list[str] | None = None, tokenizer=None,
                 skip_special_tokens: bool = True):
        self.request_id = request_id
        self.holdback = max((len(s) for s in stop or ()), default=1) - 1
        self.num_tokens = 0
        self.text = ""
        self._detokenizer = Detokenizer(tokenizer, skip_special_tokens)

    def update(self, token_ids: list[int], text: str) -> StreamOutput | None:
        """The new part of a running request given all its tokens and their decoded text so far,
        or None if nothing can be sent yet."""
        return self._piece(token_ids[self.num_tokens:], text)

    def add_tokens(self, new_token_ids: list[int]) -> StreamOutput | None:
        """The new part of a running request given only the tokens since the last call (decoded
        here with the tokenizer given at construction), or None if nothing can be sent yet."""
        if not new_token_ids:
            return None
        return self._piece(new_token_ids, self._detokenizer.add(new_token_ids))

    def _piece(self, new_tokens: list[int], text: str) -> StreamOutput | None:
        stable = text.rstrip("\ufffd")
        if self.holdback:
            stable = stable[:max(len(stable) - self.holdback, 0)]
        new_text = stable[len(self.text):] if stable.startswith(self.text) else ""
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
