"""OpenAI's request and response shapes for /v1/completions and /v1/chat/completions.

Requests are validated strictly (a string is not an integer) and every field is either used or
refused: a field this server does not implement gets a 400 that names it, unless it carries its
neutral value (``n=1``, ``presence_penalty=0``, ...), which changes nothing. Errors leave as
OpenAI's body ``{"error": {"message", "type", "param", "code"}}`` (:class:`APIError`).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..engine.sampling import SamplingParams


class APIError(Exception):
    """An error the client caused (4xx) or the server's state (503), in OpenAI's body."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# Fields of OpenAI's API that this server does not implement, and the values that mean "off".
_NEUTRAL: dict[str, tuple] = {
    "n": (1,), "best_of": (1,), "echo": (False,), "suffix": ("",), "logprobs": (False,),
    "top_logprobs": (0,), "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0), "logit_bias": ({},), "tools": ([],), "tool_choice": ("none",),
    "parallel_tool_calls": (True, False), "response_format": ({"type": "text"},), "store": (False,),
    "service_tier": ("auto", "default"), "modalities": (["text"],), "metadata": ({},),
}
_INFORMATIONAL = ("user",)  # accepted and not used: they do not change the output


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    temperature: float | None = None  # None: 1.0, OpenAI's default
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extension
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None

    def check(self) -> None:
        """Refuse what this server does not implement (400 naming the field)."""
        for name, value in (self.model_extra or {}).items():
            if value is None or name in _INFORMATIONAL:
                continue
            if name in _NEUTRAL:
                if any(type(value) is type(v) and value == v for v in _NEUTRAL[name]):
                    continue
                raise APIError(f"{name}={_short(value)} is not supported by this server (only "
                               f"{' or '.join(_short(v) for v in _NEUTRAL[name])}); leave it out",
                               param=name, code="unsupported_parameter")
            raise APIError(f"unknown parameter {name!r}", param=name, code="unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed with stream=true", param="stream_options")

    def max_new_tokens(self) -> int | None:
        raise NotImplementedError

    def sampling_params(self) -> SamplingParams:
        """SamplingParams of the request; a bad value is a 400 naming the field."""
        n = self.max_new_tokens()
        if n is not None and n < 1:
            field = self._max_tokens_field()
            raise APIError(f"{field} must be an integer >= 1, got {n}", param=field)
        kw = dict(temperature=1.0 if self.temperature is None else self.temperature,
                  top_p=1.0 if self.top_p is None else self.top_p,
                  top_k=0 if self.top_k is None else self.top_k, max_tokens=self.max_new_tokens(),
                  min_tokens=self.min_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
                  ignore_eos=self.ignore_eos, seed=self.seed, skip_special_tokens=self.skip_special_tokens)
        try:
            return SamplingParams(**kw)
        except ValueError as e:
            msg = str(e)
            param = next((k for k in kw if msg.startswith(k + " ")), None)
            if param == "max_tokens":
                param = self._max_tokens_field()
                msg = msg.replace("max_tokens", param, 1)
            raise APIError(msg, param=param) from None

    def _max_tokens_field(self) -> str:
        return "max_tokens"


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions

    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    def engine_prompt(self) -> str | dict:
        """The prompt as the engine takes it: text, or {"prompt_token_ids": [...]}."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(f"prompt is a batch of {len(p)} prompts; this server takes one prompt "
                               f"per request (n=1): send them as separate requests", param="prompt")
            p = p[0]
        if not p:
            raise APIError("prompt is empty; send some text or token ids", param="prompt")
        return p if isinstance(p, str) else {"prompt_token_ids": list(p)}


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to max_model_len
    max_completion_tokens: int | None = None

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def conversation(self) -> list[dict]:
        # "developer" is OpenAI's newer name for "system"
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]


def parse(model: type[BaseModel], raw: bytes) -> Any:
    """Parse and validate a JSON body; every failure is an APIError (400) naming what is wrong."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(f"the body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    bad = _lone_surrogate(body)
    if bad is not None:
        loc, s = bad
        raise APIError(f"{loc}: {_short(s)} holds a lone UTF-16 surrogate, which is not Unicode text",
                       param=loc)
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        loc = ".".join(str(x) for x in err["loc"] if not _is_type_tag(x)) or None
        value = err.get("input")
        more = f" ({len(e.errors()) - 1} more errors)" if len(e.errors()) > 1 else ""
        raise APIError(f"{loc or 'body'}: {err['msg']}, got {_short(value)}{more}",
                       param=loc) from None
    req.check()
    return req


def _lone_surrogate(x, loc: str = "") -> tuple[str, str] | None:
    """(where, the string) of the first string in x that UTF-8 cannot encode (JSON's "\\ud800"
    escapes decode to such strings; the tokenizer would fail on them), or None."""
    if isinstance(x, str):
        try:
            x.encode()
        except UnicodeEncodeError:
            return loc or "body", x
    elif isinstance(x, (dict, list)):
        items = x.items() if isinstance(x, dict) else enumerate(x)
        for k, v in items:
            bad = _lone_surrogate(v, f"{loc}.{k}" if loc else str(k))
            if bad is not None:
                return bad
    return None


def _is_type_tag(x) -> bool:
    # pydantic's union branch names in error locations: "str", "list[int]", "function-after[...]"
    return isinstance(x, str) and ("[" in x or x in ("str", "int", "float", "bool", "list", "dict"))


def _short(value, limit: int = 80) -> str:
    s = json.dumps(value) if not isinstance(value, str) else repr(value)
    return s if len(s) <= limit else s[:limit] + "..."


# ---- responses ------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_response(rid: str, model: str, text: str, finish_reason: str | None, use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            "usage": use}


def completion_chunk(rid: str, model: str, created: int, text: str | None,
                     finish_reason: str | None, use: dict | None = None) -> dict:
    choices = [] if text is None else [{"index": 0, "text": text, "logprobs": None,
                                        "finish_reason": finish_reason}]
    out = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if use is not None:
        out["usage"] = use
    return out


def chat_response(rid: str, model: str, text: str, finish_reason: str | None, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish_reason}],
            "usage": use}


def chat_chunk(rid: str, model: str, created: int, delta: dict | None,
               finish_reason: str | None, use: dict | None = None) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": finish_reason}]
    out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
           "choices": choices}
    if use is not None:
        out["usage"] = use
    return out
