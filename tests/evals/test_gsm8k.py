from dataclasses import replace

import pytest
import yaml

from tqattn.evals import gsm8k
from tqattn.evals.data import GSMItem
from tqattn.evals.gsm8k import ConfigError, extract_answer, is_correct

from .conftest import FakeLLM, last_question


@pytest.mark.parametrize("text, expected", [
    ("3 + 4 = 7\n#### 7", 7),
    ("#### 1,234", 1234),
    ("####$1,234.00", 1234),
    ("#### -5", -5),
    ("#### −12", -12),
    ("#### 3.5", 3.5),
    ("#### **42**", 42),
    ("She pays $5.\n#### 18\nQuestion: 2 + 2 = 4 #### 4", 18),   # first marker wins
    ("So the answer is 72.", 72),
    ("The final answer is: $1,000", 1000),
    ("The answer is -3 degrees", -3),
    ("THE ANSWER IS 9", 9),
    ("Thus \\boxed{256}", 256),
    ("He has 12 apples, gives 5 away, keeps 7.", 7),                # last-number fallback
    ("costs 10-3 = 7 dollars", 7),
    ("temperature went from 5 to -8", -8),
    ("It is 1,000,000 exactly", 1000000),
    ("no digits here", None),
    ("", None),
    ("#### 12. Done", 12),
    ("x2 is not a number but 4 is", 4),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_is_correct():
    assert is_correct(18.0, 18)
    assert is_correct(1234, 1234)
    assert not is_correct(18.5, 18)
    assert not is_correct(None, 0)
    assert is_correct(-3, -3)


SHOTS = [GSMItem("What is 2 plus 3?", 5, "2 + 3 = 5"), GSMItem("Double 4?", 8, "4 x 2 = 8")]


def test_completion_prompt_format():
    p = gsm8k.completion_prompt("How many eggs?", SHOTS)
    assert p.startswith(gsm8k.INSTRUCTION + "\n\n")
    assert "Question: What is 2 plus 3?\nAnswer: 2 + 3 = 5\n#### 5\n\n" in p
    assert p.endswith("\n\nQuestion: How many eggs?\nAnswer:")
    assert p.count("Question:") == 3


def test_chat_messages_and_template():
    from .conftest import CharTokenizer

    msgs = gsm8k.chat_messages("How many eggs?", SHOTS)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert msgs[2]["content"] == "2 + 3 = 5\n#### 5"
    assert msgs[-1]["content"] == "Question: How many eggs?"
    text = gsm8k.build_prompts([GSMItem("How many eggs?", 3, "")], SHOTS, "chat", CharTokenizer())[0]
    assert text.endswith("<user>Question: How many eggs?\n<assistant>")
    with pytest.raises(ValueError, match="tokenizer"):
        gsm8k.build_prompts(SHOTS, SHOTS, "chat", None)


def test_chat_template_without_system_role_folds_instruction():
    class NoSystem:
        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
            if any(m["role"] == "system" for m in messages):
                raise ValueError("System role not supported")
            return "|".join(m["content"] for m in messages)

    out = gsm8k.apply_chat_template(NoSystem(), gsm8k.chat_messages("Q?", []))
    assert out == gsm8k.INSTRUCTION + "\n\nQuestion: Q?"


# ----------------------------------------------------------------------------- configs

def test_every_shipped_config_is_valid():
    names = gsm8k.list_configs()
    assert len(names) >= 20
    for name in names:
        cfg = gsm8k.load_config(name)
        assert cfg.name == name
        assert "enforce_eager" not in cfg.engine_args
    for short, thr in [("k8v4", 0.80), ("t4nc", 0.80), ("k3v4nc", 0.78), ("t3nc", 0.75)]:
        cfg = gsm8k.load_config(f"Qwen3-4B-TQ-{short}")
        assert cfg.pass_rule == {"threshold": thr, "tolerance": 0.08}
        assert (cfg.num_questions, cfg.num_shots, cfg.engine_args) == (1319, 5, {"max_model_len": 4096})
    assert gsm8k.load_config("smollm2-135m-tq-k3v4nc.yaml").kv_cache_dtype == "turboquant_k3v4_nc"


BASE = {"model": "default", "kv_cache_dtype": "tq_k3v4", "num_questions": 10, "num_shots": 2,
        "max_tokens": 64, "data": {"source": "gsm_symbolic", "seed": 1}, "pass": {"threshold": 0.5}}


@pytest.mark.parametrize("change, message", [
    ({"kv_cache_dtype": "turboquant_k9"}, "unknown kv_cache_dtype 'turboquant_k9'"),
    ({"num_questions": 0}, "num_questions must be an integer >= 1"),
    ({"num_shots": "5"}, "num_shots must be an integer"),
    ({"data": {"source": "hub"}}, "data must be"),
    ({"data": {"source": "jsonl", "seed": 3}}, "do not apply"),
    ({"shot_seed": 1}, "different seed"),
    ({"pass": {}}, "pass must be"),
    ({"pass": {"threshold": 1.5}}, r"pass.threshold must be a number in \[0, 1\]"),
    ({"pass": {"tolerance": 0.1}}, "needs pass.threshold"),
    ({"pass": {"min": 0.1}}, "pass must be"),
    ({"prompt_format": "xml"}, "prompt_format"),
    ({"engine_args": {"kv_cache_dtype": "auto"}}, "must not set"),
    ({"enforce_eager": True}, "unknown keys"),
])
def test_config_errors(change, message):
    with pytest.raises(ConfigError, match=message):
        gsm8k.parse_config({**BASE, **change}, "x.yaml")


def test_config_missing_key_and_file(tmp_path):
    with pytest.raises(ConfigError, match=r"missing required keys \['model'\]"):
        gsm8k.parse_config({k: v for k, v in BASE.items() if k != "model"})
    with pytest.raises(ConfigError, match="shipped"):
        gsm8k.load_config("no-such-config")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        gsm8k.load_config(bad)
    good = tmp_path / "mine.yaml"
    good.write_text(yaml.safe_dump(BASE))
    assert gsm8k.load_config(str(good)).name == "mine"


def test_overrides(tmp_path):
    cfg = gsm8k.load_config("Qwen3-4B-TQ-k8v4")
    with pytest.raises(ConfigError, match="--data"):
        gsm8k.load_items(cfg, 2)
    c2 = gsm8k.override(cfg, model="/models/q", data="gsm_symbolic:42", load_format="dummy")
    assert (c2.model, c2.data, c2.load_format) == ("/models/q", {"source": "gsm_symbolic", "seed": 42}, "dummy")
    assert gsm8k.override(cfg, data="t.jsonl").data == {"source": "jsonl", "path": "t.jsonl"}
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match="holds no GSM8K questions"):
        gsm8k.load_items(gsm8k.override(cfg, data=str(empty)), 2)
    with pytest.raises(ConfigError, match="shot_seed"):
        gsm8k.override(cfg, data="gsm_symbolic:7")


def test_missing_local_model_is_a_clear_error():
    cfg = gsm8k.override(gsm8k.load_config("Qwen3-4B-TQ-k8v4"), data="gsm_symbolic")
    with pytest.raises(FileNotFoundError, match="--model /path/to/model"):
        gsm8k.run_gsm8k(cfg, limit=1)


# ----------------------------------------------------------------------------- the eval loop

def _answers(correct_for):
    """A fake model that answers right when its preset is in `correct_for`, wrong otherwise."""
    from tqattn.evals.data import gsm_symbolic_items

    gold = {it.question: it.answer for s in (1, 1234) for it in gsm_symbolic_items(20, s)}

    def answer(kv, prompt):
        a = gold[last_question(prompt)]
        return f" Some steps.\n#### {a if kv in correct_for else a + 1}"
    return answer


def test_run_gsm8k_with_fake_engine(fake_params):
    log = []
    cfg = gsm8k.load_config("SmolLM2-135M-TQ-k3v4nc")
    res = gsm8k.run_gsm8k(cfg, limit=4, factory=lambda kv: FakeLLM(kv, _answers({"turboquant_k3v4_nc"}), log))
    assert res["accuracy"] == 1.0 and res["correct"] == 4 and res["num_questions"] == 4
    assert res["limited"] and res["passed"] and res["auto_accuracy"] is None
    # the first prompt alone (it fills the prefix cache with the exemplars), then the rest
    assert [e for e in log if e[0] == "generate"] == [("generate", "turboquant_k3v4_nc", 1, 256),
                                                      ("generate", "turboquant_k3v4_nc", 3, 256)]
    s = res["samples"][0]
    assert s["correct"] and s["pred"] == s["gold"]
    assert res["settings"]["kv_cache_dtype"] == "turboquant_k3v4_nc"


def test_threshold_gate_fails(fake_params):
    cfg = gsm8k.parse_config({**BASE, "pass": {"threshold": 0.5, "tolerance": 0.1}})
    res = gsm8k.run_gsm8k(cfg, limit=3, factory=lambda kv: FakeLLM(kv, _answers(set())))
    assert res["accuracy"] == 0.0 and not res["passed"]
    assert res["checks"] == [{"rule": "threshold - tolerance", "tolerance": 0.1, "bound": 0.4,
                             "passed": False, "vacuous": False}]


def test_max_drop_runs_auto_first(fake_params):
    log = []
    cfg = gsm8k.parse_config({**BASE, "data": {"source": "gsm_symbolic", "seed": 1234},
                              "pass": {"max_drop": 0.2}})
    res = gsm8k.run_gsm8k(cfg, limit=5, factory=lambda kv: FakeLLM(kv, _answers({"auto"}), log))
    assert [e[1] for e in log if e[0] == "build"] == ["auto", "tq_k3v4"]
    assert res["auto_accuracy"] == 1.0 and res["accuracy"] == 0.0
    assert res["checks"][0]["bound"] == pytest.approx(0.8) and not res["passed"]
    res = gsm8k.run_gsm8k(cfg, limit=5, factory=lambda kv: FakeLLM(kv, _answers({"auto", "tq_k3v4"})))
    assert res["passed"]


def test_jsonl_source(tmp_path, fake_params):
    f = tmp_path / "test.jsonl"
    f.write_text('{"question": "Q one?", "answer": "1+1=2\\n#### 2"}\n'
                 '{"question": "Q two?", "answer": "so\\n#### 1,000"}\n')
    cfg = gsm8k.override(gsm8k.parse_config(BASE), data=str(f))
    gold = {"Q one?": 2, "Q two?": 1000}
    res = gsm8k.run_gsm8k(cfg, factory=lambda kv: FakeLLM(kv, lambda k, p: f"#### {gold[last_question(p)]:,}"))
    assert res["num_questions"] == 2 and res["accuracy"] == 1.0


# ----------------------------------------------------------------------------- the arithmetic gate

@pytest.mark.parametrize("text, expected", [
    (" The result is 7.", 7),
    (" The result is -12.", -12),
    (" The result is −3", -3),
    (" 4 + 3 = 7", None),                 # no "The result is": not an answer
    (" The result is", None),
    ("The result is 5. The result is 6.", 5),
])
def test_extract_result(text, expected):
    assert gsm8k.extract_result(text) == expected


def test_arith_prompt_format():
    shots = [GSMItem("4 - 7", -3, ""), GSMItem("2 + 2", 4, "")]
    p = gsm8k.completion_prompt("5 + 1 =", shots, gsm8k.ARITH)
    assert p == ("Question: 4 - 7 =\nAnswer: The result is -3.\n\nQuestion: 2 + 2 =\n"
                 "Answer: The result is 4.\n\nQuestion: 5 + 1 =\nAnswer:")
    assert gsm8k.task_for({"source": "chain_sum"}) is gsm8k.ARITH
    assert gsm8k.task_for({"source": "jsonl"}) is gsm8k.GSM
    msgs = gsm8k.chat_messages("5 + 1 =", shots, gsm8k.ARITH)
    assert msgs[0] == {"role": "user", "content": "Question: 4 - 7 ="}   # no system message


def test_sigma_tolerances():
    assert gsm8k.sigma_max_drop(150, 3) == pytest.approx(3 / 300 ** 0.5)
    assert gsm8k.sigma_max_drop(50, 3) == pytest.approx(0.3)
    assert gsm8k.sigma_tolerance(100, 2) == pytest.approx(0.1)
    assert gsm8k.sigma_max_drop(10, 3) > gsm8k.sigma_max_drop(100, 3)    # fewer problems, wider
    with pytest.raises(ValueError, match="at least one problem"):
        gsm8k.sigma_max_drop(0, 3)
    # a bound at or below zero passes any accuracy: the check is marked vacuous
    rule = {"max_drop_sigmas": 3}
    few, many = gsm8k._checks(rule, 0.0, 0.5, 2), gsm8k._checks(rule, 0.48, 0.5, 2000)
    assert few[0]["passed"] and few[0]["vacuous"] and few[0]["bound"] <= 0
    assert many[0]["passed"] and not many[0]["vacuous"]


def test_chance_accuracy():
    items = [GSMItem(str(i), a, "") for i, a in enumerate([1, 2, 2, 3, 2, 1])]
    assert gsm8k.chance_accuracy(items) == 0.5
    assert gsm8k.chance_accuracy([]) == 0.0


ARITH = {**BASE, "data": {"source": "chain_sum", "seed": 1234}, "pass": {"max_drop_sigmas": 3}}


@pytest.mark.parametrize("change, message", [
    ({"data": {"source": "chain_sum", "seed": 1, "terms": 1}}, "data.terms must be an integer >= 2"),
    ({"data": {"source": "chain_sum", "seed": 1, "path": "x"}}, "do not apply"),
    ({"pass": {"max_drop": 0.1, "max_drop_sigmas": 3}}, "not both"),
    ({"pass": {"threshold": 0.5, "tolerance": 0.1, "tolerance_sigmas": 2}}, "not both"),
    ({"pass": {"max_drop_sigmas": 0}}, r"standard deviations in \(0, 10\]"),
    ({"pass": {"tolerance_sigmas": 2}}, "needs pass.threshold"),
])
def test_arith_config_errors(change, message):
    with pytest.raises(ConfigError, match=message):
        gsm8k.parse_config({**ARITH, **change}, "x.yaml")


def test_shipped_arith_configs():
    names = gsm8k.expand_configs(["smollm2-135m-arith-*"])
    assert len(names) == 10 and "SmolLM2-135M-arith-auto" in names
    for name in names:
        cfg = gsm8k.load_config(name)
        assert cfg.data == {"source": "chain_sum", "seed": 1234, "terms": 2, "digits": 1}
        assert cfg.num_questions >= 100
        if cfg.kv_cache_dtype == "auto":
            assert set(cfg.pass_rule) == {"threshold", "tolerance_sigmas"}
        else:
            assert cfg.pass_rule == {"max_drop_sigmas": 3.0}
    with pytest.raises(ConfigError, match="no shipped config matches"):
        gsm8k.expand_configs(["nothing-*"])
    assert gsm8k.expand_configs(["a.yaml"]) == ["a.yaml"]
    c = gsm8k.override(gsm8k.load_config(names[0]), data="chain_sum:99")
    assert c.data == {"source": "chain_sum", "seed": 99, "terms": 2, "digits": 1}
    with pytest.raises(ConfigError, match="integer"):
        gsm8k.override(c, data="chain_sum:x")


def _arith_answers(right_for):
    """A fake model answering chain_sum problems: right for presets in `right_for`, else off by one."""
    from tqattn.evals.data import chain_sum_items

    gold = {f"{it.question} =": it.answer for it in chain_sum_items(40, 1234)}

    def answer(kv, prompt):
        a = gold[last_question(prompt)]
        return f" The result is {a if kv in right_for else a + 1}."
    return answer


def test_arith_gate_relative_to_auto_with_one_shared_auto_run(fake_params):
    log, refs = [], {}
    base = gsm8k.parse_config(ARITH)
    good, bad = replace(base, kv_cache_dtype="tq_k4v3"), replace(base, kv_cache_dtype="tq_k3v4")
    factory = lambda kv: FakeLLM(kv, _arith_answers({"auto", "tq_k4v3"}), log)  # noqa: E731
    r1 = gsm8k.run_gsm8k(good, limit=8, factory=factory, reference_runs=refs)
    r2 = gsm8k.run_gsm8k(bad, limit=8, factory=factory, reference_runs=refs)
    assert [e[1] for e in log if e[0] == "build"] == ["auto", "tq_k4v3", "tq_k3v4"]
    assert (r1["accuracy"], r1["auto_accuracy"], r1["passed"]) == (1.0, 1.0, True)
    assert (r2["accuracy"], r2["passed"]) == (0.0, False)
    assert r2["checks"][0]["max_drop"] == pytest.approx(gsm8k.sigma_max_drop(8, 3))
    assert r1["chance"] == gsm8k.chance_accuracy(gsm8k.load_items(base, 8))
    assert r1["samples"][0]["output"].startswith(" The result is")
    # another limit is another set of problems: auto runs again
    gsm8k.run_gsm8k(good, limit=4, factory=factory, reference_runs=refs)
    assert [e[1] for e in log if e[0] == "build"][-2:] == ["auto", "tq_k4v3"]
