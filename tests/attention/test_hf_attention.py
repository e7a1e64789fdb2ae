"""The transformers hook and the ``tqattn::attention`` custom op it calls."""

from __future__ import annotations

import pytest
import torch

from tqattn.attention import hf_attention
from tqattn.attention.forward_context import ForwardContext, get_forward_context, set_forward_context
from tqattn.attention.op import attention
from tqattn.engine.kv_cache import kv_cache_groups
from tqattn.engine.model_runner import ModelRunner
from tqattn.engine.sampling import SamplingParams
from tqattn.engine.scheduler import ScheduledSeq
from tqattn.engine.sequence import Sequence

from ..engine.test_kv_cache import _layers
from ..engine.test_llm_reference import _one_thread, random_prompts  # noqa: F401


def _direct(query, key, value, layer_idx):
    """What the hook did before the custom op: the layer's impl called in place."""
    layer_idx = int(layer_idx)
    ctx = get_forward_context()
    layer = ctx.layers[layer_idx]
    return layer.impl.store_and_forward(query, key, value, ctx.kv_caches[layer_idx],
                                        ctx.metadata[layer.group])


@pytest.mark.parametrize("name,kwargs", [
    ("qwen3-tiny", {}),
    ("gemma3-tiny", dict(kv_cache_dtype="tq_k3v4", kv_cache_dtype_skip_layers=["sliding_window"])),
])
def test_op_equals_the_direct_call(monkeypatch, name, kwargs):
    pytest.importorskip("transformers")
    from tqattn import LLM

    llm = LLM(name, load_format="dummy", max_model_len=128, max_num_seqs=4,
              enable_prefix_caching=False, **kwargs)
    ids = random_prompts([70], seed=3)[0]
    calls = []

    def counting(q, k, v, layer):
        calls.append(int(layer))   # the layer's index, a 0-dim CPU buffer (a graph input)
        assert layer.device.type == "cpu" and layer.dim() == 0
        return attention(q, k, v, layer)

    monkeypatch.setattr(hf_attention, "attention", counting)
    through_op = llm.score(ids, chunk_size=16)  # a first chunk, then continuations
    n_layers = llm.llm_engine.model_info.num_layers
    assert calls == list(range(n_layers)) * 5
    monkeypatch.setattr(hf_attention, "attention", _direct)
    assert torch.equal(through_op, llm.score(ids, chunk_size=16))


def _runner_with_step():
    layers = _layers()  # FLASH_ATTN layers 0-2 (one windowed), TURBOQUANT layer 3
    runner = ModelRunner(None, layers, kv_cache_groups(layers, 16), 16, torch.device("cpu"))
    runner.allocate_kv_cache(8)
    scheduled = []
    for i, (computed, n) in enumerate([(20, 1), (0, 7), (16, 5)]):
        seq = Sequence(list(range(computed + n)), SamplingParams(temperature=0))
        seq.block_tables = [[2 * i, 2 * i + 1] for _ in runner.groups]
        scheduled.append(ScheduledSeq(seq, n, n == 1, computed))
    return runner, runner._prepare(scheduled)[2]


@pytest.mark.parametrize("layer_idx", [0, 3])  # FLASH_ATTN, TURBOQUANT
def test_opcheck(layer_idx):
    runner, metadata = _runner_with_step()

    g = torch.Generator().manual_seed(layer_idx)
    q, k, v = (torch.randn(13, h, 16, generator=g) for h in (4, 2, 2))
    layer = torch.tensor(layer_idx)
    # the same values head by head (the compiled model's layout after RoPE) and with a strided
    # last dimension: the same output, contiguous as the fake says
    heads = tuple(x.transpose(0, 1).contiguous().transpose(0, 1) for x in (q, k, v))
    spread = tuple(torch.stack((x, -x), -1)[..., 0] for x in (q, k, v))
    with set_forward_context(ForwardContext(runner.layers, runner.kv_caches, metadata)):
        expected = _direct(q, k, v, layer_idx)
        out = torch.ops.tqattn.attention(q, k, v, layer)
        # the twin op for single-head layers (Inductor's default stride constraint)
        for op in (torch.ops.tqattn.attention, torch.ops.tqattn.attention_exact_strides):
            for args in ((q, k, v), heads, spread):
                assert torch.equal(op(*args, layer), expected)
                torch.library.opcheck(op.default, (*args, layer))
    assert torch.equal(out, expected) and out.shape == q.shape and out.dtype == q.dtype
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:  # the fake impl gives the real output's metadata
        fq, fk, fv = (mode.from_tensor(x) for x in (q, k, v))
        f = torch.ops.tqattn.attention(fq, fk, fv, mode.from_tensor(layer))
    assert f.shape == out.shape and f.dtype == out.dtype and f.stride() == out.stride()


def test_hook_checks_the_plan():
    pytest.importorskip("transformers")
    from tqattn import LLM

    llm = LLM("qwen3-tiny", load_format="dummy", max_model_len=64)
    attn = llm.llm_engine.runner.model.model.layers[1].self_attn
    assert attn.tqattn_spec.layer_idx == 1
    q = torch.zeros(1, 4, 3, 32)
    with pytest.raises(RuntimeError, match="sliding_window=8.*the KV-cache plan has sliding_window=None"):
        hf_attention.tqattn_attention(attn, q, q[:, :2], q[:, :2], None, scaling=attn.scaling,
                                      sliding_window=8)
    del attn.tqattn_spec
    with pytest.raises(RuntimeError, match="no tqattn layer plan"):
        hf_attention.tqattn_attention(attn, q, q[:, :2], q[:, :2], None)


def test_use_tqattn_binds_every_planned_layer():
    pytest.importorskip("transformers")
    from tqattn.models import load_model

    model = load_model("qwen3-tiny", load_format="dummy").model
    specs = [layer.spec for layer in _layers()]  # layers 0..3: the model has only 3
    with pytest.raises(RuntimeError, match=r"no module with layer_idx for layers \[3\]"):
        hf_attention.use_tqattn(model, specs)
    hf_attention.use_tqattn(model, specs[:3])
    assert model.config._attn_implementation == "tqattn"
    assert [m.tqattn_spec for m in model.modules() if hasattr(m, "tqattn_spec")] == specs[:3]


def test_tokens_first_are_views():
    """q/k/v reach the op as views, no copy: a value slice of a fused q/k/v product ((1, T, 3·H·D)
    viewed as (1, H, T, D)) with its row stride, a head-major (1, H, T, D) buffer (what RoPE
    leaves) with its head stride."""
    qkv = torch.randn(1, 5, 3 * 2 * 4)
    v = qkv[..., 16:].view(1, 5, 2, 4).transpose(1, 2)
    rows = hf_attention._tokens_first(v)
    assert rows.data_ptr() == v.data_ptr() and rows.stride() == (24, 4, 1)
    torch.testing.assert_close(rows, v[0].transpose(0, 1))
    heads = torch.randn(1, 2, 5, 4)
    rows = hf_attention._tokens_first(heads)
    assert rows.data_ptr() == heads.data_ptr() and rows.stride() == (4, 20, 1)
