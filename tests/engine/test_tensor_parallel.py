"""Tensor parallelism on CPU: two gloo ranks against one process, bad sizes, the workers' lifecycle.

Greedy tokens of two ranks must equal one process's, or first differ where one process's top-2
log-prob margin is below 1e-4 (a near-tie the all-reduce's summation order may flip).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tqattn import LLM, SamplingParams
from tqattn.engine.llm_engine import EngineArgs
from tqattn.engine.parallel import TensorParallelError
from tqattn.models.sharding import split_heads

ROOT = Path(__file__).resolve().parents[2]
# Every layer compressed uncentered (centering and automatic routing off) unless a test asks
# for the start-up calibration.
ENGINE = dict(load_format="dummy", device="cpu", max_model_len=256, kv_cache_memory_bytes=1 << 22,
              max_num_seqs=4, max_num_batched_tokens=64, kv_cache_key_centering=False,
              kv_cache_dtype_skip_layers=[])
# Short prompts, one over the 64-token step budget (chunked prefill, mixed steps).
PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(n)] for i, n in enumerate([5, 30, 90])]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
MARGIN = 1e-4
# In-process ranks: transformers puts the mesh on a visible GPU, so CPU ranks need a GPU-less host
# (the subprocess test below hides the GPUs and runs anywhere).
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU ranks need no visible GPU; "
                              "test_tensor_parallel_gpu.py covers tensor parallelism on GPUs")


def generate(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def assert_greedy_agrees(one: LLM, tokens_tp: list[list[int]], tokens_one: list[list[int]]) -> None:
    assert [len(t) for t in tokens_tp] == [len(t) for t in tokens_one] == [GREEDY.max_tokens] * len(PROMPTS)
    for prompt, a, b in zip(PROMPTS, tokens_tp, tokens_one):
        if a == b:
            continue
        k = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        logprobs = one.score(prompt + b[:k])[-1]
        top2 = torch.topk(logprobs, 2).values
        margin = float(top2[0] - top2[1])
        assert margin < MARGIN, (f"two ranks differ from one process at token {k} ({a[k]} vs {b[k]}) "
                                 f"where the top-2 margin is {margin:.3g} >= {MARGIN}")


def worker_pids(llm: LLM) -> list[int]:
    return [p.pid for p in llm.llm_engine.workers.procs]


def assert_multicast_off(pid: int) -> None:
    """The lent multi-GPU machines need NCCL's NVLink multicast off in every rank's process."""
    env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
    assert (env.get("NCCL_NVLS_ENABLE"), env.get("TORCH_SYMM_MEM_DISABLE_MULTICAST")) == ("0", "1"), pid
    assert (os.environ.get("NCCL_NVLS_ENABLE"), os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST")) == ("0", "1")


def assert_gone(pids: list[int], within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in pids if Path(f"/proc/{pid}").exists()]
    assert not left, f"worker processes {left} outlived their engine"


# ---- sizes ------------------------------------------------------------------------------------

def test_split_heads_shards_replicates_or_refuses():
    s = split_heads(32, 8, 4)
    assert (s.num_q_heads, s.num_kv_heads, s.kv_head_replicas) == (8, 2, 1)
    s = split_heads(64, 8, 16)  # fewer KV heads than ranks: each on 2 ranks
    assert (s.num_q_heads, s.num_kv_heads, s.kv_head_replicas) == (4, 1, 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 cannot split the model's 3 KV heads.*allowed"
                                         r" tensor_parallel_size for this model: 1, 3"):
        split_heads(6, 3, 2)
    with pytest.raises(ValueError, match=r"does not divide the model's 4 attention heads.*: 1, 2, 4"):
        split_heads(4, 2, 3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=8 is more than the model's 4 attention heads"):
        split_heads(4, 2, 8)


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "2"])
def test_engine_args_reject_a_bad_tensor_parallel_size(bad):
    with pytest.raises(ValueError, match=rf"tensor_parallel_size must be a positive integer.*{bad!r}"):
        EngineArgs(model="llama-tiny", tensor_parallel_size=bad)


@pytest.mark.parametrize("tp, message", [
    (3, r"tensor_parallel_size=3 does not divide the model's 4 attention heads"),
    (8, r"tensor_parallel_size=8 is more than the model's 4 attention heads"),
])
def test_a_size_the_model_cannot_split_fails_before_any_process_starts(tp, message):
    children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
    before = children.read_text().split()
    with pytest.raises(ValueError, match=message):
        LLM("llama-tiny", tensor_parallel_size=tp, **ENGINE)
    assert children.read_text().split() == before  # no worker was started


def test_a_named_gpu_other_than_the_first_is_refused(monkeypatch):
    # rank r runs on cuda:r: device="cuda:1" would otherwise run rank 0 on cuda:0 unannounced.
    # Two GPUs pretended: the refusal comes before anything touches one.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 runs rank r on cuda:r; "
                                         r"device='cuda:1' names one GPU"):
        LLM("llama-tiny", tensor_parallel_size=2, **dict(ENGINE, device="cuda:1"))


def test_cli_flag_rejects_zero(capsys):
    from tqattn.cli import main

    with pytest.raises(SystemExit):
        main(["generate", "x", "--model", "llama-tiny", "--load-format", "dummy", "--tensor-parallel-size", "0"])
    assert "--tensor-parallel-size: expected a positive integer, got '0'" in capsys.readouterr().err


# ---- two ranks against one process ------------------------------------------------------------

@cpu_only
def test_two_ranks_match_one_process_turboquant_and_stop_when_deleted():
    """qwen3-tiny (tied embeddings, q/k norms) on tq_k4v3: each rank holds 1 of 2 KV heads. Async
    scheduling (the GPU default): rank 0 sends each step's sampled tokens to the other rank."""
    kw = dict(ENGINE, kv_cache_dtype="tq_k4v3")
    one = LLM("qwen3-tiny", **kw)
    tokens_one = generate(one)
    tp = LLM("qwen3-tiny", tensor_parallel_size=2, async_scheduling=True, **kw)
    model = tp.llm_engine.loaded.model  # rank 0's shard: attention by heads, the embedding whole
    assert model.model.layers[0].self_attn.q_proj.weight.to_local().shape == (64, 64)
    assert type(model.model.embed_tokens.weight) is torch.nn.Parameter
    assert model.model.embed_tokens.weight.shape == (256, 64)
    plan = tp.kv_cache_plan
    assert (plan["tensor_parallel_size"], plan["q_heads_per_rank"], plan["kv_heads_per_rank"],
            plan["kv_head_replicas"]) == (2, 2, 1, 1)
    # kv_cache_memory_bytes is per rank: with half the heads per token it holds twice the tokens
    assert 2 * plan["bytes_per_token"] == one.kv_cache_plan["bytes_per_token"]
    assert plan["num_blocks"] >= 2 * one.kv_cache_plan["num_blocks"]
    assert "tensor parallel: 2 ranks, 2 of 4 attention heads and 1 of 2 KV heads per rank" in tp.describe_kv_cache()
    assert_greedy_agrees(one, generate(tp), tokens_one)
    ids = PROMPTS[2] + tokens_one[2]
    assert torch.allclose(tp.score(ids), one.score(ids), atol=1e-4, rtol=0)  # seen: 3e-6
    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, seed=7, ignore_eos=True)
    prompt = {"prompt_token_ids": PROMPTS[1]}
    assert tp.generate(prompt, seeded)[0].outputs[0].token_ids == one.generate(prompt, seeded)[0].outputs[0].token_ids
    pids = worker_pids(tp)
    assert len(pids) == 1
    assert_multicast_off(pids[0])
    del tp
    gc.collect()
    assert_gone(pids)


@cpu_only
@pytest.mark.slow
def test_two_compiled_ranks_match_one_process():
    """Each rank compiles its decoder layers (one graph for all of them, collectives inside):
    the same greedy tokens as one eager process, nothing compiled after start-up."""
    kw = dict(ENGINE, kv_cache_dtype="turboquant_k3v4_nc")
    one = LLM("llama-tiny", **kw)
    tp = LLM("llama-tiny", tensor_parallel_size=2, compile_model=True, **kw)
    assert tp.llm_engine.runner.compile_model
    assert_greedy_agrees(one, generate(tp), generate(one))
    assert tp.llm_engine.compilation_counts()["total"] == 0
    tp.llm_engine.shutdown()


@cpu_only
@pytest.mark.parametrize("centering", [True, None])
def test_two_ranks_calibrate_like_one_process(centering):
    """The start-up calibration under tensor parallelism: each rank centers its own KV heads by
    their own mean keys and the per-layer errors are averaged over the ranks, so the ranks
    choose what one process chooses (centered layers, automatic routing) and generate alike.
    centering=True centers every compressed layer; None lets the calibration choose."""
    kw = dict(ENGINE, kv_cache_dtype="tq_k4v3", kv_cache_key_centering=centering,
              kv_cache_dtype_skip_layers="auto")
    one = LLM("qwen3-tiny", **kw)
    tokens_one = generate(one)
    tp = LLM("qwen3-tiny", tensor_parallel_size=2, **kw)
    a, b = one.llm_engine.key_plan, tp.llm_engine.key_plan
    assert (b.centered_layers, b.full_precision, b.auto_layers) == \
        (a.centered_layers, a.full_precision, a.auto_layers)
    if centering:
        assert a.centered_layers  # the offsets are applied: the case is not vacuous
        # rank 0 holds KV head 0 of 2: its offsets are one process's first head's
        mu_one, mu_tp = a.key_offsets[a.centered_layers[0]], b.key_offsets[b.centered_layers[0]]
        assert mu_tp.shape[0] == 1 and torch.allclose(mu_tp[0], mu_one[0], atol=1e-5)
    errors = torch.tensor(b.calibration.errors_centered + b.calibration.errors_uncentered)
    assert torch.allclose(errors, torch.tensor(a.calibration.errors_centered
                                               + a.calibration.errors_uncentered), rtol=1e-3)
    assert_greedy_agrees(one, generate(tp), tokens_one)
    tp.shutdown()


@cpu_only
def test_two_ranks_replicate_a_single_kv_head(tmp_path):
    """One KV head on two ranks (transformers' unit_colwise): each rank holds it whole. Layer 0
    stays full precision, layer 1 is TurboQuant: both backends under tensor parallelism."""
    config = json.loads((ROOT / "tqattn/configs/models/llama-tiny.json").read_text())
    config["num_key_value_heads"] = 1
    path = tmp_path / "llama-mqa.json"
    path.write_text(json.dumps(config))
    kw = dict(ENGINE, kv_cache_dtype="tq_k4v3", kv_cache_dtype_skip_layers=[0])
    one = LLM(str(path), **kw)
    tokens_one = generate(one)
    tp = LLM(str(path), tensor_parallel_size=2, **kw)
    plan = tp.kv_cache_plan
    assert (plan["q_heads_per_rank"], plan["kv_heads_per_rank"], plan["kv_head_replicas"]) == (2, 1, 2)
    assert plan["cache_bytes"] == one.kv_cache_plan["cache_bytes"] and plan["num_blocks"] == one.kv_cache_plan["num_blocks"]
    assert_greedy_agrees(one, generate(tp), tokens_one)
    tp.shutdown()
    assert tp.llm_engine.workers.procs == []
    with pytest.raises(TensorParallelError, match=r"ranks have stopped \(shut down\); start a new engine"):
        generate(tp)


@cpu_only
def test_a_worker_exception_surfaces_with_its_traceback_and_stops_the_workers(monkeypatch):
    """A worker whose third step raises (tests/engine/tp_fault/sitecustomize.py, imported by the
    workers only): the parent raises the worker's traceback, no worker is left, and the engine
    refuses further work with a clear error."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent / "tp_fault"),
                                                      os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("TQATTN_TEST_WORKER_FAULT", "3")
    tp = LLM("llama-tiny", tensor_parallel_size=2, **ENGINE)
    pids = worker_pids(tp)
    with pytest.raises(TensorParallelError, match=r"(?s)rank 1 exited with code 1:.*Traceback.*"
                                                  r"RuntimeError: injected fault in worker step 3"):
        generate(tp)
    assert_gone(pids)
    with pytest.raises(TensorParallelError, match=r"ranks have stopped \(tensor-parallel worker rank 1 "
                                                  r"exited with code 1:\); start a new engine"):
        generate(tp)
    bm = tp.llm_engine.block_manager  # the failed requests were aborted, their blocks freed
    assert tp.llm_engine.requests == {} and bm.num_free_blocks() == bm.num_blocks[0]


def test_a_script_without_main_guard_runs_two_ranks_and_leaves_none_at_exit(tmp_path):
    """A plain script (no __main__ guard, no shutdown) with GPUs hidden: two ranks, `auto` cache,
    greedy tokens as one process's; its worker is gone once the interpreter exits."""
    script = tmp_path / "tp_script.py"
    script.write_text(
        "import json\n"
        "from tqattn import LLM, SamplingParams\n"
        f"llm = LLM('llama-tiny', tensor_parallel_size=2, **{ENGINE!r})\n"
        f"outs = llm.generate([{{'prompt_token_ids': p}} for p in {PROMPTS!r}],\n"
        "                     SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)\n"
        "print(json.dumps({'tokens': [list(o.outputs[0].token_ids) for o in outs],\n"
        "                  'pids': [p.pid for p in llm.llm_engine.workers.procs]}))\n")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert_gone(result["pids"])
    one = LLM("llama-tiny", **ENGINE)
    assert_greedy_agrees(one, result["tokens"], generate(one))
