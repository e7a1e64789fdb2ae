import re

import pytest

from tqattn.evals import niah

from .conftest import CharTokenizer, FakeLLM


def test_cases_are_seeded_six_digit_numbers():
    a = niah.make_cases([2048, 4096], [0.1, 0.5, 0.9], trials=2, seed=3)
    assert len(a) == 12 and a == niah.make_cases([2048, 4096], [0.1, 0.5, 0.9], trials=2, seed=3)
    assert all(re.fullmatch(r"[1-9]\d{5}", c.number) for c in a)
    assert len({c.number for c in a}) > 6
    assert a != niah.make_cases([2048, 4096], [0.1, 0.5, 0.9], trials=2, seed=4)
    with pytest.raises(ValueError, match="depth"):
        niah.make_cases([2048], [1.5])


def test_insert_needle_at_line_boundaries():
    text = "aaaa\nbbbb\ncccc\ndddd\n"
    assert niah.insert_needle(text, "N.", 0.0) == "N.\n" + text
    assert niah.insert_needle(text, "N.", 0.5) == "aaaa\nbbbb\nN.\ncccc\ndddd\n"
    assert niah.insert_needle(text, "N.", 1.0) == text + "N.\n"
    assert niah.insert_needle("no newline at all", "N.", 0.7) == "N.\nno newline at all"


@pytest.mark.parametrize("ctx, depth", [(600, 0.1), (1000, 0.5), (1500, 0.9)])
def test_prompt_fills_the_context(ctx, depth):
    tok = CharTokenizer()
    hay = tok("line of verse here\n" * 500)["input_ids"]
    case = niah.Case(ctx, depth, 0, "123456")
    prompt = niah.build_prompt(tok, hay, case)
    n = len(tok(prompt)["input_ids"])
    assert ctx - niah.MAX_TOKENS - 10 <= n <= ctx - niah.MAX_TOKENS
    assert prompt.count("123456") == 1 and niah.QUESTION in prompt
    body = prompt[prompt.index("\n\n") + 2:prompt.rindex("\n\n")]
    assert abs(body.index("The secret") / len(body) - depth) < 0.1
    with pytest.raises(ValueError, match="too short"):
        niah.build_prompt(tok, hay, niah.Case(100, 0.5, 0, "123456"))


def test_found():
    assert niah.found("The number is 482913.", "482913")
    assert niah.found("482,913", "482913")
    assert not niah.found("4829130", "482913")
    assert not niah.found("I don't know", "482913")


def test_run_niah_and_heatmaps(tmp_path, monkeypatch, fake_params):
    monkeypatch.setattr(niah.evdata, "shakespeare_text", lambda: "to be or not to be\n" * 2000)

    def answer(kv, prompt):  # "good" finds the needle only in the first half of the context
        m = re.search(r"harbour gate is (\d{6})", prompt)
        return f" {m.group(1)}" if kv != "bad" and prompt.index(m.group(0)) < len(prompt) / 2 else " 0"

    log = []
    res = niah.run_niah(lambda kv: FakeLLM(kv, answer, log), ["good", "bad"],
                        contexts=[400, 800], depths=[0.1, 0.9], trials=2)
    assert [e[1] for e in log if e[0] == "build"] == ["auto", "good", "bad"]
    assert res["presets"]["auto"]["accuracy"] == 0.5 and res["presets"]["bad"]["accuracy"] == 0
    assert niah.grid(res, "good") == [[1.0, 1.0], [0.0, 0.0]]
    paths = niah.plot_heatmaps(res, tmp_path, "tiny model")
    assert [p.name for p in paths] == ["niah_tiny-model_auto.png", "niah_tiny-model_good.png",
                                       "niah_tiny-model_bad.png"]
    assert all(p.stat().st_size > 1000 for p in paths)
