"""LLM.score: teacher-forced next-token log-probs through the engine's chunked prefill."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tqattn import LLM  # noqa: E402
from tqattn.models import load_model  # noqa: E402

from . import test_llm_reference as reference  # noqa: E402
from .test_llm_reference import _one_thread, random_prompts  # noqa: E402,F401

SMALL = dict(load_format="dummy", max_model_len=128, max_num_seqs=4, enable_prefix_caching=False)
IDS = random_prompts([100], seed=5)[0]


def _all_free(llm) -> bool:
    bm = llm.llm_engine.block_manager
    bm.check_invariants([])
    return all(bm.num_free_blocks(g) == n for g, n in enumerate(bm.num_blocks))


@torch.inference_mode()
def _hf_logprobs(ids):
    """A plain transformers forward over the whole sequence, no engine, no cache."""
    lm = load_model("llama-tiny", load_format="dummy")
    logits = lm.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    return torch.log_softmax(logits.float(), -1)


@torch.inference_mode()
def _chunked_reference_logprobs(preset, ids, chunk, key_offsets=None, name="llama-tiny",
                                **load_kwargs):
    """All positions' log-probs of the chunked reference (history decoded from the codec)."""
    ref = reference.ChunkedReference(name, preset, **load_kwargs)
    st, rows = reference._State(ref.kv_dtypes, key_offsets), []
    reference._current = st
    try:
        for s in range(0, len(ids), chunk):
            out = ref.lm.model(input_ids=torch.tensor([ids[s:s + chunk]]),
                               position_ids=torch.arange(s, min(s + chunk, len(ids)))[None],
                               use_cache=False)
            rows.append(torch.log_softmax(out.logits[0].float(), -1))
    finally:
        reference._current = None
    return torch.cat(rows)


def test_auto_equals_transformers_forward_and_is_chunk_invariant():
    llm = LLM("llama-tiny", kv_cache_dtype="auto", **SMALL)
    expected = _hf_logprobs(IDS)
    for chunk, start in [(16, 0), (37, 10), (100, 99), (1, 90), (256, 50)]:
        lp = llm.score(IDS, chunk_size=chunk, logprobs_start=start)
        assert lp.dtype == torch.float32 and lp.shape == (len(IDS) - start, 256)
        torch.testing.assert_close(lp, expected[start:], atol=2e-5, rtol=1e-5)
        assert _all_free(llm)


def test_turboquant_reads_compressed_history():
    preset, chunk = "turboquant_k3v4_nc", 16
    llm = LLM("llama-tiny", kv_cache_dtype=preset, **SMALL)
    lp = llm.score(IDS, chunk_size=chunk, logprobs_start=0)
    assert _all_free(llm)
    # exactly the chunked reference: earlier chunks compressed, the own chunk raw
    torch.testing.assert_close(lp, _chunked_reference_logprobs(
        preset, IDS, chunk, reference.engine_key_offsets(llm)), atol=2e-4, rtol=1e-4)
    exact = _hf_logprobs(IDS)
    # the first chunk sees no compressed history; later ones differ from full precision, slightly
    torch.testing.assert_close(lp[:chunk], exact[:chunk], atol=2e-5, rtol=1e-5)
    assert (lp[chunk:] - exact[chunk:]).abs().max() > 1e-3
    kl = (exact.exp() * (exact - lp)).sum(-1)[chunk:]
    agree = (exact.argmax(-1) == lp.argmax(-1))[chunk:].float().mean()
    assert 0 < kl.mean() < 0.1 and agree > 0.5, (kl.mean(), agree)  # random weights: flat rows
    # the whole sequence in one chunk sees no compressed history at all
    torch.testing.assert_close(llm.score(IDS, chunk_size=128), exact, atol=2e-5, rtol=1e-5)
    # generate still works and leaves nothing behind after scoring
    from tqattn import SamplingParams
    llm.generate([{"prompt_token_ids": IDS[:20]}], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert _all_free(llm)


def test_bad_arguments_raise_and_free_nothing_leaks():
    llm = LLM("llama-tiny", kv_cache_dtype="tq_k4v3", **SMALL)
    cases = [
        (dict(prompt_token_ids=[]), "1 to max_model_len=128"),
        (dict(prompt_token_ids=list(range(3, 132))), "1 to max_model_len=128"),
        (dict(prompt_token_ids=[1, 2, 300]), r"\[300\] are not ints in \[0, 256\)"),
        (dict(prompt_token_ids="some text"), "not text"),
        (dict(prompt_token_ids=IDS, chunk_size=0), "chunk_size must be >= 1"),
        (dict(prompt_token_ids=IDS, chunk_size=2.5), "chunk_size must be an integer"),
        (dict(prompt_token_ids=IDS, logprobs_start=100), r"logprobs_start must be in \[0, 99\]"),
        (dict(prompt_token_ids=IDS, logprobs_start=-1), r"logprobs_start must be in \[0, 99\]"),
    ]
    for kwargs, msg in cases:
        with pytest.raises(ValueError, match=msg):
            llm.score(**kwargs)
    # an error inside the forward frees the blocks too
    runner = llm.llm_engine.runner
    forward, calls = runner.forward, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return forward(*args)

    runner.forward = failing
    with pytest.raises(RuntimeError, match="boom"):
        llm.score(IDS, chunk_size=16)
    runner.forward = forward
    assert _all_free(llm)
    assert llm.score(IDS, chunk_size=16, logprobs_start=98).shape == (2, 256)
