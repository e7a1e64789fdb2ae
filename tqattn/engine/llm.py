"""The offline API, like vLLM's: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator
from collections.abc import Sequence as Seq

import torch

from .llm_engine import EngineArgs, LLMEngine, format_plan
from .outputs import RequestOutput
from .sampling import SamplingParams
from .scheduler import RequestError
from .streaming import IncrementalOutput, StreamOutput

Prompt = str | dict


def _short(x, limit: int = 60) -> str:
    s = repr(x)
    return s if len(s) <= limit else s[:limit] + "..."


class LLM:
    """Load a model with a per-layer KV-cache plan and generate from batches of prompts.

    Keyword arguments are :class:`~tqattn.engine.llm_engine.EngineArgs` (vLLM's names):
    ``model`` (a HF directory, a .gguf file, a shipped config name with
    ``load_format="dummy"``, or "default" for the embedded SmolLM2-135M-Instruct),
    ``dtype``, ``kv_cache_dtype``, ``kv_cache_dtype_skip_layers``, ``kv_cache_boundary_layers``,
    ``max_model_len``, ``max_num_seqs``, ``max_num_batched_tokens``, ``block_size``,
    ``enable_prefix_caching``, ``enable_chunked_prefill``, ``kv_cache_memory_bytes`` /
    ``gpu_memory_utilization`` / ``num_gpu_blocks_override``, ``load_format``, ``seed``,
    ``device``, ``enforce_eager`` (no compiled model, no CUDA graphs), ``compile_model``
    (None: compile on CUDA unless enforce_eager; False: eager model, CUDA graphs still on),
    ``tensor_parallel_size`` (split the model over N processes, one GPU each: the engine starts
    the other ranks itself and stops them with :meth:`shutdown`, on deletion or at exit).
    Start-up compiles and warms up everything a run can reach:
    ``llm.llm_engine.startup_times`` has the parts' seconds, and
    ``llm.llm_engine.compilation_counts()`` what compiled after it.
    """

    def __init__(self, model: str = "default", **kwargs):
        self.llm_engine = LLMEngine(EngineArgs(model=model, **kwargs))
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel worker processes now (deleting the LLM or exiting
        does too); no effect without tensor parallelism."""
        self.llm_engine.shutdown()

    @property
    def tokenizer(self):
        return self.llm_engine.tokenizer

    @property
    def kv_cache_plan(self) -> dict:
        return self.llm_engine.plan

    def describe_kv_cache(self) -> str:
        return format_plan(self.llm_engine.plan)

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. A prompt is a string or {"prompt_token_ids": [...]}.

        Text goes to the model as it is. An instruct model wants its chat template (:meth:`chat`):
        given a bare question it may answer with its end-of-turn token at once (an empty reply).
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        what = "prompts: a string, {'prompt_token_ids': [...]} or a list of them, got "
        if not isinstance(prompts, Iterable):
            raise ValueError(what + _short(prompts))
        prompts = list(prompts)
        if prompts and all(isinstance(p, int) for p in prompts):
            raise ValueError(what + _short(prompts) + "; a list of token ids is one prompt: pass "
                             "{'prompt_token_ids': [...]}")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        sampling_params = list(sampling_params)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts; "
                             f"pass one, or one per prompt")
        engine = self.llm_engine
        engine.flush()
        if engine.has_unfinished_requests():  # their outputs would be read here and lost
            raise RuntimeError("generate() runs on an idle engine; finish the stream in progress or "
                               "abort the running requests first")
        ids = [str(next(self._ids)) for _ in prompts]
        i = 0
        try:
            for i, (rid, prompt, sp) in enumerate(zip(ids, prompts, sampling_params)):
                engine.add_request(rid, prompt, sp)
        except Exception as e:
            for rid in ids:
                engine.abort_request(rid)
            if isinstance(e, ValueError):  # say which prompt, not the engine's id for it
                where = f"prompts[{i}]: " if len(prompts) > 1 else ""
                raise ValueError(where + (e.reason if isinstance(e, RequestError) else str(e))) from None
            raise
        return self._run(ids, use_tqdm)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[StreamOutput]:
        """Generate for one prompt and yield its new text and tokens after each step.

        The pieces' ``text`` concatenates to what :meth:`generate` returns for the same prompt and
        settings; the last piece has ``finished=True``, the finish reason and the whole
        RequestOutput. Stopping the iteration early (``break``, ``close()``) aborts the request
        and frees its cache blocks. The engine runs only this request while it streams.
        """
        if not isinstance(prompt, (str, dict)):
            raise ValueError(f"stream() takes one prompt (a string or {{'prompt_token_ids': [...]}}), "
                             f"got {type(prompt).__name__}; use generate() for batches")
        engine = self.llm_engine
        engine.flush()
        if engine.has_unfinished_requests():
            raise RuntimeError("stream() runs on an idle engine; finish or abort the running requests first")
        params = sampling_params or SamplingParams()
        rid = str(next(self._ids))
        engine.add_request(rid, prompt, params)
        inc = IncrementalOutput(rid, params.stop)
        try:
            while True:
                for out in engine.step():
                    if out.request_id == rid:
                        yield inc.finish(out)
                        return
                progress = engine.request_progress(rid)
                if progress is None and rid not in engine.requests:
                    raise RuntimeError("the stream's request was finished or aborted outside the "
                                       "stream (by generate() or abort_request between its pieces)")
                piece = inc.update(*progress) if progress is not None else None
                if piece is not None:
                    yield piece
        finally:
            engine.abort_request(rid)

    def stream_chat(self, messages: list[dict], sampling_params: SamplingParams | None = None,
                    add_generation_prompt: bool = True,
                    chat_template_kwargs: dict | None = None) -> Iterator[StreamOutput]:
        """:meth:`stream` of the reply to one conversation, formatted with the chat template."""
        text = self.apply_chat_template(messages, add_generation_prompt, chat_template_kwargs)
        return self.stream({"prompt": text, "prompt_token_ids": self._encode_chat(text)}, sampling_params)

    def score(self, prompt_token_ids: Seq[int], *, chunk_size: int = 256,
              logprobs_start: int = 0) -> torch.Tensor:
        """Teacher-forced next-token log-probs: float32 (len(prompt_token_ids) - logprobs_start, vocab).

        Row j is log_softmax of the logits at position ``logprobs_start + j``, the model's
        distribution of the token after ``prompt_token_ids[logprobs_start + j]`` given it and
        all tokens before it. The tokens are prefilled through the engine as consecutive chunks
        of ``chunk_size`` (the last may be shorter), one step each — what chunked prefill of a
        generate() request with max_num_batched_tokens=chunk_size does: every chunk's K/V is
        written to the cache (compressed on TurboQuant layers) and its queries attend to the
        cached earlier chunks plus their own chunk. Only rows from ``logprobs_start`` on go
        through the LM head. The prefix cache is not used; the blocks are freed afterwards.
        """
        engine = self.llm_engine
        ids = list(prompt_token_ids) if not isinstance(prompt_token_ids, (str, dict)) else None
        if ids is None:
            raise ValueError("score() takes a sequence of token ids, not text; tokenize it first "
                             "(llm.tokenizer.encode(text))")
        n, max_len = len(ids), engine.scheduler.config.max_model_len
        engine.check_token_ids(ids)
        if not 1 <= n <= max_len:
            raise ValueError(f"score() needs 1 to max_model_len={max_len} tokens, got {n}")
        for name, v in (("chunk_size", chunk_size), ("logprobs_start", logprobs_start)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{name} must be an integer, got {v!r}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if not 0 <= logprobs_start < n:
            raise ValueError(f"logprobs_start must be in [0, {n - 1}] for {n} tokens, got {logprobs_start}")
        need = -(-n // engine.block_manager.block_size)
        if need > min(engine.block_manager.num_blocks):
            raise ValueError(f"{n} tokens need {need} KV blocks; the cache has "
                             f"{min(engine.block_manager.num_blocks)}")
        engine.flush()
        if engine.has_unfinished_requests():
            raise RuntimeError("score() runs on an idle engine; finish or abort the running requests first")
        return engine.score(ids, chunk_size, logprobs_start)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(ids) > 1:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        start, n_out = time.perf_counter(), 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    done[out.request_id] = out
                    n_out += len(out.outputs[0].token_ids)
                    if bar is not None:
                        bar.set_postfix_str(f"output {n_out / (time.perf_counter() - start):.1f} tok/s")
                        bar.update(1)
            engine.flush()  # the engine idle, as before async scheduling: no step left in flight
        except BaseException:
            for rid in ids:
                engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[rid] for rid in ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or a list
        of conversations, formatted with the tokenizer's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt": text, "prompt_token_ids": self._encode_chat(text)}
                   for text in (self.apply_chat_template(c, add_generation_prompt, chat_template_kwargs)
                                for c in conversations)]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True,
                            chat_template_kwargs: dict | None = None) -> str:
        tok = self.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer, so it has no chat template; "
                             "pass {'prompt_token_ids': [...]} to generate()")
        if not getattr(tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use generate() with plain text")
        return tok.apply_chat_template(conversation, tokenize=False,
                                       add_generation_prompt=add_generation_prompt,
                                       **(chat_template_kwargs or {}))

    def _encode_chat(self, text: str) -> list[int]:
        # The template already holds any BOS / special tokens.
        return list(self.tokenizer.encode(text, add_special_tokens=False))
