"""The embedded SmolLM2-135M-Instruct (GGUF) on CPU: a real answer with and without TurboQuant,
and the teacher-forced next-token agreement between the two on a fixed text.

The first run de-quantizes the GGUF (~1 min on 2 cores) and caches it; later runs load in ~1 s.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from tqattn import LLM, SamplingParams  # noqa: E402
from tqattn.engine.scheduler import ScheduledSeq  # noqa: E402
from tqattn.engine.sequence import Sequence  # noqa: E402
from tqattn.models import default_model_path  # noqa: E402

from .test_llm_reference import _one_thread  # noqa: E402,F401

try:
    default_model_path()
except (ModuleNotFoundError, FileNotFoundError) as e:
    pytest.skip(str(e), allow_module_level=True)

pytestmark = pytest.mark.slow

TEXT = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is "
    "named after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 "
    "to 1889. Locally nicknamed the Iron Lady, it was constructed as the centrepiece of the 1889 "
    "World's Fair, and to crown the centennial anniversary of the French Revolution. Although "
    "initially criticised by some of France's leading artists and intellectuals for its design, it "
    "has since become a global cultural icon of France and one of the most recognisable structures "
    "in the world."
)


@pytest.fixture(scope="module")
def llms():
    common = dict(max_model_len=512, max_num_seqs=4, kv_cache_memory_bytes=256 << 20)
    return {preset: LLM("default", kv_cache_dtype=preset, **common)
            for preset in ("auto", "turboquant_k3v4_nc")}


@pytest.mark.parametrize("preset", ["auto", "turboquant_k3v4_nc"])
def test_capital_of_france(llms, preset):
    llm = llms[preset]
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32))[0]
    assert "Paris" in out.outputs[0].text, out.outputs[0].text
    assert out.prompt.startswith("<|im_start|>")


@torch.inference_mode()
def _predictions(llm, ids, chunks):
    """Greedy next-token prediction at every position of ids, feeding the true text in the given
    chunks [(start, n), ...] (one-token chunks are decode steps over the cache, as in generation)."""
    engine = llm.llm_engine
    seq = Sequence(ids, SamplingParams(temperature=0))
    assert engine.block_manager.allocate_slots(seq, len(ids))
    runner, preds = engine.runner, []
    try:
        for start, n in chunks:
            input_ids, pos, md, _ = runner._prepare([ScheduledSeq(seq, n, n == 1, start)])
            preds += runner.forward(input_ids, pos, md, list(range(n))).argmax(-1).tolist()
    finally:
        engine.block_manager.free(seq)
    return preds


def test_teacher_forced_agreement(llms, record_property):
    ids = llms["auto"].tokenizer.encode(TEXT)[:80]
    first = 16
    # full precision: one prefill gives every prediction; TurboQuant: a prefill of the first 16
    # tokens, then one decode step per token, each reading the compressed history
    auto = _predictions(llms["auto"], ids, [(0, len(ids))])[first - 1:-1]
    tq = _predictions(llms["turboquant_k3v4_nc"], ids,
                      [(0, first)] + [(t, 1) for t in range(first, len(ids))])[first - 1:-1]
    truth = ids[first:]
    agree = sum(a == b for a, b in zip(auto, tq)) / len(truth)
    acc_auto = sum(a == t for a, t in zip(auto, truth)) / len(truth)
    acc_tq = sum(a == t for a, t in zip(tq, truth)) / len(truth)
    record_property("next_token_agreement", agree)
    print(f"\nSmolLM2-135M teacher-forced over {len(truth)} tokens: next-token agreement "
          f"turboquant_k3v4_nc vs auto {agree:.3f}; top-1 accuracy auto {acc_auto:.3f}, "
          f"turboquant_k3v4_nc {acc_tq:.3f}")
    assert agree >= 0.6  # a sanity bound; the figure itself is what this test reports
