import numpy as np
import pytest

from tqattn.evals import ppl

from .conftest import FakeLLM


def test_spec_defaults_and_validation():
    s = ppl.PPLSpec()
    assert (s.start, s.name, s.num_windows) == (256, "shakespeare@2048", 12)   # ceil(20000 / 1792)
    assert ppl.PPLSpec(context_len=8192, score_start=4096).num_windows == 5
    with pytest.raises(ValueError, match="unknown text source"):
        ppl.PPLSpec(source="wikitext")
    with pytest.raises(ValueError, match="score_start=2048"):
        ppl.PPLSpec(score_start=2048)
    with pytest.raises(ValueError, match="chunk_size"):
        ppl.PPLSpec(chunk_size=0)


def test_windows_are_even_and_disjoint():
    ids = list(range(1000))
    w = ppl.make_windows(ids, 4, 100)
    assert [x[0] for x in w] == [0, 300, 600, 900] and all(len(x) == 100 for x in w)
    assert ppl.make_windows(ids, 1, 100) == [ids[:100]]
    with pytest.raises(ValueError, match="need 1100"):
        ppl.make_windows(ids, 11, 100)


def test_unit_slices_partition_the_scored_tokens():
    for n, b in [(1792, 1024), (1024, 1024), (7936, 1024), (100, 1024), (5000, 512)]:
        sl = ppl.unit_slices(n, b)
        assert sl[0].start == 0 and sl[-1].stop == n
        assert all(a.stop == c.start for a, c in zip(sl, sl[1:]))
        sizes = [s.stop - s.start for s in sl]
        assert max(sizes) - min(sizes) <= 1 and max(sizes) < 1.5 * max(b, n // len(sl) + 1)


@pytest.fixture
def result(tmp_path, monkeypatch):
    monkeypatch.setenv("TQATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(ppl, "source_text", lambda source, n: "the quick brown fox. " * (n // 10 + 200))
    log = []
    specs = [ppl.PPLSpec(context_len=256, chunk_size=64, min_tokens=1200, block_tokens=96),
             ppl.PPLSpec(source="gsm_cot", context_len=128, chunk_size=32, min_tokens=400,
                         score_start=64)]
    res = ppl.run_ppl(lambda kv: FakeLLM(kv, log=log), ["good", "bad", "auto"], specs)
    return res, log, tmp_path


def test_run_ppl_end_to_end(result):
    res, log, tmp = result
    assert res["presets"] == ["good", "bad"]
    s0, s1 = res["specs"]
    assert (s0["num_windows"], s0["scored_tokens"], s0["score_start"]) == (7, 7 * 192, 64)
    assert s0["num_units"] == 14 and len(s0["presets"]["good"]["units"]["kl"]) == 14
    assert (s1["num_windows"], s1["scored_tokens"], s1["num_units"]) == (7, 448, 7)
    # one model at a time, reference first; each window scored in chunks with the spec's start
    assert [e[1] for e in log if e[0] == "build"] == ["auto", "good", "bad"] * 2
    assert {e[2:] for e in log if e[0] == "score" and e[1] == "good"} == {(255, 64, 63), (127, 32, 63)}
    g, b = s0["presets"]["good"], s0["presets"]["bad"]
    assert 0 < g["kl"]["value"] < b["kl"]["value"]
    assert g["kl"]["low"] <= g["kl"]["value"] <= g["kl"]["high"]
    assert 1.0 >= g["top1"]["value"] > b["top1"]["value"]
    assert s0["reference_ppl"]["value"] > 1
    assert not list((tmp / "tmp").iterdir())  # reference log-probs deleted


def test_compare_and_pooling(result):
    res, _, _ = result
    c = ppl.compare(res, "good", "bad")
    assert c["kl"]["excludes_zero"] and c["kl"]["high"] < 0
    assert c["top1"]["low"] > 0
    u = ppl.pooled_units(res, "good")
    assert len(u["n"]) == 14 + 7 and u["n"].sum() == 7 * 192 + 448
    only = ppl.pooled_units(res, "good", ["gsm_cot@128"])
    assert len(only["n"]) == 7
    ref = ppl.pooled_units(res, "auto")
    assert np.all(ref["kl"] == 0) and np.all(ref["agree"] == ref["n"])
    same = ppl.compare(res, "good", "good", ["shakespeare@256"])
    assert not same["kl"]["excludes_zero"]
    with pytest.raises(ValueError, match="no specs"):
        ppl.pooled_units(res, "good", ["nope"])


def test_score_tokens_checks():
    from types import SimpleNamespace

    import torch

    from tqattn.evals import scoring

    llm = FakeLLM("auto")
    assert scoring.score_tokens(llm, list(range(10)), 4, 3).shape == (7, 96)
    with pytest.raises(ValueError, match=r"start=10 must be in \[1, 9\]"):
        scoring.score_tokens(llm, list(range(10)), 4, 10)
    bad = SimpleNamespace(score=lambda ids, chunk_size, logprobs_start: torch.zeros(3, 5))
    with pytest.raises(RuntimeError, match=r"returned \(3, 5\); expected \(7, vocab\)"):
        scoring.score_tokens(bad, list(range(10)), 4, 3)
    with pytest.raises(scoring.EngineUnavailable, match="LLM.score"):
        scoring.score_tokens(object(), list(range(10)), 4, 3)
