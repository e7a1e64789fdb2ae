"""LLM.stream: the pieces concatenate to generate()'s output; stopping early frees the blocks."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tqattn import LLM, SamplingParams  # noqa: E402
from tqattn.engine.outputs import CompletionOutput, RequestOutput  # noqa: E402
from tqattn.engine.streaming import IncrementalOutput  # noqa: E402

from .test_llm_reference import _one_thread  # noqa: E402,F401


def _final(text, ids, reason="stop"):
    return RequestOutput("r", None, [1], [CompletionOutput(0, text, ids, reason)], True)


def test_incremental_holds_back_partial_characters_and_stop_prefixes():
    inc = IncrementalOutput("r", stop=["STOP"])
    p = inc.update([5], "ab")  # the last 3 characters may start "STOP": held back
    assert p.text == "" and p.token_ids == [5]
    assert inc.update([5], "ab") is None  # nothing new
    p = inc.update([5, 6], "abcdef")
    assert p.text == "abc" and p.token_ids == [6] and inc.text == "abc"
    last = inc.finish(_final("abcdeST", [5, 6, 7]))
    assert inc.text == "abcdeST" and last.text == "deST" and last.token_ids == [7] and last.finished
    inc = IncrementalOutput("r")
    p = inc.update([1, 2], "x\ufffd")  # an unfinished multi-byte character is not sent
    assert p.text == "x" and p.token_ids == [1, 2]
    assert inc.update([1, 2, 3], "x\u00e9").text == "\u00e9"


@pytest.fixture(scope="module")
def llm():
    return LLM("llama-tiny", load_format="dummy", max_model_len=64, kv_cache_dtype="tq_k4v3", device="cpu")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_stream_matches_generate(llm, temperature):
    sp = SamplingParams(temperature=temperature, max_tokens=10, seed=3)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    expected = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    pieces = list(llm.stream(prompt, sp))
    assert [t for p in pieces for t in p.token_ids] == expected.token_ids
    assert pieces[-1].finished and pieces[-1].finish_reason == expected.finish_reason
    assert not any(p.finished for p in pieces[:-1]) and len(pieces) > 2


def test_stream_stopped_early_aborts_and_frees(llm):
    bm = llm.llm_engine.block_manager
    free = bm.num_free_blocks()
    it = llm.stream({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    next(it)
    next(it)
    it.close()
    assert not llm.llm_engine.has_unfinished_requests() and bm.num_free_blocks() == free
    with pytest.raises(ValueError, match="takes one prompt"):
        next(llm.stream([{"prompt_token_ids": [1]}, {"prompt_token_ids": [2]}]))
