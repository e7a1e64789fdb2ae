"""The compiled model forward (CPU), the compile switches, start-up parts, compilation counts."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from tqattn.attention import op
from tqattn.engine import compilation
from tqattn.engine.llm_engine import EngineArgs, resolve_compile_model, resolve_fuse_projections

from .test_llm_reference import _one_thread, random_prompts  # noqa: F401

pytest.importorskip("transformers")

from tqattn import LLM, SamplingParams  # noqa: E402

SMALL = dict(load_format="dummy", max_model_len=160, max_num_seqs=4, max_num_batched_tokens=64,
             enable_prefix_caching=False)
PARTS = {"load", "calibration", "compile", "kv_cache", "warmup", "cudagraph_capture",
         "total"}


@pytest.fixture(scope="module")
def compiled():
    """qwen3-tiny compiled on CPU (Inductor's C++ backend), and the warm-up steps it ran."""
    from tqattn.engine import llm_engine

    steps = []
    with pytest.MonkeyPatch.context() as mp:
        run = llm_engine.run_warmup
        mp.setattr(llm_engine, "run_warmup", lambda runner, s: steps.extend(s) or run(runner, s))
        llm = LLM("qwen3-tiny", compile_model=True, kv_cache_dtype="turboquant_k3v4_nc", **SMALL)
    return llm, steps


def _logits_at(llm, lengths, keep):
    """Drive the runner's forward at several token counts (fresh prompts, no cache reuse)."""
    runner = llm.llm_engine.runner
    out = []
    for n, k in zip(lengths, keep):
        batch = runner.dummy_batch([(0, n)])
        batch[0].seq.token_ids = random_prompts([n], seed=n)[0]
        ids, pos, md, _ = runner._prepare(batch)
        with torch.inference_mode():
            out.append(runner.forward(ids, pos, md, list(range(n - k, n))))
    return out


@pytest.mark.slow
def test_compiled_equals_eager_without_recompiles(compiled):
    llm, _ = compiled
    eager = LLM("qwen3-tiny", kv_cache_dtype="turboquant_k3v4_nc", **SMALL)
    assert llm.llm_engine.runner.compile_model and not eager.llm_engine.runner.compile_model
    assert llm.llm_engine.compilation_counts()["total"] == 0
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    lengths, keep = [1, 2, 17, 64, 3, 16, 33], [1, 2, 1, 5, 3, 16, 0]
    for a, b in zip(_logits_at(llm, lengths, keep), _logits_at(eager, lengths, keep)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    # a teacher-forced pass (first chunk, continuations) and generation (decodes, mixed steps)
    ids = random_prompts([90], seed=1)[0]
    torch.testing.assert_close(llm.score(ids, chunk_size=24), eager.score(ids, chunk_size=24),
                               atol=2e-5, rtol=1e-5)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([3, 40, 17, 100, 1], seed=2)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def run(m):
        return [o.outputs[0].token_ids for o in m.generate(prompts, params, use_tqdm=False)]

    assert run(llm) == run(eager)
    counts = llm.llm_engine.compilation_counts()
    assert counts["dynamo"] == 0, counts["dynamo_frames"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert not compilation.graph_breaks()


@pytest.mark.slow
@pytest.mark.parametrize("name,kv_cache_dtype,graphs", [
    ("llama-tiny", "auto", 2),
    ("gemma3-tiny", "tq_k3v4", 4),   # one layer class, sliding-window and global layers
])
def test_layers_share_their_compiled_graph(name, kv_cache_dtype, graphs):
    """Regional compilation: every decoder layer runs the graph compiled for its class (and
    attention kind), whatever its index, one for one-token steps and one for the rest; the same
    log-probs as eager."""
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    llm = LLM(name, compile_model=True, kv_cache_dtype=kv_cache_dtype, **SMALL)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == graphs
    eager = LLM(name, kv_cache_dtype=kv_cache_dtype, **SMALL)
    ids = random_prompts([90], seed=5)[0]
    for chunk in (1, 24):
        torch.testing.assert_close(llm.score(ids, chunk_size=chunk),
                                   eager.score(ids, chunk_size=chunk), atol=2e-5, rtol=1e-5)
    assert llm.llm_engine.compilation_counts()["total"] == 0 and not compilation.graph_breaks()


@pytest.mark.slow
def test_startup_of_a_compiled_engine(compiled):
    llm, steps = compiled
    times = llm.llm_engine.startup_times
    assert set(times) == PARTS and all(v >= 0 for v in times.values())
    assert times["total"] == pytest.approx(sum(v for k, v in times.items() if k != "total"), rel=0.05)
    assert times["compile"] > times["warmup"]  # compiling is the first forward's work
    assert steps and steps == [tuple(s) for s in steps]  # the warm-up ran, with its steps


def test_switches(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_compile_model(EngineArgs(), cuda) is True
    assert resolve_compile_model(EngineArgs(), cpu) is False
    assert resolve_compile_model(EngineArgs(enforce_eager=True), cuda) is False
    assert resolve_compile_model(EngineArgs(compile_model=False), cuda) is False
    assert resolve_compile_model(EngineArgs(compile_model=True), cpu) is True
    with pytest.raises(ValueError, match="cannot be combined with compile_model=True"):
        EngineArgs(enforce_eager=True, compile_model=True)
    with pytest.raises(ValueError, match="compile_model must be True or False or None, got 'yes'"):
        EngineArgs(compile_model="yes")
    with pytest.raises(ValueError, match="enforce_eager must be True or False, got 1"):
        EngineArgs(enforce_eager=1)

    # eager on CPU by default: the plain forward, no Dynamo, no warm-up, no graphs
    starts = []
    monkeypatch.setattr(torch, "compile", lambda *a, **k: starts.append(a) or a[0])
    for kwargs in ({}, dict(enforce_eager=True), dict(compile_model=False)):
        llm = LLM("qwen3-tiny", **kwargs, **SMALL)
        runner = llm.llm_engine.runner
        assert not runner.compile_model and runner._logits is compilation.model_logits
        assert not runner.graphs and llm.llm_engine.startup_times["compile"] < 0.05
    assert not starts
    llm = LLM("qwen3-tiny", compile_model=True, **SMALL)  # torch.compile stubbed: no compile time
    assert starts and llm.llm_engine.runner.compile_model


def test_compilation_counts_after_startup(caplog):
    llm = LLM("qwen3-tiny", **SMALL)
    engine = llm.llm_engine
    assert engine.compilation_counts() == {"dynamo": 0, "triton": 0, "total": 0,
                                           "dynamo_frames": [], "triton_kernels": []}

    @torch.compile(backend="eager")
    def late(x):
        return x * 2

    late(torch.ones(3))
    listener = pytest.importorskip("triton").knobs.compilation.listener

    def fake_kernel():
        pass
    fake_kernel.__module__ = "tqattn.kernels.fake"
    fake_kernel.__name__ = "_fake_kernel"
    fake_kernel.arg_names = ["x_ptr", "n", "BLOCK"]
    # Triton calls its listener from compile() on a new kernel variant (never under TRITON_INTERPRET)
    for n_attrs in ({}, {(1,): [["tt.divisibility", 16]]}):
        src = type("Src", (), {"fn": fake_kernel, "constants": {(2,): 64}, "attrs": n_attrs})()
        listener(src=src, metadata={}, metadata_group={}, times=None, cache_hit=False)
    counts = engine.compilation_counts()
    assert (counts["dynamo"], counts["triton"], counts["total"]) == (1, 2, 3)
    assert "late" in counts["dynamo_frames"][0]
    # each build says how it differs from the closest earlier one: which argument specialized
    assert counts["triton_kernels"] == [
        "tqattn.kernels.fake._fake_kernel (the kernel's first build)",
        "tqattn.kernels.fake._fake_kernel (n: plain -> tt.divisibility=16)"]
    prompt = {"prompt_token_ids": [5, 6, 7]}
    with caplog.at_level(logging.WARNING, logger="tqattn.engine.compilation"):
        for _ in range(2):  # the next model call logs each new name once
            llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    warnings = [r.getMessage() for r in caplog.records if "after start-up" in r.getMessage()]
    assert len(warnings) == 2 and "_fake_kernel" in warnings[1] and "late" in warnings[0]


def test_another_engines_startup_is_no_stall(monkeypatch, caplog):
    """A second engine of the process compiles its model while it starts: neither engine counts
    or logs that as a compilation after its start-up; a compile after both started counts for
    both."""
    compile_ = torch.compile
    # Dynamo traces the layers for real; the eager backend keeps it quick on the CPU
    monkeypatch.setattr(torch, "compile",
                        lambda fn, **kw: compile_(fn, backend="eager", dynamic=kw.get("dynamic")))
    first = LLM("qwen3-tiny", **SMALL)
    frames = compilation.mark()[0]
    second = LLM("qwen3-tiny", compile_model=True, **SMALL)
    assert compilation.mark()[0] > frames  # the second start-up compiled frames
    prompt = {"prompt_token_ids": [5, 6, 7]}
    with caplog.at_level(logging.WARNING, logger="tqattn.engine.compilation"):
        for llm in (first, second):
            llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    assert not [r for r in caplog.records if "after start-up" in r.getMessage()]
    for llm in (first, second):
        assert llm.llm_engine.compilation_counts()["total"] == 0
        assert llm.llm_engine.num_compilations() == 0

    @compile_
    def late(x):
        return x * 2

    late(torch.ones(3))
    for llm in (first, second):
        counts = llm.llm_engine.compilation_counts()
        assert counts["dynamo"] == llm.llm_engine.num_compilations() == 1
        assert "late" in counts["dynamo_frames"][0]


def test_triton_listener_chains_the_previous_one():
    seen = []
    listener = compilation._on_triton_compile(lambda **kw: seen.append(kw["src"]))

    def k():
        pass
    k.__module__ = "m"
    src = type("Src", (), {"fn": k})()
    before = compilation.mark()
    listener(src=src, metadata={}, metadata_group={}, times=None, cache_hit=True)
    assert seen == [src] and compilation.since(before)["triton_kernels"][-1].startswith("m.k (")


def test_kernel_builds_name_the_argument_types_they_differ_in():
    """A build for another pointer dtype (e.g. a float32 and a bfloat16 engine in one process)
    says so, instead of looking like the same specialization built twice."""
    listener = compilation._on_triton_compile(None)

    def k():
        pass
    k.__module__, k.arg_names = "m_types", ["x_ptr", "n", "BLOCK"]
    before = compilation.mark()
    for x, attrs in (("*bf16", {}), ("*fp32", {}), ("*fp32", {(0,): [["tt.divisibility", 16]]})):
        src = type("Src", (), {"fn": k, "signature": {"x_ptr": x, "n": "i32", "BLOCK": "constexpr"},
                               "constants": {(2,): 64}, "attrs": attrs})()
        listener(src=src, metadata={}, metadata_group={}, times=None, cache_hit=False)
    assert compilation.since(before)["triton_kernels"] == [
        "m_types.k (the kernel's first build)", "m_types.k (x_ptr: *bf16 -> *fp32)",
        "m_types.k (x_ptr: *bf16/*fp32 -> *fp32 tt.divisibility=16)"]


def test_cache_dirs(monkeypatch, tmp_path):
    monkeypatch.setenv("TQATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/mine")
    ops = f"ops-{op.fingerprint()}"
    assert compilation.use_cache_dirs() == {
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor" / ops), "TRITON_CACHE_DIR": "/mine"}


def test_ops_fingerprint_sees_tags():
    """Inductor's cache key does not see an op's tags: the cache folder's fingerprint must."""
    real = op.attention._opoverload

    def like(tags):  # the attention op's schema with other tags
        return SimpleNamespace(_opoverload=SimpleNamespace(_schema=real._schema, tags=tags))

    fps = [op.fingerprint(ops) for ops in [(like(real.tags),), (like([]),),
                                           (op.attention_exact_strides,)]]
    assert fps[0] == op.fingerprint((op.attention,))
    assert len(set(fps)) == 3 and all(len(f) == 12 for f in fps)


def test_builds_since_tells_disk_cache_loads_from_compiles():
    listener = compilation._on_triton_compile(None)

    def k():
        pass
    k.__module__ = "m"
    src = type("Src", (), {"fn": k})()
    before = compilation.mark()
    for hit in (True, True, False):
        listener(src=src, metadata={}, metadata_group={}, times=None, cache_hit=hit)
    assert compilation.builds_since(before) == {"dynamo": 0, "triton_loaded": 2,
                                                "triton_compiled": 1}


def test_compile_layers_raises_dynamos_recompile_limit():
    """Every layer class, dtype and engine of a process adds a graph to one Dynamo cache (the
    layers share their checkpointing wrapper's code): at Dynamo's default limit of 8 the ninth
    would run eagerly. compile_layers raises the limit and never lowers a higher one."""
    from torch import nn

    class Layer(nn.Module):
        def __init__(self, idx):
            super().__init__()
            self.attn = nn.Module()
            self.attn.tqattn_spec = idx

    model = nn.Module()
    model.layers = nn.ModuleList([Layer(0), Layer(1)])
    # torch's config.patch, not monkeypatch: the config module hides an attribute monkeypatch
    # restores
    with torch._dynamo.config.patch(recompile_limit=8):
        assert compilation.compile_layers(model) == 1
        assert torch._dynamo.config.recompile_limit == compilation.RECOMPILE_LIMIT > 8
    with torch._dynamo.config.patch(recompile_limit=1000):
        compilation.compile_layers(model)
        assert torch._dynamo.config.recompile_limit == 1000



def test_fuse_projections_switch_and_scores():
    """fuse_projections: on CUDA without tensor parallelism by default, off on CPU; an engine
    with fused projections, eager or compiled (one Dynamo graph for all layers), scores a prompt
    as one without (float32; token by token through the decode path, and in chunks)."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_fuse_projections(EngineArgs(), cuda) is True
    assert resolve_fuse_projections(EngineArgs(), cpu) is False
    assert resolve_fuse_projections(EngineArgs(tensor_parallel_size=2), cuda) is False
    assert resolve_fuse_projections(EngineArgs(fuse_projections=True), cpu) is True
    assert resolve_fuse_projections(EngineArgs(fuse_projections=False), cuda) is False
    with pytest.raises(ValueError, match="fuse_projections must be True, False or None, got 1"):
        EngineArgs(fuse_projections=1)
    with pytest.raises(ValueError, match="fuse_projections=True needs tensor_parallel_size=1"):
        EngineArgs(fuse_projections=True, tensor_parallel_size=2)
    ids = random_prompts([70], seed=7)[0]
    scores = []
    compilation.install()
    for fuse, compiled in ((False, False), (True, False), (True, True)):
        before = compilation.mark()
        llm = LLM("qwen3-tiny", dtype="float32", kv_cache_dtype="turboquant_k3v4_nc",
                  fuse_projections=fuse, compile_model=compiled, **SMALL)
        attn = llm.llm_engine.runner.model.model.layers[0].self_attn
        assert hasattr(attn, "qkv_proj") is fuse
        # the fused members keep one compiled graph (and the one-token graph) for every layer
        assert compilation.builds_since(before)["dynamo"] == 2 * int(compiled)
        scores.append([llm.score(ids, chunk_size=c) for c in (1, 24)])
    for got in scores[1:]:
        for a, b in zip(got, scores[0]):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    assert not compilation.graph_breaks()
