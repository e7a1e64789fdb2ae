"""The offline API, like vLLM's: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as Seq

from .llm_engine import EngineArgs, LLMEngine, format_plan
from .outputs import RequestOutput
from .sampling import SamplingParams

Prompt = str | dict


class LLM:
    """Load a model with a per-layer KV-cache plan and generate from batches of prompts.

    Keyword arguments are :class:`~tqattn.engine.llm_engine.EngineArgs` (vLLM's names):
    ``model`` (a HF directory, a .gguf file, a shipped config name with
    ``load_format="dummy"``, or "default" for the embedded SmolLM2-135M-Instruct),
    ``dtype``, ``kv_cache_dtype``, ``kv_cache_dtype_skip_layers``, ``kv_cache_boundary_layers``,
    ``max_model_len``, ``max_num_seqs``, ``max_num_batched_tokens``, ``block_size``,
    ``enable_prefix_caching``, ``enable_chunked_prefill``, ``kv_cache_memory_bytes`` /
    ``gpu_memory_utilization`` / ``num_gpu_blocks_override``, ``load_format``, ``seed``,
    ``device``, ``enforce_eager``.
    """

    def __init__(self, model: str = "default", **kwargs):
        self.llm_engine = LLMEngine(EngineArgs(model=model, **kwargs))
        self._ids = itertools.count()

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
        """One RequestOutput per prompt, in order. A prompt is a string or {"prompt_token_ids": [...]}."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        sampling_params = list(sampling_params)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts; "
                             f"pass one, or one per prompt")
        engine = self.llm_engine
        ids = [str(next(self._ids)) for _ in prompts]
        try:
            for rid, prompt, sp in zip(ids, prompts, sampling_params):
                engine.add_request(rid, prompt, sp)
        except Exception:
            for rid in ids:
                engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

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
