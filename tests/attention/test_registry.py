import pytest
import torch

from tqattn.attention import registry
from tqattn.attention.flash_attn import FlashAttentionBackend
from tqattn.attention.registry import get_backend, register_backend, select_backend
from tqattn.attention.turboquant import TurboQuantBackend
from tqattn.quant.presets import preset_names

from .batch_utils import spec


def test_builtin_backends_are_registered_in_priority_order():
    assert get_backend("FLASH_ATTN") is FlashAttentionBackend
    assert get_backend("TURBOQUANT") is TurboQuantBackend
    names = [b.name for b in registry.registered_backends()]
    assert names[:2] == ["TURBOQUANT", "FLASH_ATTN"]


def test_unknown_backend_name_lists_the_registered_ones():
    with pytest.raises(ValueError, match="unknown attention backend 'XFORMERS'.*TURBOQUANT.*FLASH_ATTN"):
        get_backend("XFORMERS")


@pytest.mark.parametrize("kv", ["auto", "bfloat16", "float16", "float32"])
def test_full_precision_goes_to_flash_attn(kv):
    assert select_backend(spec(kv=kv)) is FlashAttentionBackend


@pytest.mark.parametrize("preset", preset_names())
def test_every_preset_goes_to_turboquant(preset):
    assert select_backend(spec(kv=preset, d=64)) is TurboQuantBackend


def test_no_backend_lists_every_reason():
    with pytest.raises(ValueError) as e:
        select_backend(spec(kv="fp8"))
    msg = str(e.value)
    assert "layers.0.attn" in msg and "'fp8'" in msg
    assert "TURBOQUANT: KV-cache dtype 'fp8'" in msg and "FLASH_ATTN: KV-cache dtype 'fp8'" in msg
    with pytest.raises(ValueError, match="TURBOQUANT: ALiBi not supported.*FLASH_ATTN: KV-cache"):
        select_backend(spec(kv="turboquant_4bit_nc", alibi=True))
    with pytest.raises(ValueError, match="FLASH_ATTN: ALiBi not supported"):
        select_backend(spec(alibi=True))
    with pytest.raises(ValueError, match="attention sinks not supported by TURBOQUANT"):
        select_backend(spec(kv="turboquant_4bit_nc", sinks=True))
    with pytest.raises(ValueError, match="cannot encode head size 6"):
        select_backend(spec(kv="turboquant_4bit_nc", d=6, hq=2, hk=1))


def test_a_named_backend_must_be_able():
    assert select_backend(spec(), backend="FLASH_ATTN") is FlashAttentionBackend
    with pytest.raises(ValueError, match="TURBOQUANT: KV-cache dtype 'auto'"):
        select_backend(spec(), backend="TURBOQUANT")


def test_register_rejects_a_second_class_under_one_name(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))

    class Other(FlashAttentionBackend):
        name = "FLASH_ATTN"

    with pytest.raises(ValueError, match="already registered"):
        register_backend(Other)
    register_backend(FlashAttentionBackend)  # the same class again is fine

    class Extra(FlashAttentionBackend):
        name = "EXTRA"

    register_backend(Extra)
    assert [b.name for b in registry.registered_backends()][-1] == "EXTRA"


def test_turboquant_refuses_unsupported_model_dtypes():
    assert "model dtype" in TurboQuantBackend.unsupported_reason(
        spec(kv="turboquant_k8v4", dtype=torch.float64))
