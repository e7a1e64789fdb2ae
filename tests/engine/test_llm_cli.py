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


def test_generate_errors():
    with pytest.raises(ValueError, match="no tokenizer"):
        main(["generate", "--model", "llama-tiny", "--load-format", "dummy", "--max-model-len", "64", "hi"])
    with pytest.raises(SystemExit, match="not a comma-separated list"):
        main(["generate", *TINY, "1,x"])
