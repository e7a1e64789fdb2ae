"""Needle in a haystack: can the model still find one sentence in a long compressed context?

Each cell of the grid (context length x depth, `trials` needles per cell) is one chat prompt:
Shakespeare text cut to fill the context, a needle sentence holding a random 6-digit number
(seeded per cell, the same for every preset) placed at a line boundary at the given depth, and a
question asking for the number. Greedy decoding; a cell scores 1 when the exact number appears
in the answer. The `auto` cache runs first as the reference.
"""

from __future__ import annotations

import logging
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import data as evdata
from . import scoring
from .gsm8k import apply_chat_template

logger = logging.getLogger(__name__)

INTRO = ("Read the passage below. One sentence in it does not belong to the original text; "
         "the question after the passage is about that sentence.")
NEEDLE = "The secret number that opens the harbour gate is {number}."
QUESTION = "What is the secret number that opens the harbour gate? Reply with the number only."
MAX_TOKENS = 24


@dataclass(frozen=True)
class Case:
    context_len: int
    depth: float
    trial: int
    number: str


def make_cases(contexts: list[int], depths: list[float], trials: int = 1, seed: int = 0) -> list[Case]:
    for d in depths:
        if not 0.0 <= d <= 1.0:
            raise ValueError(f"depth {d} must be in [0, 1]")
    cases = []
    for c in contexts:
        for d in depths:
            for t in range(trials):
                rng = random.Random(f"niah-{seed}-{c}-{d}-{t}")  # str seeds are stable across runs
                cases.append(Case(c, d, t, str(rng.randint(100_000, 999_999))))
    return cases


def insert_needle(text: str, needle: str, depth: float) -> str:
    """Put `needle` on its own line at the line boundary at or before depth * len(text)."""
    i = int(depth * len(text))
    if i >= len(text):
        return text.rstrip("\n") + "\n" + needle + "\n"
    i = text.rfind("\n", 0, i) + 1  # 0 when there is no earlier newline
    return text[:i] + needle + "\n" + text[i:]


def _render(tokenizer: Any, haystack: str) -> str:
    content = f"{INTRO}\n\n{haystack}\n\n{QUESTION}"
    return apply_chat_template(tokenizer, [{"role": "user", "content": content}])


def build_prompt(tokenizer: Any, hay_ids: list[int], case: Case, max_tokens: int = MAX_TOKENS) -> str:
    """A chat prompt of at most context_len - max_tokens tokens (as close to it as a few tries get)."""
    limit = case.context_len - max_tokens
    needle = NEEDLE.format(number=case.number)
    overhead = len(tokenizer(_render(tokenizer, needle), add_special_tokens=False)["input_ids"])
    budget = limit - overhead - 2
    offset = case.trial * 4096  # another stretch of text for each trial
    for _ in range(4):
        if budget <= 0:
            raise ValueError(f"context {case.context_len} is too short for the NIAH prompt "
                             f"({overhead} tokens without haystack)")
        if offset + budget > len(hay_ids):
            raise ValueError(f"haystack text has {len(hay_ids)} tokens; need {offset + budget}")
        hay = tokenizer.decode(hay_ids[offset:offset + budget])
        prompt = _render(tokenizer, insert_needle(hay, needle, case.depth))
        n = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        if n <= limit:
            return prompt
        budget -= n - limit + 2  # re-tokenization at the cut and needle can add a few tokens
    raise RuntimeError(f"could not fit the NIAH prompt into {limit} tokens")


def found(answer: str, number: str) -> bool:
    return number in re.findall(r"\d+", answer.replace(",", "").replace(" ", ""))


def run_niah(factory: scoring.LLMFactory, presets: list[str], *, contexts=(2048, 4096, 8192),
             depths=(0.1, 0.5, 0.9), trials: int = 1, seed: int = 0, reference: str = "auto") -> dict:
    cases = make_cases(list(contexts), list(depths), trials, seed)
    order = [reference] + [p for p in presets if p != reference]
    prompts: list[str] = []
    out = {"reference": reference, "contexts": list(contexts), "depths": list(depths),
           "trials": trials, "seed": seed, "presets": {}}

    def run(llm):
        if not prompts:  # same tokenizer for every preset: build the prompts once
            tok = scoring.get_tokenizer(llm)
            hay_ids = tok(evdata.shakespeare_text(), add_special_tokens=False)["input_ids"]
            prompts.extend(build_prompt(tok, hay_ids, c) for c in cases)
        t0 = time.perf_counter()
        texts = scoring.generate_texts(llm, prompts, scoring.greedy_params(MAX_TOKENS))
        return texts, round(time.perf_counter() - t0, 2)

    for preset in order:
        texts, elapsed = scoring.with_llm(factory, preset, run)
        cells = [{"context_len": c.context_len, "depth": c.depth, "trial": c.trial,
                  "number": c.number, "answer": t, "correct": found(t, c.number)}
                 for c, t in zip(cases, texts)]
        acc = sum(x["correct"] for x in cells) / len(cells)
        out["presets"][preset] = {"accuracy": acc, "cells": cells, "elapsed_s": elapsed}
        logger.info("NIAH [%s]: %.3f (%d cells, %.0f s)", preset, acc, len(cells), elapsed)
    return out


def grid(result: dict, preset: str) -> list[list[float]]:
    """Mean score per (depth row, context column)."""
    cells = result["presets"][preset]["cells"]
    rows = []
    for d in result["depths"]:
        row = []
        for c in result["contexts"]:
            hits = [x["correct"] for x in cells if x["depth"] == d and x["context_len"] == c]
            row.append(sum(hits) / len(hits) if hits else float("nan"))
        rows.append(row)
    return rows


def plot_heatmaps(result: dict, out_dir: str | Path, model_name: str = "") -> list[Path]:
    """One PNG heat map per preset (depth x context, green = found)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for preset in result["presets"]:
        g = grid(result, preset)
        fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(result["contexts"]),
                                        1.2 + 0.6 * len(result["depths"])))
        ax.imshow(g, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(result["contexts"])), [str(c) for c in result["contexts"]])
        ax.set_yticks(range(len(result["depths"])), [f"{d:.0%}" for d in result["depths"]])
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("needle depth")
        for i, row in enumerate(g):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=9)
        ax.set_title(f"NIAH {model_name} {preset}".strip(), fontsize=10)
        fig.tight_layout()
        path = out_dir / f"niah_{_safe(model_name)}_{_safe(preset)}.png".replace("__", "_")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def _safe(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", s)
