"""Sampling parameters of a request and the sampler that turns logits into token ids."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

GREEDY_BELOW = 1e-5
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # what torch.Generator.manual_seed takes
# vLLM's sampling options this sampler does not implement, and the values that change nothing:
# code written for vLLM runs as long as it does not ask for them
NEUTRAL_ONLY: dict[str, tuple] = {
    "n": (1,), "best_of": (None, 1), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0), "min_p": (0, 0.0), "logprobs": (None,), "prompt_logprobs": (None,),
}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_seed(x) -> bool:
    return _is_int(x) and SEED_MIN <= x <= SEED_MAX


@dataclass
class SamplingParams:
    """How to pick a request's tokens (vLLM's names). temperature 0 = greedy."""
    temperature: float = 1.0  # below 1e-5 (vLLM's threshold) sampling is greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0  # eos / stop tokens are ignored before this many tokens
    stop: list[str] | str | None = None  # stop strings (the text is cut before them)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None  # per-request generator: same seed, same tokens
    skip_special_tokens: bool = True
    # accepted at NEUTRAL_ONLY's values only
    n: int = field(default=1, repr=False)
    best_of: int | None = field(default=None, repr=False)
    presence_penalty: float = field(default=0.0, repr=False)
    frequency_penalty: float = field(default=0.0, repr=False)
    repetition_penalty: float = field(default=1.0, repr=False)
    min_p: float = field(default=0.0, repr=False)
    logprobs: int | None = field(default=None, repr=False)
    prompt_logprobs: int | None = field(default=None, repr=False)

    def __post_init__(self):
        for name, neutral in NEUTRAL_ONLY.items():
            v = getattr(self, name)
            if not any(type(v) is type(x) and v == x for x in neutral):
                hint = "; LLM.score gives log-probabilities" if "logprobs" in name else ""
                raise ValueError(f"{name}={v!r} is not supported by this sampler (only "
                                 f"{' or '.join(map(repr, neutral))}); leave it out{hint}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 1, or 0 / -1 to disable it, got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer or None, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        ids = self.stop_token_ids
        ids = [] if ids is None else [ids] if _is_int(ids) else ids
        ids = None if isinstance(ids, (str, bytes, dict)) or not hasattr(ids, "__iter__") else list(ids)
        if ids is None or not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError(f"stop_token_ids must be non-negative token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = ids
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.seed is not None and not is_seed(self.seed):
            raise ValueError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}] or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        # a smaller temperature overflows the logits' scaling in fp32; its limit is the argmax
        return self.temperature < GREEDY_BELOW


class Sampler:
    """Greedy / temperature / top-k / top-p sampling over a (B, V) batch of logits.

    Random rows draw q ~ Exp(1) and take argmax(p / q) — a sample from p (the Gumbel-max trick
    in exponential form) that needs no sort and lets seeded rows use their own generator.
    """

    def __init__(self, seed: int = 0):
        self.seed = seed
        self._generators: dict[str, torch.Generator] = {}  # device type -> engine-wide generator

    def _default_generator(self, device: torch.device) -> torch.Generator:
        g = self._generators.get(device.type)
        if g is None:
            g = self._generators[device.type] = torch.Generator(device=device).manual_seed(self.seed)
        return g

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> list[int]:
        return self.sample(logits, params, generators).tolist()

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               generators: list[torch.Generator | None]) -> torch.Tensor:
        """The token ids (B,) int64, on the logits' device; nothing waits for the device."""
        # greedy rows take the argmax in the logits' own dtype: a cast to fp32 keeps their order,
        # and at 256 rows of a 152K vocabulary it would copy 156 MB a step
        out = logits.argmax(-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            idx = torch.tensor(rows, device=logits.device)
            x = logits[idx].float()
            temps = torch.tensor([params[i].temperature for i in rows], device=x.device)
            x = x / temps[:, None]
            top_k = [params[i].top_k for i in rows]
            top_p = [params[i].top_p for i in rows]
            if any(top_k) or any(p < 1 for p in top_p):
                x = _top_k_top_p(x, top_k, top_p)
            probs = torch.softmax(x, -1)
            q = torch.empty_like(probs).exponential_(generator=self._default_generator(x.device))
            for j, i in enumerate(rows):
                if generators[i] is not None:  # seeded: its own stream, whatever the batch
                    q[j].exponential_(generator=generators[i])
            out[idx] = (probs / q).argmax(-1)
        return out


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p nucleus with -inf."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(-1, descending=True)
    k = torch.tensor([min(t, vocab) if t > 0 else vocab for t in top_k], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device)
    drop = ranks[None, :] >= k[:, None]
    p = torch.tensor(top_p, device=logits.device, dtype=torch.float32)
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), -1)
    # Keep a token if the mass before it is < top_p (the top token is always kept).
    drop |= (probs.cumsum(-1) - probs) >= p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    return None if seed is None else torch.Generator(device=device).manual_seed(seed)
