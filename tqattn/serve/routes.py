"""The FastAPI app: OpenAI's endpoints over an :class:`~tqattn.serve.async_engine.AsyncEngine`.

Every error leaves in OpenAI's error body with a 4xx status (503 with Retry-After when the waiting
queue is full); a 500 means a bug in the server, never bad input. A request whose client
disconnects, or that runs past ``request_timeout``, is aborted and its cache blocks are freed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .async_engine import AsyncEngine, EngineError, EngineStopped, QueueFull, RequestStream
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, chat_chunk, chat_response,
                       completion_chunk, completion_response, error_body, new_id, parse, usage)

logger = logging.getLogger(__name__)


class _EngineStreamingResponse(StreamingResponse):
    """Server-sent events of one request; however the response ends (done, client gone,
    cancelled), the request is aborted if it still runs."""

    def __init__(self, content, stream: RequestStream):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.request_stream = stream

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.request_stream.abort()
            await self.body_iterator.aclose()


_DONE = b"data: [DONE]\n\n"
_MARK = "\x00text\x00"  # where a chunk template's text goes
_encode_str = json.JSONEncoder(ensure_ascii=False).encode


class _Chunks:
    """One stream's server-sent events as bytes. A token's chunk differs from the next only in
    its text, so it is a template, encoded once, with the text put in (the hot path: one chunk
    per request per engine step)."""

    def __init__(self, make, template: dict, first: dict | None = None):
        self.make = make  # (text, finish_reason, final=False, use=None) -> the chunk as a dict
        self._head, self._tail = self.event(template).split(_encode_str(_MARK).encode())
        self._empty = self.event(make("", None))  # a step's tokens whose text is held back
        self.first = None if first is None else self.event(first)

    def text(self, text: str) -> bytes:
        return self._head + _encode_str(text).encode() + self._tail if text else self._empty

    @staticmethod
    def event(obj) -> bytes:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


def build_app(engine: AsyncEngine, model_name: str, request_timeout: float | None = None) -> FastAPI:
    app = FastAPI(title="tqattn", docs_url=None, redoc_url=None, openapi_url=None)
    max_model_len = engine.max_model_len

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        what = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        msg = (f"no route {request.method} {request.url.path}; this server has GET /health, GET "
               f"/metrics, GET /v1/models, POST /v1/completions, POST /v1/chat/completions"
               if e.status_code in (404, 405) else str(e.detail))
        return JSONResponse(error_body(msg, "invalid_request_error", None, what),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception):
        logger.exception("internal error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(f"internal server error: {type(e).__name__}: {e}",
                                       "internal_error", None, None), status_code=500)

    @app.get("/health")
    async def health():
        if not engine.is_alive:
            return JSONResponse(error_body("the engine loop has stopped", "internal_error"), status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "tqattn", "max_model_len": max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        text = engine.metrics.render(model_name, engine.num_running, engine.num_waiting,
                                     engine.kv_cache_usage, engine.compilations)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    def check_model(req) -> None:
        if req.model is not None and req.model != model_name:
            raise APIError(f"the model {req.model!r} does not exist; this server serves {model_name!r}",
                           status=404, param="model", code="model_not_found")

    async def start(prompt, params, req) -> RequestStream:
        try:
            return await engine.add_request(prompt, params)
        except QueueFull as e:
            raise APIError(str(e), status=503, type="service_unavailable", code="queue_full",
                           headers={"Retry-After": str(e.retry_after)}) from None
        except EngineError as e:
            raise APIError(str(e), status=503, type="service_unavailable") from None
        except ValueError as e:
            # the engine's id for the request means nothing to the client
            msg = " ".join(getattr(e, "reason", str(e)).split())
            prompt_field = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
            code = None
            n_prompt = getattr(e, "prompt_tokens", None)
            if n_prompt is not None:  # the prompt alone too long, or too long for max_tokens
                param = prompt_field if n_prompt >= max_model_len else req._max_tokens_field()
                code = "context_length_exceeded"
            elif "token ids" in msg or "prompt is empty" in msg or "tokenizer" in msg:
                param = prompt_field
            else:
                param = None
            raise APIError(msg, param=param, code=code) from None

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse(CompletionRequest, await request.body())
        check_model(req)
        params = req.sampling_params()
        stream = await start(req.engine_prompt(), params, req)
        rid = new_id("cmpl")
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _EngineStreamingResponse(_stream_completion(stream, rid, include_usage), stream)
        out = await _collect(request, stream)
        c = out.outputs[0]
        return completion_response(rid, model_name, c.text, c.finish_reason,
                                   usage(len(out.prompt_token_ids), len(c.token_ids)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse(ChatCompletionRequest, await request.body())
        check_model(req)
        params = req.sampling_params()
        stream = await start(_chat_prompt(req), params, req)
        rid = new_id("chatcmpl")
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _EngineStreamingResponse(_stream_chat(stream, rid, include_usage), stream)
        out = await _collect(request, stream)
        c = out.outputs[0]
        return chat_response(rid, model_name, c.text, c.finish_reason,
                             usage(len(out.prompt_token_ids), len(c.token_ids)))

    def _chat_prompt(req: ChatCompletionRequest) -> dict:
        tok = engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise APIError(f"the model {model_name!r} has no chat template; use /v1/completions",
                           param="messages")
        try:
            text = tok.apply_chat_template(req.conversation(), tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja's TemplateError: e.g. roles that must alternate
            raise APIError(f"the chat template refused these messages: {e}", param="messages") from None
        # the template already holds any BOS / special tokens
        return {"prompt": text, "prompt_token_ids": list(tok.encode(text, add_special_tokens=False))}

    async def _collect(request: Request, stream: RequestStream):
        """The finished RequestOutput; aborts on client disconnect or timeout."""
        async def run():
            last = None
            async for piece in stream:
                last = piece
            return last.output

        task = asyncio.ensure_future(run())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({task, gone}, timeout=request_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                try:
                    return task.result()
                except EngineStopped as e:  # shutting down: retry elsewhere or later
                    raise APIError(str(e), status=503, type="service_unavailable") from None
                except EngineError as e:
                    raise APIError(str(e), status=500, type="internal_error") from None
            task.cancel()
            if gone in done:  # nobody to answer
                return Response(status_code=499)
            raise APIError(f"the request ran past the server's request timeout of {request_timeout} s "
                           f"and was aborted", status=408, type="timeout_error", code="timeout")
        finally:
            gone.cancel()
            stream.abort()

    async def _stream_events(stream: RequestStream, chunks: _Chunks, include_usage: bool):
        """The stream's server-sent events, as bytes: a chunk per piece with text or (while the
        request runs) tokens — clients see every step's progress, even text held back or a
        model without a tokenizer —, the finish chunk, the usage chunk, [DONE]."""
        timer = (None if request_timeout is None else
                 stream.loop.call_later(request_timeout, stream.put, asyncio.TimeoutError()))
        try:
            if chunks.first is not None:
                yield chunks.first
            async for piece in stream:
                if piece.text or (piece.token_ids and not piece.finished):
                    yield chunks.text(piece.text)
                if piece.finished:
                    out = piece.output
                    yield chunks.event(chunks.make("", piece.finish_reason, final=True))
                    if include_usage:
                        yield chunks.event(chunks.make(None, None, use=usage(
                            len(out.prompt_token_ids), len(out.outputs[0].token_ids))))
        except (asyncio.TimeoutError, EngineError) as e:
            stream.abort()
            if isinstance(e, EngineError):
                what = "service_unavailable" if isinstance(e, EngineStopped) else "internal_error"
                yield chunks.event(error_body(str(e), what))
            else:
                yield chunks.event(error_body(f"the request ran past the server's request timeout of "
                                              f"{request_timeout} s and was aborted", "timeout_error", None,
                                              "timeout"))
        finally:
            if timer is not None:
                timer.cancel()
        yield _DONE

    def _stream_completion(stream, rid, include_usage):
        created = int(time.time())

        def make(text, finish_reason, final=False, use=None):
            return completion_chunk(rid, model_name, created, text, finish_reason, use)
        return _stream_events(stream, _Chunks(make, make(_MARK, None)), include_usage)

    def _stream_chat(stream, rid, include_usage):
        created = int(time.time())

        def make(text, finish_reason, final=False, use=None):
            if text is None:
                return chat_chunk(rid, model_name, created, None, None, use)
            delta = {} if final else {"content": text} if text or finish_reason else {}
            return chat_chunk(rid, model_name, created, delta, finish_reason)

        # the first chunk carries the assistant role (OpenAI's shape)
        first = chat_chunk(rid, model_name, created, {"role": "assistant", "content": ""}, None)
        return _stream_events(stream, _Chunks(make, make(_MARK, None), first), include_usage)

    return app


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is read, so the next message is a disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
