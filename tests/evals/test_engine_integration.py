"""The evals through the real engine on a random-weight tiny model (CPU, seconds).

Skipped until the engine (tqattn.LLM, SamplingParams) exists. Perplexity scoring goes through
LLM.score (its own tests: tests/engine/test_llm_score.py).
The model: the shipped llama-tiny config (vocab 256) in a temp dir with a byte-level tokenizer
(token id = byte value), loaded with load_format="dummy".
"""

import json
from dataclasses import replace

import pytest

from tqattn.evals import gsm8k, niah, ppl, scoring

pytestmark = pytest.mark.skipif(not scoring.engine_available(),
                                reason="tqattn.LLM (the engine, issue 5) is not available yet")

CHAT = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")


def _bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from tqattn.models.configs import model_config_path

    d = tmp_path_factory.mktemp("llama-tiny-bytes")
    (d / "config.json").write_text(model_config_path("llama-tiny").read_text())
    b2u = _bytes_to_unicode()
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={b2u[i]: i for i in range(256)}, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=b2u[2])
    hf.chat_template = CHAT
    hf.save_pretrained(d)
    return str(d)


def _factory(model_dir, **engine_args):
    return scoring.llm_factory(model_dir, load_format="dummy",
                               engine_args={"enable_prefix_caching": False, **engine_args})


@pytest.mark.parametrize("name", gsm8k.list_configs())
def test_every_gsm8k_config_runs_with_limit(tiny_model_dir, name):
    """Each shipped config end to end through the engine (its preset, engine args and pass rule)
    on the tiny model; configs that need the GSM8K JSONL get generated items instead."""
    cfg = gsm8k.override(gsm8k.load_config(name), model=tiny_model_dir, load_format="dummy",
                         data="gsm_symbolic" if gsm8k.load_config(name).data["source"] == "jsonl" else None)
    # One shot and 8 new tokens keep it fast; max_drop (one config) runs the auto cache first too.
    with_auto = name == "SmolLM2-135M-TQ-k3v4nc"
    cfg = replace(cfg, num_shots=1, max_tokens=8,
                  engine_args={**cfg.engine_args, "kv_cache_memory_bytes": 8 << 20},
                  pass_rule={"threshold": 0.0, **({"max_drop": 1.0} if with_auto else {})})
    res = gsm8k.run_gsm8k(cfg, limit=1)
    assert res["num_questions"] == 1 and res["passed"] and len(res["checks"]) == 1 + with_auto
    assert (res["auto_accuracy"] is not None) == (with_auto or cfg.kv_cache_dtype == "auto")
    assert res["kv_cache_dtype"] == cfg.kv_cache_dtype and res["limited"]
    assert all(isinstance(s["output"], str) for s in res["samples"])
    json.dumps(res)


def test_ppl_through_engine(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TQATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(ppl, "source_text", lambda s, n: "To be, or not to be: that is the question. " * 200)
    spec = ppl.PPLSpec(context_len=256, chunk_size=64, min_tokens=384, block_tokens=96)
    res = ppl.run_ppl(_factory(tiny_model_dir, max_model_len=512), ["turboquant_k3v4_nc", "tq_k3v4"], [spec])
    s = res["specs"][0]
    assert s["scored_tokens"] == 384
    for p in ("turboquant_k3v4_nc", "tq_k3v4"):
        assert s["presets"][p]["kl"]["value"] >= 0 and 0 <= s["presets"][p]["top1"]["value"] <= 1


def test_score_auto_matches_unchunked(tiny_model_dir):
    import torch

    llm = scoring.make_llm(tiny_model_dir, "auto", load_format="dummy", engine_args={"max_model_len": 512, "enable_prefix_caching": False})
    ids = list(range(40, 240))
    a = scoring.score_tokens(llm, ids, 64, 100)
    b = scoring.score_tokens(llm, ids, 256, 100)
    assert a.shape == (100, 256) and torch.allclose(a, b, atol=1e-4)
    assert torch.allclose(a.exp().sum(1), torch.ones(100), atol=1e-4)


def test_niah_through_engine(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(niah.evdata, "shakespeare_text", lambda: "Now is the winter of our discontent\n" * 400)
    res = niah.run_niah(_factory(tiny_model_dir, max_model_len=1024), ["tq_k3v4"], contexts=[512],
                        depths=[0.5])
    assert set(res["presets"]) == {"auto", "tq_k3v4"}
