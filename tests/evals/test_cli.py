import argparse
import json

import pytest

from tqattn.evals import cli, gsm8k

from .conftest import FakeLLM, last_question


def _parser():
    ap = argparse.ArgumentParser(prog="tqattn")
    add = ap.add_subparsers(dest="command", required=True)
    cli.add_eval_parser(add)
    return ap


def _run(argv):
    args = _parser().parse_args(argv)
    return args.func(args)


def test_parser_shapes():
    ap = _parser()
    a = ap.parse_args(["eval", "gsm8k", "--config", "SmolLM2-135M-auto", "--limit", "2", "--model", "m"])
    assert (a.config, a.limit, a.model) == (["SmolLM2-135M-auto"], 2, "m")
    a = ap.parse_args(["eval", "ppl", "--presets", "tq_k3v4,turboquant_k3v4_nc", "--context", "2048",
                       "--context", "8192", "--engine-arg", "max_model_len=8192"])
    assert a.presets == ["tq_k3v4", "turboquant_k3v4_nc"] and a.context == [2048, 8192]
    assert cli._engine_args(a.engine_arg) == {"max_model_len": 8192}
    with pytest.raises(ValueError, match="'bogus' is not an engine argument.*allowed: .*max_model_len"):
        cli._engine_args(["bogus=1"])
    with pytest.raises(ValueError, match="'kv_cache_dtype' is not an engine argument"):
        cli._engine_args(["kv_cache_dtype=tq_k3v3"])   # the command sets it per preset
    a = ap.parse_args(["eval", "niah", "--contexts", "1024,2048", "--depths", "0.25,0.75"])
    assert (a.contexts, a.depths) == ([1024, 2048], [0.25, 0.75])
    a = ap.parse_args(["eval", "report", "--skip", "niah,gsm"])
    assert a.plan == "cpu" and a.skip == ["niah", "gsm"]


@pytest.mark.parametrize("argv", [
    ["eval", "ppl", "--presets", "tq_k9"],
    ["eval", "gsm8k", "--limit", "0"],
    ["eval", "niah", "--depths", "a,b"],
    ["eval", "niah", "--depths", ""],
    ["eval", "niah", "--contexts", ","],
])
def test_bad_arguments_exit(argv, capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(argv)
    assert "error" in capsys.readouterr().err


def test_score_start_values():
    assert cli._score_start("chunk", 256, 2048) == 256
    assert cli._score_start("half", 256, 2048) == 1024
    assert cli._score_start("300", 256, 2048) == 300
    with pytest.raises(SystemExit, match="--score-start"):
        cli._score_start("most", 256, 2048)


def test_gsm8k_list_and_report_dry_run(capsys):
    assert _run(["eval", "gsm8k", "--list"]) == 0
    assert "Qwen3-4B-TQ-k3v4nc" in capsys.readouterr().out.split()
    assert _run(["eval", "report", "--plan", "cpu", "--dry-run", "--model", "default"]) == 0
    out = capsys.readouterr().out
    assert "SmolLM2-135M-Instruct: ~" in out and "Qwen" not in out
    with pytest.raises(SystemExit, match="no model"):
        _run(["eval", "report", "--dry-run", "--model", "nope"])


def test_report_estimate_counts_variants_reference_once_and_skips():
    # chunk 256 scored from 256: one 1024-token window scores 768 >= 700 tokens
    ppl = [{"source": "shakespeare", "context_len": 1024, "min_tokens": 700}]
    plan = {"baseline": "turboquant_k3v4_nc", "presets": ["auto", "tq_k4v3"],
            "models": [{"model": "m", "variants": {"v1": {}, "v2": {}}, "variant_presets": ["tq_k4v3"],
                        "ppl": ppl, "niah": {"contexts": [100, 200], "depths": [0.5], "presets": ["tq_k4v3"]},
                        "gsm": {"num_questions": 7}}]}
    # rows: auto, tq_k4v3, the baseline, tq_k4v3 [v1], tq_k4v3 [v2]; auto runs once
    (e,) = cli.estimate(plan)
    assert e == {"model": "m", "ppl_tokens": 1024 * 5, "niah_tokens": 300 * 2, "gsm_answers": 7 * 3}
    (e,) = cli.estimate(plan, skip={"ppl", "gsm"})
    assert (e["ppl_tokens"], e["niah_tokens"], e["gsm_answers"]) == (0, 600, 0)


def test_report_skip_names_are_checked(capsys):
    with pytest.raises(SystemExit):
        _run(["eval", "report", "--dry-run", "--skip", "ppl,gsm8k"])
    assert "gsm8k" in capsys.readouterr().err
    assert cli._parts("ppl, niah") == ["ppl", "niah"]


def test_eval_progress_bar_only_on_a_terminal(monkeypatch, fake_params):
    from tqattn.evals import scoring

    llm = FakeLLM("auto", answer_fn=lambda kv, p: "x")
    for tty in (False, True):
        monkeypatch.setattr("sys.stderr.isatty", lambda: tty)
        assert scoring.generate_texts(llm, ["a", "b"], scoring.greedy_params(4)) == ["x", "x"]
        assert llm.use_tqdm is tty


def test_command_line_quotes_and_keeps_global_flags(monkeypatch):
    monkeypatch.setattr("sys.argv", ["tqattn", "--debug", "eval", "report", "--model", "a b"])
    assert cli.command_line() == "tqattn --debug eval report --model 'a b'"


def test_gsm8k_command_writes_json_and_sets_exit_code(tmp_path, monkeypatch, fake_params, capsys):
    from tqattn.evals.data import gsm_symbolic_items

    gold = {it.question: it.answer for it in gsm_symbolic_items(3, 1234)}
    monkeypatch.setattr(gsm8k.scoring, "llm_factory",
                        lambda *a, **k: lambda kv: FakeLLM(kv, lambda _, p: f"#### {gold[last_question(p)]}"))
    out = tmp_path / "r.json"
    rc = _run(["eval", "gsm8k", "--config", "Qwen2.5-Coder-0.5B-TQ-k3v4nc", "--limit", "3",
               "--output", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["accuracy"] == 1.0 and len(res["samples"]) == 3
    assert json.loads(capsys.readouterr().out.split("\n", 1)[1])["passed"] is True


def test_several_gsm8k_configs_print_a_table_and_fail_if_one_fails(tmp_path, monkeypatch, fake_params,
                                                                   capsys):
    from tqattn.evals.data import chain_sum_items

    gold = {f"{it.question} =": it.answer for it in chain_sum_items(6, 1234)}
    built = []

    def factory(*a, **k):
        def make(kv):
            built.append(kv)
            return FakeLLM(kv, lambda kv, p: f" The result is {gold[last_question(p)] + (kv == 'tq_k3v4')}.")
        return make
    monkeypatch.setattr(gsm8k.scoring, "llm_factory", factory)
    out = tmp_path / "r.json"
    rc = _run(["eval", "gsm8k", "--config", "SmolLM2-135M-arith-tq_k4*", "--config",
               "SmolLM2-135M-arith-tq_k3v4", "--limit", "6", "--output", str(out)])
    assert rc == 1                                     # tq_k3v4 answers every problem off by one
    assert built == ["auto", "tq_k4v3", "tq_k4v4", "tq_k3v4"]   # one auto run for all three
    table = capsys.readouterr().out
    assert "| SmolLM2-135M-arith-tq_k3v4 | tq_k3v4 | 6 | 0.000 | 1.000 |" in table
    assert table.count("| yes |") == 2 and table.count("| **no** |") == 1
    assert [r["kv_cache_dtype"] for r in json.loads(out.read_text())["results"]] == \
        ["tq_k4v3", "tq_k4v4", "tq_k3v4"]


def test_an_output_path_that_cannot_be_written_fails_before_the_run(tmp_path):
    # a file where the results folder should be: refused at once, naming the path
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError, match="cannot write results to .*file"):
        cli.writable_dir(blocker / "sub")
    assert cli.writable_dir(tmp_path / "a" / "b").is_dir()
    args = _parser().parse_args(["eval", "niah", "--out-dir", str(blocker / "sub")])
    with pytest.raises(OSError, match="cannot write results"):
        args.func(args)   # before any model loads (there is none to load here)
