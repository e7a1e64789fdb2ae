"""`tqattn generate` on a tiny model: --json for every preset, and the human output."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from tqattn.cli import main  # noqa: E402
from tqattn.quant.presets import PRESETS  # noqa: E402

from .test_llm_reference import _one_thread  # noqa: E402,F401

TINY = ["--model", "llama-tiny", "--load-format", "dummy", "--max-model-len", "64", "--token-ids"]


@pytest.mark.parametrize("preset", ["auto", *PRESETS])
def test_generate_json_every_preset(preset, capsys):
    assert main(["generate", *TINY, "--kv-cache-dtype", preset, "--max-tokens", "4", "--json",
                 "5,6,7,8,9", "10 11 12"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_cache_dtype"] == preset and out["model"] == "llama-tiny"
    backend = "FLASH_ATTN" if preset == "auto" else "TURBOQUANT"
    assert out["cache_plan"]["backends"] == {backend: 2}
    assert out["cache_plan"]["cache_tokens"] > 0
    for key in ("load_s", "prefill_tok_s", "decode_tok_s"):
        assert out["timings"][key] > 0
    assert [o["prompt_token_ids"] for o in out["outputs"]] == [[5, 6, 7, 8, 9], [10, 11, 12]]
    for o in out["outputs"]:
        assert len(o["token_ids"]) <= 4 and o["finish_reason"] in ("stop", "length")


def test_generate_human_output_and_routing(capsys):
    assert main(["generate", "--model", "gemma3-tiny", "--load-format", "dummy", "--max-model-len", "64",
                 "--token-ids", "--kv-cache-dtype", "tq_k3v4", "--kv-cache-dtype-skip-layers",
                 "sliding_window", "--max-tokens", "3", "1,2,3,4"]) == 0
    text = capsys.readouterr().out
    assert "TURBOQUANT x1" in text and "FLASH_ATTN x3" in text and ">>> 1,2,3,4" in text


def test_generate_stream_without_tokenizer_separates_the_token_ids(capsys):
    assert main(["generate", *TINY, "--max-tokens", "4", "--json", "--ignore-eos", "5,6,7"]) == 0
    ids = json.loads(capsys.readouterr().out)["outputs"][0]["token_ids"]
    assert main(["generate", *TINY, "--max-tokens", "4", "--ignore-eos", "--stream", "5,6,7"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[lines.index(">>> 5,6,7") + 1].split() == [str(t) for t in ids]


def test_generate_errors(capsys):
    assert main(["generate", "--model", "llama-tiny", "--load-format", "dummy", "--max-model-len", "64",
                 "hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tqattn: error: this model has no tokenizer") and err.count("\n") == 1
    assert main(["generate", *TINY, "1,x"]) == 1
    assert "'1,x' is not a comma-separated list of token ids" in capsys.readouterr().err
    # a prompt longer than the model: one line, after tokenization and before any generation
    assert main(["generate", *TINY, "--max-tokens", "8", ",".join(["5"] * 60)]) == 1
    err = capsys.readouterr().err
    assert "prompt (60 tokens) + max_tokens (8) = 68 exceeds max_model_len=64" in err and err.count("\n") == 1


def test_boundary_layers_that_leave_nothing_compressed_fail(capsys):
    # llama-tiny has 2 layers: 1 boundary layer keeps both full precision
    assert main(["generate", *TINY, "--kv-cache-dtype", "tq_k4v3", "--kv-cache-boundary-layers", "1",
                 "1,2,3"]) == 1
    err = capsys.readouterr().err
    assert "kv_cache_boundary_layers=1 keeps the first and last 1 layers" in err and "use at most 0" in err


def test_uncompressed_layers_are_logged_once(capsys, caplog):
    with caplog.at_level("WARNING", logger="tqattn.engine.llm_engine"):
        assert main(["generate", "--model", "gemma3-tiny", "--load-format", "dummy", "--max-model-len", "64",
                     "--token-ids", "--kv-cache-dtype", "tq_k4v3", "--kv-cache-boundary-layers", "1",
                     "--max-tokens", "3", "--json", "1,2,3", "4,5,6"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cache_plan"]["kv_cache_dtypes"] == {"auto": 2, "tq_k4v3": 2}
    logged = [r.getMessage() for r in caplog.records if "full-precision cache" in r.getMessage()]
    assert logged == ["kv_cache_dtype=tq_k4v3: 2 of 4 layers (boundary_layers: 0, 3) keep a full-precision cache"]


def test_json_stdout_is_pure_json_and_no_progress_bar_off_a_terminal(tmp_path):
    import os
    import subprocess
    import sys

    from tqattn.models import load_model

    # a real from_pretrained load (safetensors), the path that draws transformers' "Loading weights"
    load_model("llama-tiny", load_format="dummy").model.save_pretrained(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    r = subprocess.run([sys.executable, "-m", "tqattn", "generate", "--model", str(tmp_path), "--token-ids",
                        "--max-model-len", "64", "--kv-cache-dtype", "tq_k4v3", "--max-tokens", "2", "--json",
                        "1,2,3"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)  # nothing but the JSON on stdout
    assert out["outputs"][0]["prompt_token_ids"] == [1, 2, 3] and out["chat_template"] is False
    assert "Loading weights" not in r.stderr and "it/s" not in r.stderr


@pytest.mark.slow
def test_plain_text_to_a_chat_model_explains_the_empty_reply(capsys):
    """SmolLM2-Instruct reads a bare question as a finished user turn and answers <|im_end|> at
    once (as transformers' own generate does): the command says so instead of printing nothing."""
    pytest.importorskip("gguf")
    from tqattn.models import default_model_path

    try:
        default_model_path()
    except (ModuleNotFoundError, FileNotFoundError) as e:
        pytest.skip(str(e))
    small = ["--max-model-len", "128", "--kv-cache-memory-bytes", "16M", "--max-tokens", "4", "--json"]
    assert main(["generate", "--no-chat", *small, "What is the capital of France?"]) == 0
    captured = capsys.readouterr()
    o = json.loads(captured.out)["outputs"][0]
    assert o["text"] == "" and o["finish_reason"] == "stop" and len(o["token_ids"]) == 1
    assert "prompt 1 got an empty reply" in captured.err and "'<|im_end|>'" in captured.err
    assert "drop --no-chat" in captured.err and "--min-tokens" in captured.err
    assert main(["generate", "--no-chat", "--min-tokens", "4", *small, "What is the capital of France?"]) == 0
    captured = capsys.readouterr()
    assert len(json.loads(captured.out)["outputs"][0]["token_ids"]) == 4 and "empty reply" not in captured.err
