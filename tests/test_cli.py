import json
import subprocess
import sys

import pytest

from tqattn.cli import main


def test_presets_json_vllm_bytes(capsys):
    assert main(["presets", "--head-dim", "128", "--json"]) == 0
    rows = {r["preset"]: r for r in json.loads(capsys.readouterr().out)}
    assert [rows[n]["slot_bytes"] for n in ("turboquant_k8v4", "turboquant_4bit_nc",
                                            "turboquant_k3v4_nc", "turboquant_3bit_nc")] == [196, 134, 118, 102]
    for r in rows.values():
        assert {"preset", "slot_bytes", "bits_per_element", "compression_vs_bf16",
                "key_bits", "value_bits"} <= set(r)
    assert rows["turboquant_k3v4_nc"]["bits_per_element"] == pytest.approx(3.6875)


def test_codec_report_json(capsys):
    assert main(["codec-report", "--head-dim", "128", "--preset", "turboquant_k3v4_nc",
                 "--preset", "tq_k3.5v3.5", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [r["preset"] for r in rep["presets"]] == ["turboquant_k3v4_nc", "tq_k3.5v3.5"]
    for r in rep["presets"]:
        for key in ("preset", "head_dim", "slot_bytes", "bits_per_element", "compression_vs_bf16",
                    "key_mse", "ip_rel_err", "ip_bias", "value_mse", "attn_cosine"):
            assert key in r
        assert 0.9 < r["attn_cosine"] <= 1.0
    # the done-when bounds on the plain mse key codec at head size 128
    bound = {1: 0.37, 2: 0.12, 3: 0.036, 4: 0.0100}
    for row in rep["key_codebook"]:
        assert row["key_mse"] <= bound[row["bits"]]
        assert len(row["levels"]) == 2 ** (row["bits"] - 1)
    assert rep["key_codebook"][2]["levels"] == pytest.approx([0.2444, 0.7533, 1.3366, 2.1315], abs=0.003)


def test_bad_arguments_name_the_value(capsys):
    with pytest.raises(SystemExit):
        main(["codec-report", "--preset", "turboquant_9bit"])
    err = capsys.readouterr().err
    assert "turboquant_9bit" in err and "turboquant_k3v4_nc" in err
    with pytest.raises(SystemExit):
        main(["presets", "--head-dim", "63"])
    assert "63" in capsys.readouterr().err


def test_console_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "tqattn.cli", "presets", "--head-dim", "80"],
                         capture_output=True, text=True, check=True).stdout
    assert "turboquant_k3v4_nc" in out and "head size 80" in out
