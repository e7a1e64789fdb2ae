import json

import pytest

from tqattn.evals import report
from tqattn.models.info import model_info

from .conftest import FakeLLM


@pytest.fixture(scope="module")
def smol():
    pytest.importorskip("transformers")
    return model_info(report.model_config("default"))


def test_bytes_per_token_smollm2(smol):
    assert (smol.num_layers, smol.num_kv_heads, smol.head_dim) == (30, 3, 64)
    auto = report.kv_bytes_per_token(smol, "auto")
    assert auto["bytes_per_token"] == 30 * 3 * 256 and auto["compression_vs_bf16"] == 1.0
    base = report.kv_bytes_per_token(smol, "turboquant_k3v4_nc")
    assert base["slot_bytes"] == 62 and base["bytes_per_token"] == 30 * 3 * 62
    assert base["bits_per_element"] == pytest.approx(62 * 8 / 128)
    ours = report.kv_bytes_per_token(smol, "tq_k3v4")
    assert ours["bytes_per_token"] < base["bytes_per_token"]
    b2 = report.kv_bytes_per_token(smol, "tq_k3v4", boundary_layers=2, skip_layers=[10, "29"])
    assert b2["full_precision_layers"] == [0, 1, 10, 28, 29]
    assert b2["bytes_per_token"] == 3 * (5 * 256 + 25 * 60)
    with pytest.raises(ValueError, match="out of range"):
        report.kv_bytes_per_token(smol, "tq_k3v4", skip_layers=[99])


def test_sliding_window_layers_and_qwen():
    info = model_info(report.model_config("gemma3-tiny"))
    sliding = [i for i, w in enumerate(info.sliding_windows) if w]
    b = report.kv_bytes_per_token(info, "tq_k3v4", skip_layers=["sliding_window"], boundary_layers=0)
    assert sliding and b["full_precision_layers"] == sliding
    qwen = model_info(report.model_config("internal:qwen2.5-coder-0.5b-instruct"))
    assert (qwen.num_layers, qwen.num_kv_heads, qwen.num_sliding_layers) == (24, 2, 0)


def test_shipped_plans_validate():
    for name in ("cpu", "cpu-full", "cpu-quick", "cpu-boundary"):
        plan = report.load_plan(name)
        assert plan["baseline"] == "turboquant_k3v4_nc"
    with pytest.raises(FileNotFoundError, match="shipped plans"):
        report.load_plan("gpu-9000")
    with pytest.raises(ValueError, match="unknown preset"):
        report.validate_plan({"presets": ["tq_k9"], "models": [{"model": "x"}]})
    with pytest.raises(ValueError, match="score_start"):
        report.validate_plan({"models": [{"model": "x", "ppl": [{"context_len": 64, "score_start": 64}]}]})


def test_run_report_end_to_end(tmp_path, monkeypatch, fake_params):
    monkeypatch.setenv("TQATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(report.ppl, "source_text", lambda s, n: "abcdefg hij. " * (n // 8 + 100))
    monkeypatch.setattr(report.niah.evdata, "shakespeare_text", lambda: "verse\n" * 3000)
    # Stand-ins: tq_k3v4 is the "good" fake, turboquant_k3v4_nc the default-noise one.
    monkeypatch.setattr(FakeLLM, "NOISE", {**FakeLLM.NOISE, "tq_k3v4": 0.03, "turboquant_k3v4_nc": 0.6})
    plan = {"baseline": "turboquant_k3v4_nc", "presets": ["tq_k3v4", "tq_k4v4"],
            "models": [{"name": "smol", "model": "default",
                        "ppl": [{"context_len": 256, "chunk_size": 64, "min_tokens": 1500,
                                 "block_tokens": 96},
                                {"source": "gsm_cot", "context_len": 256, "chunk_size": 64,
                                 "min_tokens": 800, "block_tokens": 96}],
                        "niah": {"contexts": [600], "depths": [0.5], "presets": ["tq_k3v4"]}}]}
    answer = lambda kv, p: " 1"
    rep = report.run_report(plan, tmp_path / "out", command="tqattn eval report x",
                            factories={"default": lambda kv: FakeLLM(kv, answer)})
    rows = {r["preset"]: r for r in rep["rows"]}
    assert rep["command"] == "tqattn eval report x" and rep["date"] <= rep["finished"]
    assert "torch" in rep["versions"]
    assert list(rows) == ["auto", "tq_k3v4", "tq_k4v4", "turboquant_k3v4_nc"]
    assert rows["auto"]["kl"]["value"] == 0 and rows["auto"]["top1"]["value"] == 1
    assert rows["tq_k3v4"]["bytes_per_token"] == 30 * 3 * 60
    assert rows["tq_k3v4"]["kl"]["value"] < rows["turboquant_k3v4_nc"]["kl"]["value"]
    assert rows["tq_k3v4"]["niah"] == 0.0 and "niah" not in rows["tq_k4v4"]
    comps = [c for c in rep["comparisons"] if c["preset"] == "tq_k3v4"]
    assert [c["spec"] for c in comps] == ["pooled", "all@256", "shakespeare@256", "gsm_cot@256"]
    assert comps[0]["lower_kl_and_ppl_delta"]
    assert not any(c["preset"] == "tq_k4v4" for c in rep["comparisons"])  # more bytes than base
    out = tmp_path / "out"
    md = (out / "report.md").read_text()
    assert "| smol | tq_k3v4 | none | – | 5400 |" in md and "Paired comparisons" in md
    assert json.loads((out / "report.json").read_text())["rows"][1]["preset"] == "tq_k3v4"
    assert (out / "quality_vs_bits.png").stat().st_size > 1000
    assert (out / "niah_smol_tq_k3v4.png").is_file()


def test_routing_variants_are_rows_paired_against_the_default(tmp_path, monkeypatch, fake_params):
    """A variant is its preset with other engine arguments; the bytes of every row come from the
    routing the engine reported (automatic routing decides it at start-up)."""
    monkeypatch.setenv("TQATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(report.ppl, "source_text", lambda s, n: "abcdefg hij. " * (n // 8 + 100))
    built = []

    class Routed(FakeLLM):
        def __init__(self, kv, **engine_args):
            skip = engine_args.get("kv_cache_dtype_skip_layers", ["auto"])
            # the default routing keeps layer 0 (as automatic routing does on Qwen2.5)
            fp = list(range(30)) if kv == "auto" else [0] if skip == ["auto"] else list(skip)
            super().__init__("good" if skip == ["auto"] else "bad" if kv != "auto" else kv)
            self.kv_cache_plan = {"full_precision_layers": fp}
            if kv != "auto":  # the default routing centers layer 1 (calibration's choice)
                self.kv_cache_plan["centered_layers"] = [1] if skip == ["auto"] else []
            built.append((kv, engine_args))

    plan = {"baseline": "turboquant_k3v4_nc", "presets": ["tq_k4v3"],
            "models": [{"name": "smol", "model": "default",
                        "variants": {"all layers": {"kv_cache_dtype_skip_layers": [],
                                                    "kv_cache_key_centering": False}},
                        "variant_presets": ["tq_k4v3"],
                        "ppl": [{"context_len": 256, "chunk_size": 64, "min_tokens": 800,
                                 "block_tokens": 96}]}]}
    report.validate_plan(plan)
    rep = report.run_report(plan, tmp_path / "out", factories={"default": Routed})
    rows = {r["preset"]: r for r in rep["rows"]}
    assert list(rows) == ["auto", "tq_k4v3", "turboquant_k3v4_nc", "tq_k4v3 [all layers]"]
    assert ("tq_k4v3", {"kv_cache_dtype_skip_layers": [], "kv_cache_key_centering": False}) in built
    assert rows["tq_k4v3"]["full_precision_layers"] == [0]
    assert rows["tq_k4v3"]["bytes_per_token"] == 3 * (256 + 29 * 60)
    assert rows["tq_k4v3 [all layers]"]["bytes_per_token"] == 30 * 3 * 60
    assert rows["tq_k4v3 [all layers]"]["variant"] == "all layers"
    assert rows["tq_k4v3"]["centered_layers"] == [1] and rows["auto"]["centered_layers"] is None
    vc = rep["variant_comparisons"]
    assert [(c["preset"], c["variant"], c["spec"]) for c in vc] == \
        [("tq_k4v3", "tq_k4v3 [all layers]", "pooled")]
    assert vc[0]["kl_diff"]["high"] < 0          # the "good" default beats the "bad" variant
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| smol | tq_k4v3 [all layers] | none | none | 5400 |" in md
    assert "| smol | tq_k4v3 | 0 | 1 | 5988 |" in md and "| smol | auto | all | – | 23040 |" in md and "Default routing against the variants" in md
    with pytest.raises(ValueError, match="'variants' maps a name to engine arguments"):
        report.validate_plan({"models": [{"model": "x", "variants": ["all"]}]})
