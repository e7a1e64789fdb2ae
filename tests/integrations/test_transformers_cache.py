"""TurboQuantCache (tqattn.integrations.transformers): against the engine, DynamicCache and the
preset's byte accounting; routing, sliding windows, left padding, beam reorder, crop, errors."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from tqattn import LLM, SamplingParams  # noqa: E402
from tqattn.integrations.transformers import (  # noqa: E402
    CACHE_ARGUMENT, DEFAULT_RESIDUAL_LENGTH, TurboQuantCache, TurboQuantLayer,
    TurboQuantSlidingWindowLayer)
from tqattn.models import load_model  # noqa: E402
from tqattn.quant.layout import build_layout  # noqa: E402

from ..engine.test_llm_reference import random_prompts  # noqa: E402

N = 12


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)  # past_key_values -> cache (5.2x)
    yield
    torch.set_num_threads(n)


_models = {}


def _model(name):
    if name not in _models:
        _models[name] = load_model(name, load_format="dummy") if name != "default" else load_model("default")
    return _models[name]


def left_padded(prompts, pad=0):
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def hf_generate(model, prompts, cache, n=N, pad=0):
    ids, mask = left_padded(prompts, pad)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                         eos_token_id=[], pad_token_id=pad, **{CACHE_ARGUMENT: cache})
    return out[:, ids.shape[1]:].tolist()


def engine_generate(name, prompts, preset, n=N, **kwargs):
    extra = dict(load_format="dummy", max_model_len=128) if name != "default" else {}
    llm = LLM(name, kv_cache_dtype=preset, max_num_seqs=4, **extra, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


# ---- the engine's cache, reproduced -----------------------------------------------------------

@pytest.mark.parametrize("name,preset,routing", [
    ("llama-tiny", "tq_k4v3", {}),
    ("qwen3-tiny", "turboquant_k3v4_nc", {}),
    ("gemma3-tiny", "tq_k3v4", {}),                      # sliding layers compressed too
    ("gemma3-tiny", "turboquant_4bit_nc", dict(skip_layers=["sliding_window"])),
    ("gemma3-tiny", "tq_k4v3", dict(boundary_layers=1)),
])
def test_window_0_equals_engine_with_left_padding(name, preset, routing):
    prompts = random_prompts([5, 19, 30], seed=11)   # 30 > the sliding window: windows slide
    lm = _model(name)
    engine_kw = {"kv_cache_dtype_skip_layers": routing.get("skip_layers", []),
                 "kv_cache_boundary_layers": routing.get("boundary_layers", 0)}
    llm, expected = engine_generate(name, prompts, preset, **engine_kw)
    offsets = llm.llm_engine.key_plan.key_offsets       # the engine's centered layers
    cache = TurboQuantCache(lm.model.config, preset, residual_length=0, key_offsets=offsets,
                            **routing)
    assert cache.layer_kv_cache_dtypes == [layer.spec.kv_cache_dtype for layer in llm.llm_engine.layers]
    assert hf_generate(lm.model, prompts, cache) == expected
    # the batch was left-padded to 30 tokens; every layer compressed all of it but its window
    layer = next(x for x in cache.layers if isinstance(x, TurboQuantLayer))
    assert layer.keys.shape[-2] == 0 and layer.num_compressed_tokens > 0


def test_window_0_equals_engine_on_smollm2():
    lm = _model("default")
    tok = lm.tokenizer
    msgs = [[{"role": "user", "content": "What is the capital of France?"}],
            [{"role": "user", "content": "Name a prime number."}]]
    prompts = [tok.apply_chat_template(m, add_generation_prompt=True) for m in msgs]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    # Plain codes (no centering, every layer compressed): exact greedy equality on a real model
    # holds only while no near-tie meets a float-order difference; with centered keys the second
    # prompt meets one at its 4th token (top-2 within 0.25 nats). The calibrated cache is
    # checked against the engine by KL below and token for token on the dummy models above.
    llm, expected = engine_generate("default", prompts, "tq_k4v3", n=16,
                                    kv_cache_key_centering=False, kv_cache_dtype_skip_layers=[])
    cache = TurboQuantCache(lm.model, "tq_k4v3", residual_length=0)
    assert cache.layer_kv_cache_dtypes == [x.spec.kv_cache_dtype for x in llm.llm_engine.layers]
    got = hf_generate(lm.model, prompts, cache, n=16, pad=tok.pad_token_id)
    assert got == expected
    assert tok.decode(got[0]).startswith("The capital of France is Paris")


def _teacher_forced(model, ids, cache, prefix, chunk):
    """Log-probs of ids[prefix:] fed in chunks through the cache."""
    x = torch.tensor([ids])
    with torch.inference_mode():
        rows = [model(input_ids=x[:, :prefix], use_cache=True, **{CACHE_ARGUMENT: cache}).logits[0, -1:]]
        for s in range(prefix, len(ids) - 1, chunk):
            out = model(input_ids=x[:, s:min(s + chunk, len(ids) - 1)], use_cache=True,
                        **{CACHE_ARGUMENT: cache})
            rows.append(out.logits[0])
    return torch.cat(rows).float().log_softmax(-1)


def _kl(p, q):
    return (p.exp() * (p - q)).sum(-1).mean().item()


def test_default_window_teacher_forced_top1_vs_engine():
    """SmolLM2 on the README's text: the engine scores it in 16-token chunks (each chunk reads
    the compressed cache + itself raw); the cache gets the same chunks."""
    from pathlib import Path

    lm = _model("default")
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    ids = lm.tokenizer(text)["input_ids"][:320]
    prefix, chunk = 16, 16
    llm = LLM("default", kv_cache_dtype="tq_k4v3")
    engine = llm.score(ids[:-1], chunk_size=chunk, logprobs_start=prefix - 1).float()
    # the engine's defaults (centered keys, automatic routing), reproduced by the calibration
    cache = TurboQuantCache.calibrated(lm.model, lm.tokenizer, "tq_k4v3", residual_length=0)
    assert cache.layer_kv_cache_dtypes == [x.spec.kv_cache_dtype for x in llm.llm_engine.layers]
    offsets = llm.llm_engine.key_plan.key_offsets
    assert offsets is not None and any(mu is not None for mu in offsets)
    assert all((layer.key_offset is None) == (offsets[i] is None) for i, layer in enumerate(cache.layers))
    assert all(torch.equal(layer.key_offset, offsets[i]) for i, layer in enumerate(cache.layers)
               if offsets[i] is not None)
    same = _teacher_forced(lm.model, ids, cache, prefix, chunk)
    full = _teacher_forced(lm.model, ids, DynamicCache(config=lm.model.config), prefix, chunk)
    # Window 0 is the engine's cache: the two differ only by float rounding (another order of
    # the attention sums), which a flipped quantization code now and then amplifies down the
    # text — far less than either differs from full precision (0.0012 vs 0.032 measured).
    err = _kl(full, engine)
    assert _kl(engine, same) <= 0.1 * err
    assert abs(_kl(full, same) - err) <= 0.1 * err
    assert (same.argmax(-1) == engine.argmax(-1)).float().mean() >= 0.95
    # The default window keeps the newest tokens raw, so it is closer to full precision than the
    # engine and agrees with the engine less than 99 % (0.92 measured on 640 tokens): the issue's
    # ">= 99 % with the default window" does not hold; what holds is that it is more accurate.
    ours = _teacher_forced(lm.model, ids, TurboQuantCache.calibrated(lm.model, lm.tokenizer,
                                                                      "tq_k4v3"), prefix, chunk)
    top1 = lambda a: (a.argmax(-1) == full.argmax(-1)).float().mean()  # noqa: E731
    assert top1(ours) >= top1(engine) and _kl(full, ours) < err


# ---- quantization off -------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama-tiny", "gemma3-tiny"])
def test_quantization_off_equals_dynamic_cache(name):
    model = _model(name).model
    prompts = random_prompts([7, 20], seed=5)
    expected = hf_generate(model, prompts, DynamicCache(config=model.config))
    assert hf_generate(model, prompts, TurboQuantCache(model.config, "auto")) == expected
    # a window longer than the sequence: the TurboQuant layers' own path, nothing compressed
    cache = TurboQuantCache(model.config, "tq_k4v3", residual_length=64)
    assert hf_generate(model, prompts, cache) == expected
    assert cache.stored_bytes()["compressed"] == 0
    # logits, not just tokens: bit for bit in a manual forward loop
    ids = torch.tensor(prompts[1:])
    caches = [DynamicCache(config=model.config), TurboQuantCache(model.config, "tq_k4v3", residual_length=64)]
    with torch.inference_mode():
        for c in caches:
            c.logits = [model(input_ids=ids[:, :12], **{CACHE_ARGUMENT: c}).logits]
            for t in range(12, ids.shape[1]):
                c.logits.append(model(input_ids=ids[:, t:t + 1], **{CACHE_ARGUMENT: c}).logits)
    assert all(torch.equal(a, b) for a, b in zip(caches[0].logits, caches[1].logits))


# ---- bytes ------------------------------------------------------------------------------------

def test_bytes_per_token_beyond_the_window_match_the_preset():
    model = _model("llama-tiny").model
    preset, r = "turboquant_k3v4_nc", 8
    cache = TurboQuantCache(model.config, preset, residual_length=r)
    ids = torch.tensor(random_prompts([40, 40], seed=2))
    with torch.inference_mode():
        model(input_ids=ids[:, :20], **{CACHE_ARGUMENT: cache})
        before = cache.stored_bytes()
        for t in range(20, 40):
            model(input_ids=ids[:, t:t + 1], **{CACHE_ARGUMENT: cache})
    after = cache.stored_bytes()
    info = _model("llama-tiny").info
    slot = build_layout(preset, info.head_dim).slot_bytes     # 20 B at head size 16
    per_token = slot * info.num_kv_heads * info.num_layers     # every layer compressed
    assert after["compressed"] - before["compressed"] == 20 * 2 * per_token
    assert after["compressed"] == (40 - r) * 2 * per_token
    assert after["residual"] == r * 2 * 2 * info.num_kv_heads * info.head_dim * 4 * info.num_layers  # fp32 K+V
    # the engine's accounting of the same preset
    llm = LLM("llama-tiny", load_format="dummy", kv_cache_dtype=preset, max_model_len=128,
              kv_cache_memory_bytes=1 << 20)
    assert per_token == llm.kv_cache_plan["bytes_per_token"]
    assert after["allocated"] - after["residual"] <= 1.25 * after["compressed"] + 16 * 2 * per_token


# ---- layer mechanics --------------------------------------------------------------------------

def _filled_layer(cls=TurboQuantLayer, r=4, n=37, b=3, **kw):
    layer = cls("tq_k4v3", residual_length=r, **kw)
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(b, 2, n, 16, generator=g) for _ in range(2))
    layer.update(k[:, :, :20], v[:, :, :20])
    for t in range(20, n):
        layer.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
    return layer, k, v


def _held(layer):
    ck, cv = layer.compressed.read(torch.float32)
    return torch.cat([ck, layer.keys], -2), torch.cat([cv, layer.values], -2)


def test_window_holds_the_newest_tokens_raw():
    layer, k, v = _filled_layer()
    hk, hv = _held(layer)
    assert layer.get_seq_length() == 37 and layer.num_compressed_tokens == 33
    assert torch.equal(hk[..., -4:, :], k[..., -4:, :]) and torch.equal(hv[..., -4:, :], v[..., -4:, :])
    assert not torch.equal(hk[..., :-4, :], k[..., :-4, :])
    assert (hk - k).norm() / k.norm() < 0.25   # 3-bit values, 4-bit keys


def test_reorder_and_batch_edits_move_bytes_exactly():
    layer, _, _ = _filled_layer()
    hk, hv = _held(layer)
    idx = torch.tensor([2, 0, 0])
    layer.reorder_cache(idx)
    k2, v2 = _held(layer)
    assert torch.equal(k2, hk[idx]) and torch.equal(v2, hv[idx])
    layer.batch_repeat_interleave(2)
    assert torch.equal(_held(layer)[0], hk[idx].repeat_interleave(2, 0))
    layer.batch_select_indices(torch.tensor([1, 4]))
    assert torch.equal(_held(layer)[0], hk[torch.tensor([2, 0])])


def test_crop():
    layer, _, _ = _filled_layer()
    hk, _ = _held(layer)
    layer.crop(-6)                      # 4 raw + 2 compressed tokens go
    assert layer.get_seq_length() == 31 and layer.keys.shape[-2] == 0
    assert torch.equal(_held(layer)[0], hk[..., :31, :])
    layer.crop(30)                      # transformers 5.17's positive form: the length to keep
    assert layer.get_seq_length() == 30


def test_the_window_owns_its_storage():
    # a slice of the prefill's K/V would keep the whole prompt alive in full precision
    layer = TurboQuantLayer("tq_k4v3", residual_length=4)
    k = torch.randn(1, 1, 300, 16)
    layer.update(k, k.clone())
    assert layer.keys.shape[-2] == 4
    assert layer.keys.untyped_storage().nbytes() == layer.values.untyped_storage().nbytes() == 4 * 16 * 4
    layer.update(k[..., :1, :], k[..., :1, :])
    assert layer.keys.untyped_storage().nbytes() == 4 * 16 * 4


def test_a_prefix_filled_under_inference_mode_continues_outside_it():
    model = _model("llama-tiny").model
    ids = torch.tensor(random_prompts([25], seed=5))
    cache = TurboQuantCache(model.config, "tq_k4v3", residual_length=4)
    with torch.inference_mode():
        model(input_ids=ids[:, :24], **{CACHE_ARGUMENT: cache})
    out = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, pad_token_id=0,
                         **{CACHE_ARGUMENT: cache})
    assert out.shape == (1, 28)


def test_codecs_first_built_under_inference_mode_serve_a_forward_with_gradients():
    # get_codec is cached: a codec built under inference mode is reused where autograd records
    from tqattn.attention.turboquant import get_codec

    model = _model("qwen3-tiny").model
    get_codec.cache_clear()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.inference_mode():
        model(input_ids=ids, **{CACHE_ARGUMENT: TurboQuantCache(model.config, "tq_k4v3", residual_length=0)})
    out = model(input_ids=ids, **{CACHE_ARGUMENT: TurboQuantCache(model.config, "tq_k4v3", residual_length=0)})
    out.logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    model.zero_grad(set_to_none=True)


def test_sliding_layer_keeps_what_dynamic_sliding_keeps():
    from transformers.cache_utils import DynamicSlidingWindowLayer

    ours = TurboQuantSlidingWindowLayer("tq_k4v3", sliding_window=8, residual_length=3)
    ref = DynamicSlidingWindowLayer(sliding_window=8)
    g = torch.Generator().manual_seed(1)
    for t in (5, 1, 1, 12, 1, 1, 1):
        k, v = (torch.randn(1, 2, t, 16, generator=g) for _ in range(2))
        assert ours.get_mask_sizes(t) == ref.get_mask_sizes(t)
        ok, _ = ours.update(k, v)
        rk, _ = ref.update(k, v)
        assert ok.shape == rk.shape and (ok - rk).norm() / rk.norm() < 0.25
        assert torch.equal(ok[..., -min(3, ok.shape[-2]):, :], rk[..., -min(3, ok.shape[-2]):, :])
        assert len(ours.compressed) + ours.keys.shape[-2] == ref.keys.shape[-2]
    with pytest.raises(RuntimeError, match="sliding-window layer"):
        ours.crop(-1)


def test_beam_search_runs_and_quantization_off_matches_dynamic():
    model = _model("llama-tiny").model
    ids = torch.tensor(random_prompts([9], seed=3))
    kw = dict(max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0)
    ref = model.generate(input_ids=ids, **kw)
    got = model.generate(input_ids=ids, **kw, **{CACHE_ARGUMENT: TurboQuantCache(model.config, "tq_k4v3",
                                                                                 residual_length=32)})
    assert torch.equal(ref, got)
    out = model.generate(input_ids=ids, **kw, **{CACHE_ARGUMENT: TurboQuantCache(model.config, "tq_k4v3",
                                                                                 residual_length=0)})
    assert out.shape == ref.shape


# ---- errors -----------------------------------------------------------------------------------

def test_bad_arguments_are_named():
    config = _model("llama-tiny").model.config
    with pytest.raises(ValueError, match="unknown preset 'tq_k9'"):
        TurboQuantCache(config, "tq_k9")
    with pytest.raises(ValueError, match="residual_length must be an int >= 0, got -1"):
        TurboQuantCache(config, residual_length=-1)
    with pytest.raises(ValueError, match="kv_cache_dtype_skip_layers entry 7 is out of range"):
        TurboQuantCache(config, skip_layers=[7])
    with pytest.raises(ValueError, match="would apply to no layer"):
        TurboQuantCache(config, skip_layers=[0, 1])
    with pytest.raises(TypeError, match="needs the model's config"):
        TurboQuantCache("llama")
    with pytest.raises(ValueError, match="skip_layers 'auto' needs the model's calibration; use "
                                         r"TurboQuantCache\.calibrated"):
        TurboQuantCache(config, skip_layers=["auto"])
    with pytest.raises(ValueError, match=r"key_offsets \[\(2, 8\), None\]; expected one "
                                         r"\(num_kv_heads, head_dim\) = \(2, 16\) tensor or None"):
        TurboQuantCache(config, key_offsets=[torch.zeros(2, 8), None])
    assert DEFAULT_RESIDUAL_LENGTH >= 0


def test_another_models_cache_is_refused_and_crop_keeps_layers_aligned():
    llama, qwen = _model("llama-tiny").model, _model("qwen3-tiny").model
    cache = TurboQuantCache(llama.config, "tq_k4v3", residual_length=2, skip_layers=[1])
    with pytest.raises(ValueError, match="built for a model of 2 layers with 2 KV heads of size 16; "
                                         "got layer 0 with key_states of shape"):
        qwen(input_ids=torch.tensor([[1, 2, 3]]), **{CACHE_ARGUMENT: cache})
    cache = TurboQuantCache(llama.config, "tq_k4v3", residual_length=2, skip_layers=[1])
    llama(input_ids=torch.tensor(random_prompts([20], seed=1)), **{CACHE_ARGUMENT: cache})
    cache.crop(5)   # the older positive form: every layer, the full-precision one too, keeps 5
    assert [layer.get_seq_length() for layer in cache.layers] == [5, 5]
    offsets = [torch.zeros(2, 16).numpy(), None]   # numpy offsets are taken as tensors
    cache = TurboQuantCache(llama.config, "tq_k4v3", key_offsets=offsets)
    llama(input_ids=torch.tensor([[1, 2, 3]]), **{CACHE_ARGUMENT: cache})


def test_architectures_it_cannot_hold_are_refused_at_construction():
    # latent (MLA) attention, a state-space model and an encoder-decoder: a clear ValueError
    # when the cache is built, not an AttributeError or a shape error in the first forward
    from transformers import DeepseekV3Config, MambaConfig, T5Config

    for config, words in [(DeepseekV3Config(num_hidden_layers=2), "latent \\(MLA\\) attention"),
                          (MambaConfig(num_hidden_layers=2), "no num_attention_heads"),
                          (T5Config(num_layers=2), "no max_position_embeddings")]:
        with pytest.raises(ValueError, match="TurboQuantCache cannot hold this model's layers: .*" + words):
            TurboQuantCache(config, "tq_k4v3")


# ---- key centering ----------------------------------------------------------------------------

def test_centered_layer_returns_its_keys_and_spends_the_bits_on_what_varies():
    """Keys = a large constant + small noise: with the constant as offset the layer stores the
    noise and adds the constant back; without, the codes are spent on the constant."""
    g = torch.Generator().manual_seed(0)
    mu = 8 * torch.randn(2, 32, generator=g)
    k = mu[None, :, None, :] + torch.randn(1, 2, 40, 32, generator=g)
    v = torch.randn(1, 2, 40, 32, generator=g)
    errs = []
    for offset in (mu, None):
        layer = TurboQuantLayer("tq_k4v3", residual_length=0, key_offset=offset)
        keys, _ = layer.update(k, v)             # a prompt: read raw, then compressed
        assert torch.equal(keys, k)
        keys, _ = layer.update(k[..., :1, :], v[..., :1, :])   # a decode: all read back
        errs.append(float((keys[..., :40, :] - k).norm() / k.norm()))
    assert errs[0] < errs[1] / 4, errs
