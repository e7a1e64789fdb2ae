"""bench/startup.py keeps what it measured when a later dtype's run fails or is cut short."""

import json
import sys

import pytest

from bench import startup


def test_json_written_after_each_dtype(tmp_path, monkeypatch):
    out = tmp_path / "startup.json"
    calls = []

    def fake_start(kwargs, cache_dir, precompile="on"):
        calls.append(kwargs["kv_cache_dtype"])
        if kwargs["kv_cache_dtype"] == "tq_k4v3":
            raise RuntimeError("cut short")
        return {"startup_times": {"load": 1.0, "total": 2.0}, "wall_s": 3.0, "builds": {}}

    monkeypatch.setattr(startup, "start_once", fake_start)
    monkeypatch.setattr(sys, "argv", ["startup.py", "--kv-cache-dtypes",
                                      "turboquant_k3v4_nc,tq_k4v3", "--out", str(out)])
    with pytest.raises(RuntimeError, match="cut short"):
        startup.main()
    got = json.loads(out.read_text())
    assert list(got["runs"]) == ["turboquant_k3v4_nc"]
    assert got["runs"]["turboquant_k3v4_nc"]["warm"]["wall_s"] == 3.0
    assert calls == ["turboquant_k3v4_nc", "turboquant_k3v4_nc", "tq_k4v3"]
