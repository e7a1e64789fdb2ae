"""A missing optional dependency names tqattn's extra and its pinned requirements."""

import tomllib
from pathlib import Path

import pytest

from tqattn.extras import extra_requirements, missing_extra


def test_extra_requirements_are_pyprojects():
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    for extra, reqs in project["optional-dependencies"].items():
        # the metadata normalises specifiers (">=5.17,<5.26" may come back reordered)
        got = sorted(r.replace(" ", "") for r in extra_requirements(extra))
        assert [g.split("<")[0].split(">")[0].split("=")[0] for g in got] == \
            sorted(r.split("<")[0].split(">")[0].split("=")[0] for r in reqs), extra


def test_missing_extra_message():
    err = ImportError("No module named 'fastapi'", name="fastapi")
    msg = str(missing_extra("the server", "serve", err))
    assert msg.startswith("the server needs fastapi, from tqattn's [serve] extra: pip install ")
    assert "'fastapi>=0.110'" in msg and "'uvicorn>=0.29'" in msg and 'pip install -e ".[serve]"' in msg


def test_bench_serve_checks_the_extra_before_starting_a_server(monkeypatch, tmp_path):
    import argparse

    from tqattn.benchmarks import serve
    from tqattn.serve import frontend

    def missing():
        raise missing_extra("the server", "serve", ImportError("x", name="uvicorn"))

    monkeypatch.setattr(frontend, "uvicorn_module", missing)
    monkeypatch.setattr(serve, "ServerProcess", lambda *a: pytest.fail("started a server"))
    args = argparse.Namespace(server_args="--model llama-tiny", url=None, out_dir=str(tmp_path),
                              kv_cache_dtypes=["auto"])
    with pytest.raises(ImportError, match=r"needs uvicorn, from tqattn's \[serve\] extra"):
        serve.run_bench(args, "tqattn bench serve")
