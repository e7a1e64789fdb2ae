"""`tqattn bench throughput` end to end on a tiny model (CPU), and the step-time check."""

from __future__ import annotations

import json

import pytest
import torch

from tqattn.benchmarks import report
from tqattn.engine.outputs import StepRecord


def test_throughput_end_to_end(tmp_path, capsys):
    pytest.importorskip("transformers")
    from tqattn.cli import main

    n, n_in, n_out, dtypes = 5, 24, 4, ["auto", "turboquant_k3v4_nc"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is faster, above all on shared cores
    try:
        rc = main(["bench", "throughput", "--workload", "chat", "--model", "llama-tiny", "--num-prompts", str(n),
                   "--input-len", str(n_in), "--output-len", str(n_out), "--kv-cache-dtypes", ",".join(dtypes),
                   "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--device", "cpu",
                   "--out-dir", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    res = json.loads((tmp_path / "throughput_chat.json").read_text())
    assert res["workload"] == {**res["workload"], "name": "chat", "num_prompts": n, "input_len": n_in,
                               "output_len": n_out}
    assert [r["kv_cache_dtype"] for r in res["results"]] == dtypes == res["kv_cache_dtypes"]
    assert res["engine_kwargs"]["enable_prefix_caching"] is False
    args = [dict(r["engine_args"]) for r in res["results"]]
    assert [a.pop("kv_cache_dtype") for a in args] == dtypes
    assert args[0] == args[1]  # identical engine arguments apart from the dtype
    for r in res["results"]:
        assert r["num_requests"] == n and r["input_tokens"] == n * n_in and r["output_tokens"] == n * n_out
        assert r["output_tok_s"] == pytest.approx(n * n_out / r["elapsed_s"])
        tl = r["timeline"]
        steps = len(tl["kind"])
        assert all(len(v) == steps for v in tl.values()) and steps == r["steps"]["num_steps"]
        # every token run through the model, recomputation included, is in the timeline
        assert sum(tl["num_tokens"]) == r["num_computed_tokens"] == r["steps"]["total_tokens"]
        assert r["num_computed_tokens"] == n * (n_in + n_out - 1) + r["num_recomputed_tokens"]
        assert max(tl["num_tokens"]) <= 16 and set(tl["kind"]) <= {"decode", "prefill", "mixed"}
        assert sum(k["steps"] for k in r["steps"]["by_kind"].values()) == steps
        assert r["steps"]["max_step"]["wall_ms"] == max(tl["wall_ms"])
        for key in ("ttft_ms", "tpot_ms"):
            p = r[key]
            assert 0 < p["p50"] <= p["p90"] <= p["p99"] <= p["max"]
        d = r["steps"]["decode_at_largest_batch"]
        assert d["batch"] == max(s for s, k in zip(tl["num_seqs"], tl["kind"]) if k == "decode") <= 2
        assert 1 <= r["peak_concurrent_seqs"] <= 2
        assert r["kv_capacity_tokens"] > 0 and r["num_preemptions"] >= 0
        assert r["recomputed_fraction_of_prompt_tokens"] == r["num_recomputed_tokens"] / (n * n_in)
        assert [a["layer"] for a in r["attention"]] == [0, 1]
        want = "FLASH_ATTN" if r["kv_cache_dtype"] == "auto" else "TURBOQUANT"
        assert {a["backend"] for a in r["attention"]} == {want}
        check = r["step_check"]
        assert check["num_steps"] == steps and check["ok"] == (check["num_violations"] == 0)
        for key in ("compilations_after_startup", "compilations_in_run"):  # CPU: nothing compiles
            c = r[key]
            assert c["total"] == c["dynamo"] + c["triton"] == 0 and c["triton_kernels"] == []
        assert r["startup_s"] > 0
        assert r["startup_builds"] == {}  # CPU: eager, no warm-up compiles to report
    md = (tmp_path / "throughput_chat.md").read_text()
    assert all(f"`{d}`" in md for d in dtypes) and "tokens prefilled again" in md
    try:
        import matplotlib  # noqa: F401
        assert (tmp_path / "throughput_chat_steps.png").stat().st_size > 0
    except ImportError:
        pass
    printed = capsys.readouterr().out
    assert "out tok/s" in printed and all(d in printed for d in dtypes)


def _rec(kind, tokens, ms, bucket=None, seqs=1):
    return StepRecord(kind=kind, num_tokens=tokens, num_seqs=seqs, num_decodes=seqs if kind == "decode" else 0,
                      graph_bucket=bucket, wall_ms=ms, host_ms=ms)


def test_step_check_groups_by_kind_and_size():
    records = ([_rec("decode", 3, 10, bucket=4, seqs=3)] * 4 + [_rec("decode", 4, 25, bucket=4, seqs=4)]
               + [_rec("decode", 9, 40, bucket=16, seqs=9)] * 3  # another bucket: its own median
               + [_rec("prefill", 1000, 180), _rec("prefill", 1024, 190), _rec("prefill", 700, 2600)]
               + [_rec("mixed", 1000, 170)])  # same size as the prefills, other kind
    c = report.step_check(records)
    assert c["num_groups"] == 4 and not c["ok"]
    assert [(b["index"], b["kind"], b["size"]) for b in c["worst"]] == [(10, "prefill", 1024), (4, "decode", 4)]
    assert c["worst"][0]["median_ms"] == 190 and c["num_violations"] == 2
    assert report.step_check(records[:4])["ok"]
    s = report.step_summary(records)
    assert s["decode_at_largest_batch"] == {"batch": 9, "steps": 3, "graph_bucket": 16, "median_ms": 40,
                                            "median_host_ms": 40, "device_idle_fraction": None}
    assert s["max_step"]["index"] == 10 and s["by_kind"]["prefill"]["steps"] == 3


def test_device_idle_fraction_from_the_step_events():
    recs = [StepRecord(kind="decode", num_tokens=8, num_seqs=8, num_decodes=8, graph_bucket=8,
                       wall_ms=10, host_ms=3, device_ms=d, device_idle_ms=i)
            for d, i in ((9.0, None), (9.0, 1.0), (8.0, 0.0), (9.0, 1.0))]
    assert report.device_idle_fraction(recs) == pytest.approx(2.0 / 28.0)  # the first has no gap
    assert report.device_idle_fraction(recs[:1]) is None
    assert report.step_summary(recs)["decode_device_idle_fraction"] == pytest.approx(2.0 / 28.0)


def _dev(kind, tokens, wall, device, idle, bucket=None, seqs=1):
    return StepRecord(kind=kind, num_tokens=tokens, num_seqs=seqs, num_decodes=seqs if kind == "decode" else 0,
                      graph_bucket=bucket, wall_ms=wall, host_ms=1.0, device_ms=device, device_idle_ms=idle)


def test_step_check_reads_the_device_timeline_on_cuda():
    # a decode step whose tokens reach the host late (the next step's long launch) but that the
    # device ran at its usual speed passes; a step behind a device stall (idle gap) fails
    decodes = [_dev("decode", 6, 7.8, 7.8, 0.0, bucket=8, seqs=6) for _ in range(8)]
    late = _dev("decode", 6, 40.0, 7.8, 0.01, bucket=8, seqs=6)
    mixed = [_dev("mixed", 8192, 150.0, 148.0, 0.0, seqs=6) for _ in range(3)]
    c = report.step_check(decodes + [late] + mixed)
    assert c["ok"] and c["timeline"] == "device" and c["host_wall_violations"] == 1
    stalled = _dev("mixed", 8192, 3150.0, 150.0, 3000.0, seqs=6)  # a mid-run compile: device idle
    c = report.step_check(decodes + mixed + [stalled])
    assert not c["ok"] and [(b["index"], b["kind"]) for b in c["worst"]] == [(11, "mixed")]
    assert c["worst"][0]["ms"] == pytest.approx(3150.0) and c["worst"][0]["median_ms"] == pytest.approx(148.0)
    # the first recorded step has no gap before it: its device time alone
    assert report.step_time_ms(_dev("decode", 1, 9.0, 5.0, None)) == 5.0
    assert report.step_time_ms(_rec("decode", 1, 9.0)) == 9.0  # no device events: host wall


def test_bench_flags_are_the_shared_engine_flags():
    import argparse

    from tqattn.cli import build_parser

    ap = build_parser()
    args = ap.parse_args(["bench", "throughput", "--workload", "chat", "--kv-cache-memory-bytes", "8GiB",
                          "--kv-cache-dtypes", "auto,tq_k4v3", "--no-compile-model"])
    assert args.kv_cache_memory_bytes == 8 << 30 and args.kv_cache_dtypes == ["auto", "tq_k4v3"]
    assert args.compile_model is False and args.model is None and args.max_num_batched_tokens == 8192
    from tqattn.benchmarks.cli import engine_kwargs_from_args
    from tqattn.benchmarks.throughput import WORKLOADS

    # the default model is the GPU benchmark's: on a CPU it must be named
    with pytest.raises(ValueError, match="on a CPU name a small one, e.g. --model qwen3-tiny"):
        engine_kwargs_from_args(args, WORKLOADS["chat"])
    args.model = "Qwen3-4B"
    kw = engine_kwargs_from_args(args, WORKLOADS["chat"])
    assert kw["load_format"] == "dummy" and kw["enable_prefix_caching"] is False
    assert kw["max_model_len"] == WORKLOADS["chat"].input_len + WORKLOADS["chat"].output_len
    assert "kv_cache_dtype" not in kw and "model" not in kw
    for bad in (["--kv-cache-memory-bytes", "8 gigs"], ["--kv-cache-dtypes", "auto,fp3"]):
        with pytest.raises(SystemExit):
            ap.parse_args(["bench", "throughput", "--workload", "chat", *bad])


def test_startup_line_names_the_builds():
    r = {"kv_cache_dtype": "tq_k4v3", "startup_times": {"load": 1.0, "warmup": 26.4},
         "startup_builds": {"warmup": {"triton_loaded": 10, "triton_compiled": 3, "dynamo": 2},
                            "precompile": {"compiled": 11, "submitted": 11, "cached": 2, "workers": 15,
                                           "total_s": 6.84, "failed": [], "unbuilt": ["x"]}}}
    assert report.startup_line(r) == (
        "- `tq_k4v3`: load 1.00, warmup 26.40; warm-up: 10 Triton builds from the disk cache, "
        "3 compiled, 2 Dynamo compiles; precompile: 11 of 11 new builds by 15 workers in 6.8 s, "
        "2 already cached, 1 not precompiled")
    r["startup_builds"] = {"precompile": None}
    assert report.startup_line(r).endswith("warmup 26.40; no warm-up; precompile failed (see the log)")
    del r["startup_builds"]  # a result written before the builds were recorded
    assert report.startup_line(r) == "- `tq_k4v3`: load 1.00, warmup 26.40"


@pytest.mark.parametrize("flag,why", [(["--kv-cache-dtype", "tq_k4v3"], "come from --kv-cache-dtypes"),
                                      (["--enable-prefix-caching"], "prefix caching is always off"),
                                      (["--no-enable-prefix-caching"], "prefix caching is always off")])
def test_bench_refuses_the_engine_flags_it_sets_itself(flag, why, capsys):
    from tqattn.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "throughput", "--workload", "chat", *flag])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{flag[0]} is not taken here" in err and why in err


@pytest.mark.parametrize("argv,named", [
    (["bench", "throughput", "--warmup-prompts", "-1"], "'-1'"),
    (["bench", "throughput", "--temperature", "nan"], "'nan'"),
    (["bench", "serve", "--warmup-prompts", "-2"], "'-2'"),
])
def test_bench_flags_are_checked_before_any_engine_starts(argv, named, capsys):
    from tqattn.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and named in capsys.readouterr().err
