"""Fused q/k/v and gate/up projections (tqattn/models/fused_projections.py): the same logits as
transformers' separate projections, one GEMM per group under Dynamo, nothing kept past a step."""

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from tqattn.models import load_model  # noqa: E402
from tqattn.models.fused_projections import FusedLinear, FusedMember, fuse_projections  # noqa: E402

TINY = ["llama-tiny", "llama-tiny-hd80", "qwen2-tiny", "qwen3-tiny", "gemma3-tiny"]


def _ids(n=23):
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("name", TINY)
def test_fused_logits_match_separate_projections(name):
    lm = load_model(name, load_format="dummy", dtype="float32")
    model, ids = lm.model, _ids()
    layers = lm.config.num_hidden_layers
    n_params = sum(p.numel() for p in model.parameters())
    with torch.inference_mode():
        want = model(ids).logits
        assert fuse_projections(model) == 2 * layers
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the weights moved into the fused modules: none is held twice
    assert sum(p.numel() for p in model.parameters()) == n_params
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.k_proj, FusedMember) and isinstance(attn.qkv_proj, FusedLinear)
    assert attn.qkv_proj.weight.shape[0] == sum(
        m.out_features for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert (attn.qkv_proj.bias is not None) == (name == "qwen2-tiny")  # Qwen2's q/k/v biases
    # each step's product is released once every member took its slice
    assert all(m._x is None and m._y is None for m in model.modules()
               if isinstance(m, FusedLinear))
    assert fuse_projections(model) == 0  # nothing left to fuse


def test_groups_that_differ_are_left_alone():
    """Projections of different input sizes, or some with a bias and some without, stay apart."""
    a = nn.Module()
    a.q_proj, a.k_proj, a.v_proj = nn.Linear(8, 8), nn.Linear(8, 4, bias=False), nn.Linear(8, 4)
    b = nn.Module()
    b.gate_proj, b.up_proj = nn.Linear(8, 16), nn.Linear(6, 16)
    root = nn.ModuleList([a, b])
    assert fuse_projections(root) == 0
    assert type(a.k_proj) is nn.Linear and type(b.up_proj) is nn.Linear


def test_member_with_another_input_computes_its_own():
    """A member called with an input the group did not just read recomputes the product."""
    m = nn.Module()
    m.gate_proj, m.up_proj = nn.Linear(8, 5), nn.Linear(8, 3)
    ref_g, ref_u = m.gate_proj, m.up_proj
    fuse_projections(m)
    x, y = torch.randn(2, 8), torch.randn(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(m.gate_proj(x), ref_g(x))
        torch.testing.assert_close(m.up_proj(y), ref_u(y))
        torch.testing.assert_close(m.up_proj(x), ref_u(x))


def test_one_gemm_per_group_under_dynamo():
    """Dynamo traces the members' shared product: the fused Qwen3 graph holds 4 linears a layer
    (q/k/v, o, gate/up, down) plus the LM head, against 7 a layer unfused."""
    lm = load_model("qwen3-tiny", load_format="dummy", dtype="float32")
    model, layers = lm.model, lm.config.num_hidden_layers
    counts = []

    def backend(gm, example_inputs):
        counts.append(sum(1 for n in gm.graph.nodes
                          if n.op == "call_function" and "linear" in str(n.target)))
        return gm.forward

    def run():
        torch._dynamo.reset()
        with torch.inference_mode():
            torch.compile(type(model).forward, backend=backend)(model, input_ids=_ids(9))

    run()
    fuse_projections(model)
    run()
    torch._dynamo.reset()
    assert counts == [7 * layers + 1, 4 * layers + 1]
