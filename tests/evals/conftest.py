"""Fakes standing in for the engine: a character tokenizer and LLMs with the offline API shape."""

import re
import zlib
from types import SimpleNamespace

import pytest
import torch

from tqattn.evals import scoring

VOCAB = 96


class CharTokenizer:
    """One token per character (code point mod VOCAB); decode maps back onto printable ASCII."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % VOCAB for c in text]}

    def decode(self, ids):
        return "".join(chr(32 + i % 95) if i % VOCAB not in (10,) else "\n" for i in ids)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


class FakeLLM:
    """`score`: a fixed bigram model, plus deterministic logit noise whose size depends on the
    preset (stands in for cache-compression error). `generate`: answers with `answer_fn`."""

    NOISE = {"auto": 0.0, "good": 0.05, "bad": 0.3}

    def __init__(self, kv_cache_dtype, answer_fn=None, log=None):
        self.kv = kv_cache_dtype
        self.noise = self.NOISE.get(kv_cache_dtype, 0.1)
        g = torch.Generator().manual_seed(0)
        self.table = 3 * torch.randn(VOCAB, VOCAB, generator=g)
        self.answer_fn = answer_fn
        self.log = log if log is not None else []
        self.log.append(("build", kv_cache_dtype))

    def get_tokenizer(self):
        return CharTokenizer()

    def score(self, ids, *, chunk_size, logprobs_start):
        self.log.append(("score", self.kv, len(ids), chunk_size, logprobs_start))
        logits = self.table[torch.tensor(ids[logprobs_start:])]
        if self.noise:
            g = torch.Generator().manual_seed(zlib.crc32(f"{self.kv}{ids[:8]}".encode()))
            logits = logits + self.noise * torch.randn(logits.shape, generator=g)
        return torch.log_softmax(logits, -1)

    def generate(self, prompts, params, use_tqdm=True):
        self.log.append(("generate", self.kv, len(prompts), params.max_tokens))
        self.use_tqdm = use_tqdm
        return [SimpleNamespace(outputs=[SimpleNamespace(text=self.answer_fn(self.kv, p))])
                for p in prompts]


def last_question(prompt: str) -> str:
    return re.findall(r"Question: (.*)", prompt)[-1].strip()


@pytest.fixture
def fake_params(monkeypatch):
    """SamplingParams without the engine."""
    monkeypatch.setattr(scoring, "greedy_params",
                        lambda max_tokens, stop=None: SimpleNamespace(
                            temperature=0.0, max_tokens=max_tokens, stop=stop or []))
