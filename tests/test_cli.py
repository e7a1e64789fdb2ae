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


# ---- first contact: one-line errors, --debug, --version, python -m tqattn, pipes, help -----------

import os  # noqa: E402

import torch  # noqa: E402

from tqattn import __version__  # noqa: E402

_MISSING_CUDA = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"


def _tqattn(*args, stdout=subprocess.PIPE, **kwargs):
    env = dict(os.environ, PYTHONPATH=os.getcwd(), **kwargs.pop("env", {}))
    return subprocess.run([sys.executable, "-m", "tqattn", *args], stdout=stdout, stderr=subprocess.PIPE,
                          text=True, env=env, **kwargs)


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if anything starts loading a model."""
    import tqattn.engine.llm as llm_module

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(llm_module, "LLMEngine", refuse)


@pytest.mark.parametrize("argv,named", [
    (["--kv-cache-dtype", "tq_k9"], "'tq_k9'"),
    (["--max-tokens", "0"], "'0'"),
    (["--max-tokens", "many"], "'many'"),
    (["--temperature", "-1"], "'-1'"),
    (["--top-p", "1.5"], "'1.5'"),
    (["--top-k", "-3"], "'-3'"),
    (["--min-tokens", "9", "--max-tokens", "4"], "min_tokens (9)"),
    (["--device", "gpu"], "'gpu'"),
    (["--device", _MISSING_CUDA], f"'{_MISSING_CUDA}'"),
    (["--kv-cache-memory-bytes", "12Q"], "'12Q'"),
    (["--max-model-len", "0"], "'0'"),
    (["--dtype", "fp8"], "'fp8'"),
    (["--kv-cache-dtype-skip-layers", "1", "--max-tokens", "-1"], "'-1'"),
])
def test_bad_values_are_one_line_before_the_model_loads(argv, named, capsys, no_model_load):
    try:
        rc = main(["generate", *argv, "What is the capital of France?"])
    except SystemExit as e:  # argparse: usage errors exit with status 2
        rc = e.code
    err = capsys.readouterr().err
    assert rc in (1, 2), err
    assert err.count("\n") == 1 and err.startswith("tqattn") and "error:" in err, err
    assert named in err and "Traceback" not in err


def test_missing_model_path_is_one_line(capsys):
    assert main(["generate", "--model", "/nonexistent/model.gguf", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tqattn: error: no such file or directory: /nonexistent/model.gguf;")
    assert err.count("\n") == 1 and "shipped config names" in err


def test_debug_and_env_show_the_traceback(monkeypatch, capsys):
    for argv in (["--debug", "generate", "--device", _MISSING_CUDA, "hi"],
                 ["generate", "--device", _MISSING_CUDA, "--debug", "hi"]):
        with pytest.raises(ValueError, match="CUDA"):
            main(argv)
    monkeypatch.setenv("TQATTN_DEBUG", "1")
    with pytest.raises(ValueError, match="CUDA"):
        main(["generate", "--device", _MISSING_CUDA, "hi"])
    monkeypatch.setenv("TQATTN_DEBUG", "0")
    assert main(["generate", "--device", _MISSING_CUDA, "hi"]) == 1


def test_version_and_python_dash_m():
    r = _tqattn("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"tqattn {__version__}"
    r = _tqattn("presets", "--head-dim", "64")
    assert r.returncode == 0 and "turboquant_k3v4_nc" in r.stdout and r.stderr == ""


def test_help_shows_defaults_and_both_sampling_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for flag in ("--top-p", "--top-k", "--stop", "--min-tokens", "--stop-token-ids", "--ignore-eos",
                 "--max-num-seqs", "--enable-prefix-caching", "--debug"):
        assert flag in out, flag
    assert "tokens to generate at most (default: 64)" in out and "0 = greedy (default: 0.0)" in out
    assert "temperature 1.0" in out and "max_tokens 16" in out  # SamplingParams()' defaults
    assert "(default: 16)" in out and "(default: 256)" in out   # block size, max_num_seqs: EngineArgs'
    with pytest.raises(SystemExit):
        main(["presets", "--help"])
    assert "(default: 128)" in capsys.readouterr().out


def test_closed_stdout_ends_quietly():
    # `tqattn presets | head`: the reader is gone before the output is written
    p = subprocess.Popen([sys.executable, "-m", "tqattn", "presets"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait() == 141 and err == ""


def test_presets_list_every_preset_with_unsupported_ones_marked(capsys):
    from tqattn.quant.presets import PRESETS

    assert main(["presets", "--head-dim", "300", "--json"]) == 0
    rows = {r["preset"]: r for r in json.loads(capsys.readouterr().out)}
    assert list(rows) == list(PRESETS)
    bad = {n for n, r in rows.items() if not r["supported"]}
    assert bad == {"tq_k3o4v3.5"} and "300 > 256" in rows["tq_k3o4v3.5"]["unsupported_reason"]
    assert all(r["slot_bytes"] > 0 for n, r in rows.items() if n not in bad)
    assert main(["presets", "--head-dim", "300"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sum(ln.startswith("tq_k3o4v3.5 ") and "UNSUPPORTED" in ln for ln in lines) == 1
    assert len(lines) == 3 + len(PRESETS)


def test_codec_report_names_presets_it_cannot_measure(capsys):
    assert main(["codec-report", "--head-dim", "300", "--preset", "tq_k3o4v3.5"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "head size 300" in err
    with pytest.raises(SystemExit):
        main(["codec-report", "--head-dim", "4096"])
    assert "head size 4096 is above 1024" in capsys.readouterr().err


def test_eval_without_opt_in_fetches_nothing(tmp_path, monkeypatch, capsys):
    from tqattn.evals import data

    monkeypatch.setenv("TQATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(data.ALLOW_DOWNLOAD_ENV, raising=False)
    ran = []
    monkeypatch.setattr(data.subprocess, "run", lambda *a, **k: ran.append(a) or pytest.fail("pip ran"))
    assert main(["eval", "gsm8k", "--config", "Qwen2.5-Coder-0.5B-tq_k4v3", "--limit", "1"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "~470 MB" in err and "internal evaluation only" in err
    assert "--allow-download" in err and ran == [] and not list(tmp_path.rglob("*"))


@pytest.mark.parametrize("argv", [["eval", "ppl", "--presets", "tq_k4v3"],
                                  ["eval", "niah", "--presets", "tq_k4v3", "--out-dir", "OUT"],
                                  ["eval", "report", "--plan", "cpu-quick", "--out-dir", "OUT"]])
def test_eval_says_its_data_is_missing_before_loading_a_model(argv, tmp_path, monkeypatch, capsys):
    from tqattn.evals import data, scoring

    monkeypatch.setenv("TQATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(data.ALLOW_DOWNLOAD_ENV, raising=False)
    monkeypatch.setattr(scoring, "make_llm", lambda *a, **k: pytest.fail("loaded a model"))
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "shakespeare" in err and "is not in the cache" in err and "--allow-download" in err


def test_log_lines_keep_the_traceback():
    # logger.exception in the server's engine loop: the stack is what finds the bug
    import logging

    from tqattn.cli import _LogFormatter

    try:
        raise ValueError("deep inside")
    except ValueError:
        record = logging.LogRecord("tqattn", logging.ERROR, __file__, 1, "step %d failed", (3,), sys.exc_info())
    text = _LogFormatter().format(record)
    assert text.startswith("tqattn: error: step 3 failed\nTraceback") and text.endswith("ValueError: deep inside")
    plain = logging.LogRecord("tqattn", logging.WARNING, __file__, 1, "slow", None, None)
    assert _LogFormatter().format(plain) == "tqattn: warning: slow"
