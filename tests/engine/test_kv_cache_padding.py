"""kv_cache_pad_head_size: compressed layers of a head size the tensor-core decode kernel lacks
(80 here) store zero-padded vectors of its next size (128); full-precision layers do not."""

import pytest
import torch

pytest.importorskip("transformers")

from tqattn import LLM, SamplingParams  # noqa: E402
from tqattn.engine.llm_engine import EngineArgs  # noqa: E402

SMALL = dict(load_format="dummy", dtype="float32", max_model_len=160, max_num_seqs=4,
             max_num_batched_tokens=64, enable_prefix_caching=False)


def test_padded_layers_bytes_and_generation(caplog):
    import logging

    from tqattn.quant.layout import build_layout

    kw = dict(kv_cache_dtype="tq_k4v3", kv_cache_dtype_skip_layers=[1],
              kv_cache_boundary_layers=0, **SMALL)
    compact = LLM("llama-tiny-hd80", **kw).llm_engine
    with caplog.at_level(logging.INFO, logger="tqattn"):
        llm = LLM("llama-tiny-hd80", kv_cache_pad_head_size=True, **kw)
    # the logged cost is the slots' (the norms do not grow with the head size), not 128 / 80
    grow = build_layout("tq_k4v3", 128).slot_bytes / build_layout("tq_k4v3", 80).slot_bytes
    assert f"({grow:.2f}x their bytes" in caplog.text and grow < 1.6
    padded = llm.llm_engine
    sizes = [layer.spec.cache_head_size for layer in padded.layers]
    assert sizes == [128, 80]  # layer 1 keeps its full-precision cache
    # the plan says which group is padded
    from tqattn.engine.llm_engine import format_plan

    text = format_plan(padded.plan)
    assert text.count("(head size 80 stored zero-padded to 128)") == 1
    assert "zero-padded" not in format_plan(compact.plan)
    assert [layer.spec.cache_head_size for layer in compact.layers] == [80, 80]
    # the compressed group's pages grow with the padding (128 / 80, less the fixed norms);
    # the full-precision group's stay
    grown = sorted(g.page_bytes for g in padded.kv_cache_config.groups)
    before = sorted(g.page_bytes for g in compact.kv_cache_config.groups)
    assert grown[1] == before[1] and 1.4 < grown[0] / before[0] <= 128 / 80
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3, 70))}, {"prompt_token_ids": list(range(5, 30))}]
    res = llm.generate(prompts, params)
    assert [len(r.outputs[0].token_ids) for r in res] == [8, 8]
    with pytest.raises(ValueError,
                       match="kv_cache_pad_head_size must be True, False or None, got 1"):
        EngineArgs(kv_cache_pad_head_size=1)


def test_padded_engine_equals_the_chunked_reference_over_the_padded_codec():
    """Greedy tokens of the padded engine = attention over K/V zero-padded to 128, encoded and
    decoded by the 128 codec and cut back to the head size (the rule, outside the engine)."""
    from .test_llm_reference import (ChunkedReference, engine_key_offsets, random_prompts,
                                     record_chunks)

    kw = dict(kv_cache_dtype="tq_k4v3", kv_cache_boundary_layers=0, **SMALL)
    llm = LLM("llama-tiny-hd80", kv_cache_pad_head_size=True, **kw)
    assert [layer.spec.cache_head_size for layer in llm.llm_engine.layers] == [128, 128]
    prompts = random_prompts([1, 17, 40], seed=4)
    chunks = record_chunks(llm)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    dtypes = [layer.spec.kv_cache_dtype for layer in llm.llm_engine.layers]
    ref = ChunkedReference("llama-tiny-hd80", dtypes, engine_key_offsets(llm), pad_to=128,
                           dtype="float32")
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == ref.generate(p, 8, chunks[o.request_id])


def _resolve(monkeypatch, gpu: bool, dtype="tq_k4v3", heads=(32, 8), head_dim=80, softcap=0.0,
             pad=None):
    """resolve_pad_head_size on a stand-in config, with the tensor-core check answering ``gpu``."""
    from types import SimpleNamespace
    from tqattn.engine.llm_engine import resolve_pad_head_size
    from tqattn.kernels import step
    monkeypatch.setattr(step, "tensor_cores", lambda device: gpu)
    info = SimpleNamespace(head_dim=head_dim, attn_logit_softcapping=softcap)
    args = EngineArgs(kv_cache_dtype=dtype, kv_cache_pad_head_size=pad)
    return resolve_pad_head_size(args, info, SimpleNamespace(num_q_heads=heads[0],
                                                             num_kv_heads=heads[1]), "cpu")


def test_pad_head_size_default_follows_the_tensor_core_kernel(monkeypatch):
    # default: padded exactly where the tensor-core kernel would then run the layers
    assert _resolve(monkeypatch, gpu=True) == 128
    assert _resolve(monkeypatch, gpu=True, head_dim=96, dtype="turboquant_k3v4_nc") == 128
    assert _resolve(monkeypatch, gpu=False) is None               # CPU, or no Gluon / sm_80
    assert _resolve(monkeypatch, gpu=True, heads=(36, 4)) is None  # GQA group 9 > 8
    assert _resolve(monkeypatch, gpu=True, softcap=30.0) is None   # soft-cap: portable kernel
    assert _resolve(monkeypatch, gpu=True, dtype="auto") is None
    assert _resolve(monkeypatch, gpu=True, head_dim=128) is None   # a kernel size already
    assert _resolve(monkeypatch, gpu=True, dtype="tq_k3o4v3.5") is None  # no tensor-core layout
    assert _resolve(monkeypatch, gpu=True, dtype="tq_k4v4_qjl") is None  # no Triton kernel
    # set explicitly: as asked, whatever the device
    assert _resolve(monkeypatch, gpu=True, pad=False) is None
    assert _resolve(monkeypatch, gpu=False, pad=True) == 128


def test_padding_default_is_compact_on_cpu():
    llm = LLM("llama-tiny-hd80", kv_cache_dtype="tq_k4v3", kv_cache_boundary_layers=0, **SMALL)
    assert [layer.spec.cache_head_size for layer in llm.llm_engine.layers] == [80, 80]


@pytest.mark.gpu
def test_padding_default_on_cuda_runs_the_tensor_core_kernel(monkeypatch):
    """On a GPU the head-80 model's compressed layers are padded by default and its decode steps
    run the tensor-core kernel; the compact layout (pad off) runs the portable one."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from tqattn.kernels import step
    calls = []
    dispatch = step.tensor_core_decode

    def spy(spec, q, hk, plain):
        calls.append((spec.codec.head_dim, plain, dispatch(spec, q, hk, plain)))
        return calls[-1][2]

    monkeypatch.setattr(step, "tensor_core_decode", spy)
    kw = dict(SMALL, dtype="bfloat16", device="cuda", enforce_eager=True, kv_cache_dtype="tq_k4v3",
              kv_cache_boundary_layers=0, kv_cache_memory_bytes=64 << 20)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3, 70))}, {"prompt_token_ids": list(range(5, 30))}]
    for pad, size in ((None, 128), (False, 80)):
        calls.clear()
        llm = LLM("llama-tiny-hd80", kv_cache_pad_head_size=pad, **kw)
        assert [layer.spec.cache_head_size for layer in llm.llm_engine.layers] == [size, size]
        res = llm.generate(prompts, params, use_tqdm=False)
        assert [len(r.outputs[0].token_ids) for r in res] == [8, 8]
        assert {c[0] for c in calls} == {size}
        decodes = [mma for _, plain, mma in calls if plain]  # one query row per sequence
        assert decodes and all(mma == (size == 128) for mma in decodes)
        del llm


def test_default_padding_leaves_sliding_window_layers_compact(monkeypatch):
    """Where padding is on by default, only the layers the tensor-core kernel would run are
    padded: gemma3-tiny's sliding-window layers (0-2) stay compact, its full layer (3) is padded
    (head size 16 → 64 here, the tensor-core check answered yes on the CPU); asked for
    explicitly, every compressed layer is."""
    from tqattn.attention.turboquant import padded_head_size
    from tqattn.engine import llm_engine
    monkeypatch.setattr(llm_engine, "tensor_core_padding",
                        lambda preset, head_size, *args: padded_head_size(head_size))
    kw = dict(SMALL, kv_cache_dtype="tq_k4v3", kv_cache_dtype_skip_layers=[],
              kv_cache_boundary_layers=0)
    for pad, sizes in ((None, [16, 16, 16, 64]), (True, [64, 64, 64, 64])):
        llm = LLM("gemma3-tiny", kv_cache_pad_head_size=pad, **kw)
        assert [layer.spec.cache_head_size for layer in llm.llm_engine.layers] == sizes
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": list(range(3, 40))}], params, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4


def test_calibration_measures_the_padded_codec_and_its_bytes(monkeypatch, tmp_path):
    """The start-up calibration judges a padded layer through the codec its cache uses (128
    here) and counts the padded slot in the automatic-routing budget."""
    from types import SimpleNamespace

    from tqattn.engine import calibration
    from tqattn.quant.layout import build_layout

    monkeypatch.setenv("TQATTN_CACHE_DIR", str(tmp_path))
    seen = []
    run = calibration.run_calibration
    monkeypatch.setattr(calibration, "run_calibration",
                        lambda *a, **k: seen.append(a[6]) or run(*a, **k))
    kw = dict(kv_cache_dtype="tq_k4v3", kv_cache_boundary_layers=0, **SMALL)
    plans = {pad: LLM("llama-tiny-hd80", kv_cache_pad_head_size=pad, **kw).llm_engine.key_plan
             for pad in (False, True)}
    assert seen == [None, [128, 128]]
    # zero-padded keys through a 128-coordinate rotation: the padded codec's own errors
    assert plans[True].calibration.errors_centered != plans[False].calibration.errors_centered

    info = SimpleNamespace(num_layers=4, sliding_windows=[None] * 4, num_kv_heads=2, head_dim=80)
    errors = [5.0, 0.01, 0.01, 0.01]
    for dims, d in ((None, 80), ([128] * 4, 128)):
        slot = build_layout("tq_k4v3", d).slot_bytes
        layers, line = calibration.choose_auto_layers(errors, info, "tq_k4v3", ["auto"], 0, 1.0, dims)
        assert layers == [0] and line.endswith(f"{2 * (320 - slot)} of {2 * 4 * slot} extra bytes/token")
