"""The start-up calibration: deterministic and cached; it centers the layers whose keys carry an
offset, routes the layers the codec cannot hold to full precision, and the engine that uses it
still computes exactly the un-centered attention over its codes."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from tqattn import LLM, SamplingParams  # noqa: E402
from tqattn.engine import calibration as cal  # noqa: E402
from tqattn.models import load_model  # noqa: E402
from tqattn.models.configs import model_config_path  # noqa: E402

from .test_llm_reference import ChunkedReference, _one_thread, random_prompts, record_chunks  # noqa: E402,F401
from .test_llm_score import _chunked_reference_logprobs  # noqa: E402
from .test_llm_turboquant import _donor_chunks  # noqa: E402

P = "tq_k4v3"


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TQATTN_CACHE_DIR", str(tmp_path / "cache"))


def _calibrate(lm, **kw):
    info = lm.info
    return cal.calibrate(lm.model, lm.tokenizer, preset=P, head_dim=info.head_dim,
                         num_layers=info.num_layers, vocab_size=info.vocab_size,
                         max_model_len=128, **kw)


def test_deterministic_and_cached(tmp_path):
    lm = load_model("llama-tiny", load_format="dummy")
    a, b = _calibrate(lm, use_cache=False), _calibrate(lm, use_cache=False)
    assert torch.equal(a.key_offsets, b.key_offsets) and a.key_offsets.shape == (2, 2, 16)
    assert a.errors_centered == b.errors_centered and a.errors_uncentered == b.errors_uncentered
    assert a.positions == [0, 21, 43, 64] and a.num_tokens == cal.DUMMY_TOKENS
    assert not list((tmp_path / "cache").rglob("*.pt"))        # use_cache=False writes nothing
    first, again = _calibrate(lm), _calibrate(lm)
    assert not first.cached and again.cached
    assert len(list((tmp_path / "cache" / "calibration").glob("*.pt"))) == 1
    assert torch.equal(again.key_offsets, a.key_offsets) and again.errors_centered == a.errors_centered
    # other weights, another entry
    other = load_model("llama-tiny", load_format="dummy", seed=1)
    assert cal.weights_fingerprint(other.model) != cal.weights_fingerprint(lm.model)
    assert not _calibrate(other).cached


def test_positions_cover_the_served_length():
    assert cal.pass_positions(512, 8192) == [0, 2560, 5120, 7680]
    assert cal.pass_positions(512, 512) == [0] and cal.pass_positions(512, 100) == [0]
    assert cal.attention_kl(torch.randn(4, 8, 16), k := torch.randn(2, 32, 16), k, 0.25) == 0


def _saved(tmp_path, name, edit):
    """A dummy model with edited weights, saved as a safetensors directory the engine loads."""
    lm = load_model(name, load_format="dummy")
    with torch.no_grad():
        edit(lm.model)
    out = tmp_path / "model"
    lm.model.save_pretrained(out)
    return str(out)


def _offset_layer0(model):
    # Qwen2's key bias, made a large constant: the layer's keys carry an offset
    g = torch.Generator().manual_seed(3)
    model.model.layers[0].self_attn.k_proj.bias.copy_(8 * torch.randn(32, generator=g))
    # queries large enough that q·μ matters: a path mixing centered and raw keys changes tokens
    model.model.layers[0].self_attn.q_proj.weight.mul_(20)


def test_a_key_offset_is_centered_and_the_engine_stays_exact(tmp_path):
    path = _saved(tmp_path, "qwen2-tiny", _offset_layer0)
    prompts = random_prompts([5, 40], seed=2)
    llm = LLM(path, kv_cache_dtype=P, max_model_len=128, max_num_batched_tokens=16, max_num_seqs=4)
    plan = llm.llm_engine.key_plan
    assert plan.centered_layers == [0]          # only the layer with the offset
    c = plan.calibration
    assert c.errors_uncentered[0] >= cal.CENTERING_MIN_GAIN * c.errors_centered[0]
    assert "keys centered on 1 of 2 layers [0]" in llm.describe_kv_cache()
    chunks = record_chunks(llm)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ref = ChunkedReference(path, P, plan.key_offsets, load_format="auto")
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == ref.generate(p, 8, chunks[o.request_id])
    # log-probs, to rounding: short continuations (chunks of 16, at most the dequant threshold
    # 32: decode rows over the compressed prefix, LSE-merged with the chunk) and long ones (48:
    # the dequantized prefix and the raw chunk in one FlashAttention)
    llm = LLM(path, kv_cache_dtype=P, max_model_len=128, max_num_batched_tokens=48, max_num_seqs=4)
    assert llm.llm_engine.key_plan.centered_layers == [0]
    ids = random_prompts([100], seed=5)[0]
    for chunk in (16, 48):
        torch.testing.assert_close(llm.score(ids, chunk_size=chunk), _chunked_reference_logprobs(
            P, ids, chunk, plan.key_offsets, name=path, load_format="auto"), atol=2e-4, rtol=1e-4)
    # prefix-cache hits: the engine's greedy tokens are the reference's
    chunks = record_chunks(llm)
    prompts = random_prompts([100, 40], seed=4)
    runs = [llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            for _ in range(2)]
    assert [o.num_cached_tokens for o in runs[1]] == [96, 32]
    seen = [chunks[o.request_id] for run in runs for o in run]
    assert any(a > 0 and n > 32 for a, n in seen[0])      # a long continuation
    for r, o in enumerate(runs[0] + runs[1]):
        assert o.outputs[0].token_ids == ref.generate(
            prompts[r % 2], 8, _donor_chunks(prompts + prompts, seen, r) + seen[r]), seen[r]
    # centering everywhere, or nowhere, on request
    assert LLM(path, kv_cache_dtype=P, max_model_len=128,
               kv_cache_key_centering=True).llm_engine.key_plan.centered_layers == [0, 1]
    off = LLM(path, kv_cache_dtype=P, max_model_len=128, kv_cache_key_centering=False)
    assert off.llm_engine.key_plan.key_offsets is None


def _sharpen_layer1(model):
    # keys 40x longer: the same relative codec error moves sharp attention a lot
    model.model.layers[1].self_attn.k_proj.weight.mul_(40)


def test_automatic_routing_keeps_the_outlier_layer_full_precision(tmp_path):
    config = json.loads(model_config_path("llama-tiny").read_text())
    config["num_hidden_layers"] = 4       # a median for the outlier to stand out from
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(config))
    path = _saved(tmp_path, str(tmp_path / "cfg" / "config.json"), _sharpen_layer1)
    kw = dict(kv_cache_dtype=P, max_model_len=128)
    engine = LLM(path, **kw, kv_cache_auto_skip_budget=1.0).llm_engine
    assert engine.key_plan.auto_layers == [1]
    assert [layer.backend.name for layer in engine.layers] == \
        ["TURBOQUANT", "FLASH_ATTN", "TURBOQUANT", "TURBOQUANT"]
    assert "automatic routing keeps 1 layer(s) full precision: layer 1" in engine.key_plan.routing
    assert engine.plan["full_precision_layers"] == [1]
    # a full-precision layer stores its keys as they are: never named centered
    engine = LLM(path, **kw, kv_cache_auto_skip_budget=1.0, kv_cache_key_centering=True).llm_engine
    assert engine.key_plan.auto_layers == [1] and engine.key_plan.centered_layers == [0, 2, 3]
    assert "keys centered on 3 of 4 layers [0, 2, 3]" in engine.key_plan.describe()
    assert "(full-precision layers [1] not counted)" in engine.key_plan.describe()
    # the default budget (20 % more bytes than all compressed) cannot pay for half the model
    engine = LLM(path, **kw).llm_engine
    assert engine.key_plan.auto_layers == []
    assert "outliers over the budget stay compressed: layer 1" in engine.key_plan.routing
    # a user-given list replaces automatic routing
    engine = LLM(path, **kw, kv_cache_dtype_skip_layers=[0]).llm_engine
    assert engine.key_plan.auto_layers is None and engine.plan["full_precision_layers"] == [0]


def test_soft_cap_turns_centering_off_or_is_refused(tmp_path):
    config = json.loads(model_config_path("gemma3-tiny").read_text())
    config["attn_logit_softcapping"] = 20.0
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    kw = dict(load_format="dummy", kv_cache_dtype=P, max_model_len=64)
    engine = LLM(str(path), **kw).llm_engine
    assert engine.key_plan.centered_layers == [] and engine.key_plan.auto_layers is not None
    with pytest.raises(ValueError, match=r"kv_cache_key_centering=True: model .* soft-caps its "
                                         r"attention logits \(cap 20.0\)"):
        LLM(str(path), **kw, kv_cache_key_centering=True)


def test_a_skip_index_past_the_model_fails_before_the_passes(monkeypatch):
    lm = load_model("llama-tiny", load_format="dummy")
    monkeypatch.setattr(cal, "calibrate", lambda *a, **k: pytest.fail("calibrated before checking"))
    with pytest.raises(ValueError, match=f"entry 99 is out of range for a model with {lm.info.num_layers} layers"):
        cal.plan_keys(lm.model, lm.tokenizer, lm.info, "llama-tiny", kv_cache_dtype=P,
                      skip_layers=["auto", 99], boundary_layers=None, key_centering=None,
                      auto_skip_budget=0.2, max_model_len=128)
