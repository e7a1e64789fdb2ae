"""The evals' only contact with the engine: build an LLM, generate, score token sequences.

Everything else in tqattn/evals talks to the engine through these functions, so a change of
engine API is a change here. Tests pass duck-typed fakes with the same methods.

Engine API assumed (vLLM's offline shape plus one scoring call):

* ``LLM(model=..., kv_cache_dtype=..., load_format=..., **engine_args)``
* ``llm.generate(prompts: list[str], SamplingParams(...), use_tqdm=bool) -> [out]`` with
  ``out.outputs[0].text``
* ``llm.get_tokenizer()`` -> the Hugging Face tokenizer (chat template, token counting)
* ``llm.score(prompt_token_ids: list[int], *, chunk_size: int, logprobs_start: int)
  -> torch.Tensor`` float32, shape ``(len(prompt_token_ids) - logprobs_start, vocab_size)``:
  row j is log_softmax of the logits at position ``logprobs_start + j`` (the distribution of
  the token after it), computed through the engine's real chunked prefill — consecutive chunks
  of ``chunk_size`` tokens, each chunk's K/V written to the (compressed) cache and its queries
  attending to the cached earlier chunks plus their own raw chunk — with the blocks freed
  afterwards (tqattn/engine/llm.py).

:func:`score_tokens` scores tokens[start:] of a window: it feeds tokens[:-1] (the last token is
only a target) with ``logprobs_start = start - 1``.
"""

from __future__ import annotations

import gc
import sys
from typing import Any, Callable

import torch


class EngineUnavailable(RuntimeError):
    pass


def engine_available() -> bool:
    try:
        from tqattn import LLM, SamplingParams  # noqa: F401
    except ImportError:
        return False
    return True


def _engine():
    try:
        from tqattn import LLM, SamplingParams
    except ImportError as e:
        raise EngineUnavailable(
            "the offline engine (tqattn.LLM / tqattn.SamplingParams) is not available in this "
            f"install: {e}") from e
    return LLM, SamplingParams


def make_llm(model: str, kv_cache_dtype: str, *, load_format: str | None = None,
             engine_args: dict | None = None) -> Any:
    from .data import resolve_model

    LLM, _ = _engine()
    kwargs = dict(engine_args or {})
    if load_format is not None:
        kwargs["load_format"] = load_format
    return LLM(model=resolve_model(model), kv_cache_dtype=kv_cache_dtype, **kwargs)


LLMFactory = Callable[[str], Any]  # kv_cache_dtype -> llm


def llm_factory(model: str, *, load_format: str | None = None,
                engine_args: dict | None = None) -> LLMFactory:
    return lambda kv_cache_dtype: make_llm(model, kv_cache_dtype, load_format=load_format,
                                           engine_args=engine_args)


def with_llm(factory: LLMFactory, kv_cache_dtype: str, fn: Callable[[Any], Any]) -> Any:
    """fn(llm) with a freshly built LLM that is dropped before returning, so that the next
    build never has two models in memory."""
    llm = factory(kv_cache_dtype)
    try:
        return fn(llm)
    finally:
        close = getattr(llm, "close", None) or getattr(llm, "shutdown", None)
        if callable(close):
            close()
        del llm
        gc.collect()


def get_tokenizer(llm: Any) -> Any:
    getter = getattr(llm, "get_tokenizer", None)
    tok = getter() if callable(getter) else getattr(llm, "tokenizer", None)
    if tok is None:
        raise ValueError("this model has no tokenizer; text evals need one (load a model with a "
                         "tokenizer, e.g. a GGUF file or a HF directory with tokenizer files)")
    return tok


def greedy_params(max_tokens: int, stop: list[str] | None = None) -> Any:
    _, SamplingParams = _engine()
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=stop or [])


def generate_texts(llm: Any, prompts: list[str], params: Any) -> list[str]:
    # a progress bar only on a terminal: in a log file it is a stream of carriage returns
    outs = llm.generate(prompts, params, use_tqdm=sys.stderr.isatty())
    if len(outs) != len(prompts):
        raise RuntimeError(f"engine returned {len(outs)} outputs for {len(prompts)} prompts")
    return [o.outputs[0].text for o in outs]


def score_tokens(llm: Any, token_ids: list[int], chunk_size: int, start: int) -> torch.Tensor:
    """Log-probs (len - start, vocab) float32: row j is the log-distribution of token_ids[start + j]
    given the tokens before it, under chunked prefill of token_ids[:-1] (see above)."""
    n = len(token_ids)
    if not 1 <= start < n:
        raise ValueError(f"start={start} must be in [1, {n - 1}] for a {n}-token sequence")
    score = getattr(llm, "score", None)
    if not callable(score):
        raise EngineUnavailable("the engine has no LLM.score(prompt_token_ids, chunk_size=, "
                                "logprobs_start=); perplexity/KL evals need it (tqattn/evals/scoring.py)")
    out = score(list(token_ids[:-1]), chunk_size=chunk_size, logprobs_start=start - 1)
    if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.shape[0] != n - start:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise RuntimeError(f"LLM.score returned {shape}; expected ({n - start}, vocab) log-probs")
    return out.float()
