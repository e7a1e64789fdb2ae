"""Start-up warm-up: one dummy step of each kind a run can reach, so nothing compiles mid-run.

What compiles on first use: the Dynamo graphs of a compiled model (one for one-token steps, one
for the rest, both compiled before the warm-up; this only confirms them) and each Triton/Gluon
kernel variant. A kernel variant is keyed by its constexpr launch parameters (some chosen from
the step's sizes: rows per program, the split count being 1 or more, the store's key splits) and
by the integer arguments Triton specializes (== 1, divisible by 16); the kernels exclude the ones
that change from step to step (block-table width, split count, row count). So each step kind
the attention backends branch on runs at sizes of each class:

* first-chunk prefill: the largest step, a small one, several prompts in one step;
* decodes (eager: CUDA graphs off or not graph-safe; graphs are captured separately): batches
  of 1, a few, 16, max_num_seqs, over contexts of one block and of 16;
* decodes mixed with a first-chunk prefill, from one decode to max_num_seqs - 1;
* first-chunk prefills of the token counts the backends ask for (``warmup_token_counts``);
* short continuations (chunk <= CONTINUATION_DEQUANT_THRESHOLD tokens over a cached prefix: the
  decode kernel with one query row per token), at each power of two up to the threshold;
* long continuations (the prefix dequantized), alone, mixed with decodes and with a short one.

Every step runs all layers, so every backend of the plan sees every kind. Sizes are clipped to
max_num_batched_tokens, max_num_seqs and max_model_len; the dummy sequences
(:meth:`ModelRunner.dummy_batch`) use no block manager, so nothing needs freeing.
"""

from __future__ import annotations

import dataclasses

from tqattn.attention.turboquant import CONTINUATION_DEQUANT_THRESHOLD

Chunk = tuple[int, int]  # (num_computed_tokens, num_scheduled_tokens)


def warmup_steps(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 block_size: int, token_counts: list[int] = ()) -> list[list[Chunk]]:
    """The warm-up steps: each a list of chunks (decodes first, as the scheduler orders them);
    ``token_counts``: more step sizes to run as a first-chunk prefill (the backends' own)."""
    budget, max_len, thr = max_num_batched_tokens, max_model_len, CONTINUATION_DEQUANT_THRESHOLD
    # contexts of one block and of 16 blocks (block tables one wide and a multiple of 16 wide;
    # the continuations over long_ctx reach other widths)
    short_ctx = max(1, min(block_size // 2, max_len - 1))
    long_ctx = max(1, min(16 * block_size - 11, max_len - 1))
    prefix = max(1, min(long_ctx, max_len - thr - 1))  # a long continuation still fits

    def decodes(n: int) -> list[Chunk]:
        return [((short_ctx, long_ctx)[i % 2], 1) for i in range(n)]

    steps = [
        [(0, budget)],                                        # the largest prefill
        [(0, 17)],
        [(0, 5), (0, 32)],                                    # several prompts
        *[decodes(b) for b in (1, 3, 16, max_num_seqs)],
        decodes(3) + [(0, 33)],                               # mixed
        decodes(1) + [(0, budget)],
        decodes(max_num_seqs - 1) + [(0, 16)],                # mixed, as many decodes as fit
        *[[(prefix, m)] for m in (2, 3, 4, 8, 16, thr)],      # short continuations
        decodes(2) + [(prefix, 5)],
        [(prefix, thr + 1)],                                  # long continuations
        [(prefix, 64)],
        decodes(2) + [(prefix, 8), (prefix, budget)],
        *[[(0, n)] for n in token_counts],
    ]
    return [s for s in dict.fromkeys(tuple(_fit(step, max_num_seqs, budget, max_len))
                                     for step in steps) if s]


def _fit(step: list[Chunk], max_num_seqs: int, budget: int, max_len: int) -> list[Chunk]:
    """The step clipped to the limits: chunks shortened to the token budget and max_model_len,
    chunks past max_num_seqs or with no token left dropped."""
    out, used = [], 0
    for computed, n in step[:max_num_seqs]:
        n = min(n, max_len - computed, budget - used)
        if n > 0:
            out.append((computed, n))
            used += n
    return out


def backend_token_counts(layers, block_size: int, device, max_tokens: int) -> list[int]:
    """The step sizes the layers' backends ask the warm-up to run (``warmup_token_counts``), asked
    once per backend and layer settings: the answer does not depend on the layer's index, and a
    TurboQuant answer scans every token count up to ``max_tokens``."""
    kinds = {(layer.backend, dataclasses.replace(layer.spec, layer_idx=0)) for layer in layers}
    return sorted({n for backend, spec in kinds
                   for n in backend.warmup_token_counts(spec, block_size, device, max_tokens)})


def run_warmup(runner, steps: list[list[Chunk]]) -> None:
    """Run each step through the model runner's normal execute path."""
    for step in steps:
        runner.execute_model(runner.dummy_batch(step))
